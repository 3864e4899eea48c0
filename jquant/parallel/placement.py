"""What each device holds of a tensor-parallel Llama: its pieces of the parameters and of the KV cache.

Parameters are placed by ``jquant.flax.sharding`` (column parallel: q/k/v/gate/up, and a vocab-parallel
lm_head, split their outputs; row parallel: o/down their inputs; the embedding its vocab rows; a
QParam's codes, scales and zeros split along the same axis, a split through a quantization group
refused with the parameter's path). Each device's piece is then made a parameter of its own:

- a QTensor with the local shape, since the ``shard_map`` body sees local arrays and a QTensor's shape
  is static metadata;
- fused with its neighbours when the model fuses q/k/v and gate/up: device i's ``qkv_proj`` is
  ``[q_i | k_i | v_i]`` (vLLM's ``QKVParallelLinear``), which no split of the fused global kernel gives;
- laid out for that device's kernel (``process_weights_after_loading`` per device), as a kernel layout
  that interleaves rows (Hopper's W4A16) cannot be split after the fact.

The pieces are concatenated along axis 0 and split there over the mesh (``Sharded``), so the body sees
its own piece as a plain parameter. Norm scales (and the embedding when it is not vocab-parallel) are
replicated. Caches keep their layout and split their KV-heads axis.
"""

from __future__ import annotations

import dataclasses
import re
from typing import TYPE_CHECKING, Any

import jax
from flax import traverse_util
from jax.sharding import NamedSharding, PartitionSpec as P

from jquant.flax.sharding import LLAMA_COLUMN, LLAMA_ROW, LLAMA_VOCAB, tensor_parallel_shardings
from jquant.models.fused import FUSED, _fuse_kernels
from jquant.models.llama import KVCache
from jquant.qtensor import QTensor
from jquant.schemes.qparam import QParam

if TYPE_CHECKING:
    from jquant.parallel.llama import TensorParallel

# lm_head joins the column-parallel kernels when the vocabulary is split.
COLUMN_AND_LM_HEAD = r".*((q|k|v|gate|up)_proj|lm_head)/kernel"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Sharded:
    """One parameter as per-device pieces (``shard_params`` makes them): every leaf of rank 1 or more holds
    the devices' pieces concatenated along axis 0 and split there over the mesh, rank-0 leaves (a
    per-tensor scale) are the same on every device; static metadata (a QTensor's shape) describes one
    piece, which is what a ``shard_map`` body sees.

    Examples:
      >>> import jax.numpy as jnp
      >>> from jquant.parallel import Sharded, param_specs
      >>> kernel = Sharded(jnp.zeros((2 * 64, 48)))   # two devices' [64, 48] pieces, one after the other
      >>> param_specs({"q_proj": {"kernel": kernel}})["q_proj"]["kernel"]
      Sharded(pieces=P('tp',))
    """

    pieces: Any


def _flat(tree) -> dict:
    return traverse_util.flatten_dict(dict(tree), sep="/")


def _unflat(flat: dict) -> dict:
    return traverse_util.unflatten_dict(flat, sep="/")


def _as_qtensor_param(path: str, leaf):
    """A QParam holding its QTensor (a prepared layout is re-made per device after the split)."""
    if not isinstance(leaf, QParam):
        return leaf
    try:
        return dataclasses.replace(leaf, weight=leaf.qtensor)
    except ValueError as e:
        raise ValueError(f"parameter {path!r}: {e}") from e


def _split_axes(leaf, axis: str) -> tuple[bool, ...]:
    """Which axes of a placed parameter (of its QTensor's logical shape) are split over ``axis``."""
    array = leaf.qtensor.data if isinstance(leaf, QParam) else leaf
    spec = tuple(array.sharding.spec) + (None,) * array.ndim
    ndim = leaf.qtensor.ndim if isinstance(leaf, QParam) else array.ndim
    return tuple(spec[i] == axis for i in range(ndim))


def _local_metadata(path: str, leaf, split: tuple[bool, ...], tp: int):
    """The placed QParam with its QTensor's shape and blocks those of one device's piece (checked here,
    on the whole parameter; applied to the pieces inside the shard_map body)."""
    return local_qtensor_metadata(path, leaf.qtensor, split, tp, leaf.scheme)


def local_qtensor_metadata(path: str, qt: QTensor, split: tuple[bool, ...], tp: int, scheme=None):
    """``(shape, block)`` of one device's piece of ``qt`` (quantized under ``scheme``) when the axes
    marked in ``split`` are cut into ``tp`` parts; a split the pieces cannot carry is a ValueError naming
    ``path``: through act-order groups, nested scales, or the scheme's activation groups along K (a
    weight block cut in two keeps its scale whole on both sides, which is exact; an activation group
    cut in two would need a scale no device has)."""
    if isinstance(qt.scale, QTensor):
        raise ValueError(f"parameter {path!r}: {qt.fmt} with double-quantized scales cannot be split "
                         "across devices; quantize without nested scales")
    if qt.group_index is not None and split[qt.grouped_axis]:
        raise ValueError(f"parameter {path!r}: act-order g_idx indexes groups across the whole input axis, "
                         "which row parallelism splits; quantize it without act-order")
    shape = tuple(s // tp if cut else s for s, cut in zip(qt.shape, split))
    k_axis = qt.ndim - 1 if qt.k_axis is None else qt.k_axis
    if (scheme is not None and scheme.activation.mode == "dynamic_per_token_group" and split[k_axis]
            and shape[k_axis] % scheme.activation.group_size):
        raise ValueError(f"parameter {path!r}: scheme {scheme.name!r} quantizes activations in groups of "
                         f"{scheme.activation.group_size} along K, but each of {tp} devices holds "
                         f"K = {shape[k_axis]} of {qt.shape[k_axis]}")
    # A block spanning the split axis (per tensor, per channel) spans the piece's part of it.
    block = tuple(min(b, s) for b, s in zip(qt.block, shape)) if len(qt.block) == qt.ndim else qt.block
    return shape, block


def _fuse(piece: dict) -> dict:
    """One device's q/k/v and gate/up pieces joined as ``qkv_proj`` / ``gate_up_proj`` (``fused.FUSED``)."""
    piece = dict(piece)
    layers = sorted({m[1] for p in piece if (m := re.fullmatch(r"(.*)/q_proj/kernel", p))})
    for layer in layers:
        for name, parts in FUSED.items():
            kernels = [piece.pop(f"{layer}/{p}/kernel") for p in parts]
            piece[f"{layer}/{name}/kernel"] = _fuse_kernels(kernels, f"{layer}/{name}")
    return piece


def _piece_specs(tree, axis: str):
    return jax.tree.map(lambda a: P(axis) if a.ndim else P(), tree)


def _lay_out_qparam(param: QParam, device) -> QParam:
    return dataclasses.replace(param, weight=param.scheme.process_weights_after_loading(param.weight, device))


def _prepare(leaf, mesh, axis: str, lay_out=None):
    """A Sharded parameter laid out per device for that device's kernel: ``lay_out(piece, device)``
    (default: a QParam's ``process_weights_after_loading``; other leaves stay as they are). Where that is
    the XLA layout (the QTensor itself) the arrays are the same ones, nothing is computed."""
    if lay_out is None:
        if not isinstance(leaf.pieces, QParam):
            return leaf
        lay_out = _lay_out_qparam
    param = leaf.pieces
    devices = list(mesh.devices.flat)
    on = lambda a, d: next(s.data for s in a.addressable_shards if s.device == d)
    prepared = [lay_out(jax.tree.map(lambda a: on(a, d), param), d) for d in devices]
    if len({jax.tree.structure(p) for p in prepared}) != 1:
        raise ValueError("the devices' layouts of one parameter differ (devices of different kinds?)")

    def join(*pieces):
        if not pieces[0].ndim:
            return jax.make_array_from_single_device_arrays((), NamedSharding(mesh, P()), list(pieces))
        return jax.make_array_from_single_device_arrays((len(pieces) * pieces[0].shape[0], *pieces[0].shape[1:]),
                                                        NamedSharding(mesh, P(axis)), list(pieces))
    return Sharded(jax.tree.map(join, *prepared))


def shard_params(plan: TensorParallel, variables: dict) -> dict:
    """``variables`` (``{"params": ...}`` of ``plan.model``, with separate q/k/v and gate/up kernels,
    float or QParams) as the devices of ``plan.mesh`` hold them: split parameters become ``Sharded``
    (each device's piece with its own shape, fused per device when ``plan.model`` fuses projections,
    laid out for its device's kernel), the rest replicated. The result feeds ``TensorParallel.apply``,
    ``decode_step`` and ``generate`` of ``jquant.parallel``, not ``model.apply``.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from jquant.models import LlamaConfig, LlamaForCausalLM
      >>> from jquant.parallel import Sharded, shard_params, tensor_parallel
      >>> config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4,
      ...                      num_kv_heads=2, head_dim=16, rope_theta=1e4, rms_norm_eps=1e-5,
      ...                      max_position_embeddings=32)
      >>> model = LlamaForCausalLM(config, fused_projections=True)
      >>> params = LlamaForCausalLM(config).init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32))  # unfused
      >>> plan = tensor_parallel(model, min(2, jax.device_count()))
      >>> sharded = shard_params(plan, params)["params"]
      >>> qkv = sharded["layers_0"]["qkv_proj"]["kernel"]   # each device's [q_i | k_i | v_i], fused
      >>> isinstance(qkv, Sharded), qkv.pieces.addressable_shards[0].data.shape == (64, (4 + 2 + 2) * 16 // plan.tp)
      (True, True)
    """
    if "params" not in variables:
        raise ValueError("shard_params takes the model's variables, {'params': ...}")
    flat = _flat(variables["params"])
    fused = sorted(p for p in flat if p.split("/")[-2] in FUSED)
    if fused:
        raise ValueError(f"shard_params takes separate q/k/v and gate/up kernels and fuses them per device "
                         f"(the model's fused_projections); got fused ones: {fused[:2]}")
    flat = {p: _as_qtensor_param(p, v) for p, v in flat.items()}
    axis, mesh, tp = plan.axis, plan.mesh, plan.tp
    shardings = tensor_parallel_shardings(
        _unflat(flat), mesh, column=COLUMN_AND_LM_HEAD if plan.vocab_parallel else LLAMA_COLUMN, row=LLAMA_ROW,
        vocab=LLAMA_VOCAB if plan.vocab_parallel else None, axis=axis)
    placed = _flat(jax.device_put(_unflat(flat), shardings))
    splits = {p: cut for p, v in placed.items() if any(cut := _split_axes(v, axis))}
    local = {p: _local_metadata(p, placed[p], cut, tp) for p, cut in splits.items()
             if isinstance(placed[p], QParam)}
    whole = {p: placed[p] for p in splits}

    def body(whole):  # the device's pieces, given their own metadata, fused; one compiled program for all
        piece = {p: dataclasses.replace(v, weight=v.weight.replace(shape=local[p][0], block=local[p][1]))
                 if p in local else v for p, v in whole.items()}
        return _fuse(piece) if plan.model.fused_projections else piece

    in_specs = (jax.tree.map(lambda a: a.sharding.spec, whole),)
    # The pieces' structure (out_specs P(): one device's shapes) gives the specs of the real call.
    piece_shapes = jax.eval_shape(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=P(),
                                                check_vma=False), whole)
    pieces = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=_piece_specs(piece_shapes, axis),
                                   check_vma=False))(whole)
    out = {p: v for p, v in placed.items() if p not in splits}
    out.update({p: _prepare(Sharded(v), mesh, axis) for p, v in pieces.items()})
    return {**variables, "params": _unflat(out)}


def param_specs(variables: Any, axis: str = "tp") -> Any:
    """``shard_map`` in_specs of ``shard_params``'s output: the leaves of a ``Sharded`` parameter split on
    axis 0 (rank-0 ones replicated), everything else replicated.

    Examples:
      >>> import jax.numpy as jnp
      >>> from jquant.parallel import Sharded, param_specs
      >>> param_specs({"norm": jnp.ones(4), "q": Sharded(jnp.ones((2 * 4, 2)))})
      {'norm': P(), 'q': Sharded(pieces=P('tp',))}
    """
    return jax.tree.map(lambda x: _piece_specs(x, axis) if isinstance(x, Sharded) else P(), variables,
                        is_leaf=lambda x: isinstance(x, Sharded))


def local_params(variables: Any) -> Any:
    """Inside the ``shard_map`` body: every ``Sharded`` parameter as the device's piece, a plain parameter.

    Examples:
      >>> import jax.numpy as jnp
      >>> from jquant.parallel import Sharded, local_params
      >>> local_params({"norm": jnp.ones(4), "q": Sharded(jnp.ones((4, 2)))})["q"].shape  # a body's view
      (4, 2)
    """
    return jax.tree.map(lambda x: x.pieces if isinstance(x, Sharded) else x, variables,
                        is_leaf=lambda x: isinstance(x, Sharded))


def cache_specs(cache: Any, axis: str = "tp") -> Any:
    """``shard_map`` specs of a ``PagedCache`` or dense ``KVCache``: split on the KV-heads axis.

    A paged cache holds the KV heads on axis 2 of every array of rank 3 or more (pages ``[P, S, Hkv,
    D]``, per-(token, head) scales ``[P, S, Hkv]``), the dense one on axis 1 (keys and values ``[B, Hkv,
    L, D]``); lower ranks are block tables, lengths and per-tensor scales, which every device needs whole.

    Examples:
      >>> from jquant.kv import PagedCache
      >>> from jquant.parallel import cache_specs
      >>> cache = PagedCache.allocate("int8_per_token_head", num_layers=1, batch=1, max_len=16, kv_heads=2,
      ...                             head_dim=16, page_size=8)
      >>> specs = cache_specs(cache)
      >>> specs.layers[0].k_pages, specs.layers[0].k_scale, specs.block_tables
      (P(None, None, 'tp'), P(None, None, 'tp'), P())
    """
    heads_axis = 1 if isinstance(cache, KVCache) else 2
    return jax.tree.map(lambda a: P(*[None] * heads_axis, axis) if a.ndim >= 3 else P(), cache)


def shard_cache(plan: TensorParallel, cache: Any) -> Any:
    """``cache`` placed on ``plan.mesh`` as ``cache_specs`` splits it (each device holds its KV heads'
    pages and scales), ready to donate to ``jquant.parallel.decode_step``.

    Examples:
      >>> import jax
      >>> from jquant.models import LlamaConfig, LlamaForCausalLM
      >>> from jquant.models.llama import new_cache
      >>> from jquant.parallel import shard_cache, tensor_parallel
      >>> config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4,
      ...                      num_kv_heads=2, head_dim=16, rope_theta=1e4, rms_norm_eps=1e-5,
      ...                      max_position_embeddings=32)
      >>> model = LlamaForCausalLM(config)
      >>> plan = tensor_parallel(model, min(2, jax.device_count()))
      >>> cache = shard_cache(plan, new_cache(model, batch=2, max_len=32, kv_cache_dtype="fp8"))
      >>> pages = cache.layers[0].k_pages                      # [pages, page size, KV heads, head dim]
      >>> pages.addressable_shards[0].data.shape[2] == 2 // plan.tp
      True
    """
    specs = cache_specs(cache, plan.axis)
    shardings = jax.tree.map(lambda s: NamedSharding(plan.mesh, s), specs, is_leaf=lambda x: isinstance(x, P))
    return jax.device_put(cache, shardings)
