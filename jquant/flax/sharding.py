"""Tensor-parallel placement of (quantized) parameters with ``NamedSharding``.

Column-parallel layers split their output features, row-parallel layers their input features (as in
Megatron / vLLM). A QParam's codes, scales and zeros are split along the same axis (``QTensor.
sharding_tree``), and a split that would cut a quantization group is refused with the parameter path.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jquant.schemes.qparam import QParam
from jquant.flax.rules import path_str
from jquant.qtensor import QTensor
from jquant.schemes.scheme import Prepared

# Llama projections: q/k/v/gate/up split their outputs, o/down their inputs.
LLAMA_COLUMN = r".*(q|k|v|gate|up)_proj/kernel"
LLAMA_ROW = r".*(o|down)_proj/kernel"
# A vocab-parallel embedding table [vocab, hidden] splits its rows (jquant.parallel passes it).
LLAMA_VOCAB = r"embed_tokens/embedding"


def tensor_parallel_shardings(params: Any, mesh: Mesh, *, column: str = LLAMA_COLUMN, row: str = LLAMA_ROW,
                              vocab: str | None = None, axis: str = "tp") -> Any:
    """A tree of shardings matching ``params`` (QParams expand to per-leaf shardings); everything not
    matched by ``column`` / ``row`` (or ``vocab``: embedding tables split along their rows, e.g.
    ``LLAMA_VOCAB``) is replicated."""
    if axis not in mesh.axis_names:
        raise ValueError(f"mesh has axes {mesh.axis_names}, not {axis!r}")
    replicated = NamedSharding(mesh, P())

    def place(path, leaf):
        name = path_str(path)
        is_col, is_row = re.fullmatch(column, name), re.fullmatch(row, name)
        is_vocab = vocab is not None and re.fullmatch(vocab, name)
        if isinstance(leaf, QParam):
            # QTensor weights are [N, K]: column parallel splits N (axis 0), row parallel K (axis 1).
            spec = P(axis, None) if is_col else P(None, axis) if is_row else P()
            qt = leaf.qtensor
            try:
                tree = qt.sharding_tree(NamedSharding(mesh, spec))
            except ValueError as e:
                raise ValueError(f"parameter {name!r}: {e}") from e
            weight = leaf.weight
            if isinstance(weight, Prepared):
                weight = dataclasses.replace(weight, data=tree)
            else:
                weight = tree
            return dataclasses.replace(leaf, weight=weight)
        if isinstance(leaf, QTensor):
            raise ValueError(f"parameter {name!r} is a bare QTensor; wrap it in a QParam to shard it")
        if leaf.ndim == 2 and (is_col or is_row):  # float Flax kernels are [K, N]
            spec = P(None, axis) if is_col else P(axis, None)
            return NamedSharding(mesh, spec)
        if leaf.ndim == 2 and is_vocab:
            return NamedSharding(mesh, P(axis, None))
        return replicated

    return jax.tree_util.tree_map_with_path(place, params, is_leaf=lambda l: isinstance(l, (QParam, QTensor)))


def shard_tensor_parallel(params: Any, mesh: Mesh, **kwargs) -> Any:
    """``jax.device_put`` of ``params`` with ``tensor_parallel_shardings``."""
    return jax.device_put(params, tensor_parallel_shardings(params, mesh, **kwargs))
