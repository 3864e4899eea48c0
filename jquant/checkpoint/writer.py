"""One safetensors writer for parameter trees: float leaves and QParams, named as checkpoints name them.

``checkpoint_tensors`` turns a tree into ``{tensor name: numpy array}``: each QParam becomes the tensors
``to_checkpoint`` gives in its layout, under its module's name joined by the layout's separator
(``tensor_name``); each MoE expert stack (``QExperts``) the tensors its format's expert checkpoints
hold (``jquant.checkpoint.experts.moe_stack_to_tensors``: gpt-oss MXFP4, DeepSeek-V3 block FP8; other
formats are refused); each float leaf becomes one tensor. ``save_checkpoint`` writes them with
``safetensors_file.save_file``. ``save_hf_checkpoint`` and ``export_safetensors`` both call it, so a
layout's tensor names are decided here and nowhere else.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import jax
import numpy as np

from jquant.checkpoint.base import to_checkpoint
from jquant.kernels.moe.experts import QExperts
from jquant.qtensor import QTensor
from jquant.schemes.qparam import QParam
from jquant.schemes.scheme import Prepared

# Layouts whose tensors hang off the module name with "_" (transformers' gpt-oss names its MXFP4
# experts ``mlp.experts.gate_up_proj_blocks`` / ``..._scales``); every other layout uses ".".
_UNDERSCORE_LAYOUTS = ("gpt-oss",)


def tensor_separator(layout: str | None) -> str:
    """What joins a module's name and its tensors' keys in ``layout`` (``"_"`` or ``"."``)."""
    return "_" if layout is not None and layout.split("/", 1)[0] in _UNDERSCORE_LAYOUTS else "."


def tensor_name(module: str, key: str, layout: str | None) -> str:
    """The checkpoint name of tensor ``key`` (a ``to_checkpoint`` key) of ``module`` in ``layout``."""
    return f"{module}{tensor_separator(layout)}{key}"


def _key_name(k) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def path_str(path) -> str:
    """A pytree key path as the ``/``-joined parameter path (``layers_0/q_proj/kernel``) that path rules,
    sharding rules and checkpoint names are written against."""
    return "/".join(_key_name(k) for k in path)


def _default_name(path: str) -> str:
    return path.replace("/", ".")


def checkpoint_tensors(params: Any, *, name_map: Callable[[str], str] | None = None,
                       kernel_to_weight: bool = False, layout: str | None = None,
                       layout_options: dict | None = None) -> dict[str, np.ndarray]:
    """The checkpoint tensors of ``params`` (a tree of float arrays and QParams holding QTensors).

    ``name_map`` turns a ``/``-joined module path (``layers_0/q_proj``) into the checkpoint's module
    name (default: the path joined with dots). A QParam at ``<module>/<leaf>`` is stored as
    ``to_checkpoint(qtensor, layout)`` (its scheme's layout unless ``layout`` is given; its scheme's
    layout options, updated by ``layout_options``, and its ``input_scale`` as options), each tensor
    named ``tensor_name(name_map(module), key, layout)``.

    Float leaves: with ``kernel_to_weight`` every one is ``<name_map(module)>.weight`` (HF names: one
    float tensor per module), a Flax ``kernel`` ``[K, N]`` transposed to PyTorch's ``[N, K]``; without
    it a leaf keeps its orientation and is named ``name_map(path)`` of its whole path.

    A ``QExperts`` at ``<module>/gate_up_proj`` or ``<module>/down_proj`` (a ``jquant.models.moe.MoE``
    layer's stacks) is stored as ``moe_stack_to_tensors`` gives it in ``layout`` or its scheme's layout,
    under ``name_map(module)`` (gpt-oss: ``<module>.gate_up_proj_blocks``; DeepSeek-V3:
    ``<module>.<e>.gate_proj.weight``), its sibling bias (``gate_up_bias`` / ``down_bias``) with it (gpt-oss
    interleaves it as it does the rows; DeepSeek-V3 holds none); ``layout_options`` do not apply to it.

    Raises ValueError for a QParam without a layout or with an input rotation, a bare QTensor, a kernel
    layout (Prepared), an expert stack in a layout no expert checkpoint uses, and two leaves that would
    share one tensor name.
    """
    from jquant.checkpoint.experts import LAYER_BIASES, moe_stack_to_tensors  # it imports this module

    name_map = name_map or _default_name
    tensors: dict[str, np.ndarray] = {}

    def put(name: str, value: np.ndarray, path: str) -> None:
        if name in tensors:
            raise ValueError(f"parameter {path!r}: tensor name {name!r} is already taken by another parameter")
        tensors[name] = value

    flat, _ = jax.tree_util.tree_flatten_with_path(
        params, is_leaf=lambda l: isinstance(l, (QParam, QExperts, QTensor, Prepared)))
    flat = [(path_str(keys), leaf) for keys, leaf in flat]
    # An expert stack's bias belongs to its tensors (gpt-oss interleaves it with the stack's rows), so it
    # is written with the stack, never as a float leaf of its own.
    leaves = dict(flat)

    def stack_bias(path: str) -> str | None:
        module, _, name = path.rpartition("/")
        bias = LAYER_BIASES.get(name)
        key = bias if bias is None or not module else f"{module}/{bias}"
        return key if key in leaves else None

    taken = {bias for path, leaf in flat if isinstance(leaf, QExperts) and (bias := stack_bias(path))}
    for path, leaf in flat:
        module, _, leaf_name = path.rpartition("/")
        if path in taken:
            continue
        if isinstance(leaf, QExperts):
            bias = stack_bias(path)
            lay = layout or leaf.scheme.checkpoint_layout
            for name, t in moe_stack_to_tensors(leaf_name, leaf.weight, lay, name_map(module) if module else "",
                                                bias=None if bias is None else leaves[bias], name=path).items():
                put(name, np.ascontiguousarray(t), path)
            continue
        module = module or path   # a top-level leaf is its own module
        if isinstance(leaf, QParam):
            if leaf.input_rotation is not None:
                raise ValueError(f"parameter {path!r} is quantized in a Hadamard-rotated basis (input_rotation="
                                 f"{leaf.input_rotation}); no checkpoint layout records the rotation its "
                                 "inputs need, so it would load as a wrong weight (save it with orbax: "
                                 "jquant.flax.orbax_io.save_quantized)")
            lay = layout or leaf.scheme.checkpoint_layout
            if lay is None:
                raise ValueError(f"parameter {path!r}: scheme {leaf.scheme.name!r} names no checkpoint layout; "
                                 "pass layout=")
            opts = leaf.scheme.layout_kwargs() | dict(layout_options or {})
            if leaf.input_scale is not None:
                opts["input_scale"] = np.asarray(leaf.input_scale)
            prefix = name_map(module)
            for key, t in to_checkpoint(leaf.qtensor, lay, **opts).items():
                put(tensor_name(prefix, key, lay), np.asarray(t, order="C"), path)  # keeps 0-d scales 0-d
        elif isinstance(leaf, QTensor):
            raise ValueError(f"parameter {path!r} is a bare QTensor; wrap it in a QParam to export it")
        elif isinstance(leaf, Prepared):
            raise ValueError(f"parameter {path!r} is a bare prepared weight (impl {leaf.impl!r}); export "
                             "the QTensor it was prepared from, in a QParam")
        elif kernel_to_weight:
            value = np.asarray(leaf)
            put(f"{name_map(module)}.weight",
                np.ascontiguousarray(value.T if leaf_name == "kernel" else value), path)
        else:
            put(name_map(path), np.ascontiguousarray(np.asarray(leaf)), path)
    return tensors


def save_checkpoint(params: Any, path: str | os.PathLike, *, metadata: dict[str, str] | None = None,
                    **options) -> dict[str, np.ndarray]:
    """Writes ``checkpoint_tensors(params, **options)`` to the safetensors file ``path``; returns them."""
    from jquant.checkpoint.safetensors_file import save_file

    tensors = checkpoint_tensors(params, **options)
    save_file(tensors, path, metadata=metadata)
    return tensors
