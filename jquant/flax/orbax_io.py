"""Saving and restoring quantized parameter trees.

``save_quantized`` writes an orbax checkpoint with two items: ``arrays`` (every array leaf, QTensor
codes and scales included, under its path) and ``structure`` (JSON: where the QParams / QExperts /
QTensors are, their static metadata and their schemes), so ``restore_quantized`` rebuilds the tree
without a target. ``export_safetensors`` writes the vLLM checkpoint tensors of each quantized kernel
(and of MoE expert stacks in the formats whose expert checkpoints jquant knows) instead.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jquant.checkpoint.experts import check_stack_arrays
from jquant.kernels.moe.experts import QExperts
from jquant.schemes.qparam import QParam
from jquant.qtensor import QTensor
from jquant.schemes.scheme import Scheme

_QT_LEAVES = ("data", "scale", "zero", "global_scale", "group_index")
_QT_META = ("fmt", "shape", "dtype", "block", "pack_axis", "options", "k_axis")


def _jsonable(value):
    if isinstance(value, tuple):
        return {"__tuple__": [_jsonable(v) for v in value]}
    if isinstance(value, np.dtype):
        return {"__dtype__": value.name}
    return value


def _from_json(value):
    if isinstance(value, dict) and "__tuple__" in value:
        return tuple(_from_json(v) for v in value["__tuple__"])
    if isinstance(value, dict) and "__dtype__" in value:
        return jnp.dtype(value["__dtype__"])
    if isinstance(value, list):
        return tuple(_from_json(v) for v in value)
    return value


def _encode_qtensor(qt: QTensor, prefix: str, arrays: dict) -> dict:
    meta = {k: _jsonable(getattr(qt, k)) for k in _QT_META}
    meta["leaves"] = {}
    for name in _QT_LEAVES:
        leaf = getattr(qt, name)
        if isinstance(leaf, QTensor):
            meta["leaves"][name] = {"qtensor": _encode_qtensor(leaf, f"{prefix}.{name}", arrays)}
        elif leaf is not None:
            arrays[f"{prefix}.{name}"] = np.asarray(leaf)
            meta["leaves"][name] = {"array": f"{prefix}.{name}"}
    return meta


def _decode_qtensor(meta: dict, arrays: dict) -> QTensor:
    kwargs = {k: _from_json(meta[k]) for k in _QT_META if k in meta}  # (older saves lack k_axis)
    for name, ref in meta["leaves"].items():
        kwargs[name] = _decode_qtensor(ref["qtensor"], arrays) if "qtensor" in ref else jnp.asarray(arrays[ref["array"]])
    return QTensor(**kwargs)


def _scheme_json(scheme: Scheme) -> dict:
    return scheme.to_dict()


def _path_key(path) -> str:
    from jquant.flax.rules import path_str

    return path_str(path)


def save_quantized(directory: str | os.PathLike, params: Any) -> None:
    """Saves a tree of arrays, QTensors, QParams (whose weights hold QTensors) and QExperts (MoE expert
    stacks: codes, scales, per-expert global scales, scheme) with orbax; a stack whose arrays disagree
    with its metadata (``check_stack_arrays``) is refused, naming the parameter. ``restore_quantized``
    shows a round trip.

    Examples:
      >>> import os, tempfile, numpy as np
      >>> from jquant.flax import quantize_params, save_quantized
      >>> qparams, _ = quantize_params({"dense": {"kernel": np.ones((64, 32), np.float32)}}, "int8_ch")
      >>> directory = tempfile.mkdtemp() + "/checkpoint"
      >>> save_quantized(directory, qparams)
      >>> {"arrays", "structure"} <= set(os.listdir(directory))   # orbax's items: the arrays, the tree
      True
    """
    import orbax.checkpoint as ocp

    arrays: dict[str, np.ndarray] = {}
    nodes: dict[str, dict] = {}

    def visit(path, leaf):
        key = _path_key(path)
        if isinstance(leaf, QExperts):
            # A node of its own: unflattening QExperts with a path string for its stack would fail its checks.
            check_stack_arrays(leaf.weight, f"parameter {key!r}")
            nodes[key] = {"qexperts": _encode_qtensor(leaf.weight, key, arrays), "scheme": _scheme_json(leaf.scheme)}
        elif isinstance(leaf, QParam):
            nodes[key] = {"qparam": _encode_qtensor(leaf.qtensor, key, arrays), "scheme": _scheme_json(leaf.scheme)}
            if leaf.input_scale is not None:
                arrays[f"{key}.input_scale"] = np.asarray(leaf.input_scale)
                nodes[key]["input_scale"] = f"{key}.input_scale"
            if leaf.input_rotation is not None:
                nodes[key]["input_rotation"] = leaf.input_rotation
        elif isinstance(leaf, QTensor):
            nodes[key] = {"qtensor": _encode_qtensor(leaf, key, arrays)}
        else:
            arrays[key] = np.asarray(leaf)
            nodes[key] = {"array": key}
        return None

    flat, treedef = jax.tree_util.tree_flatten_with_path(
        params, is_leaf=lambda l: isinstance(l, (QParam, QExperts, QTensor)))
    for path, leaf in flat:
        visit(path, leaf)
    skeleton = jax.tree_util.tree_unflatten(treedef, [_path_key(p) for p, _ in flat])
    structure = {"nodes": nodes, "skeleton": skeleton}
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckpt:
        ckpt.save(pathlib.Path(directory).absolute(),
                  ocp.args.Composite(arrays=ocp.args.StandardSave(arrays), structure=ocp.args.JsonSave(structure)))


def restore_quantized(directory: str | os.PathLike, *, prepare: bool = True) -> Any:
    """Rebuilds what ``save_quantized`` wrote; QParams are re-prepared for this device when ``prepare``
    (QExperts come back as saved: stacks have no prepared layout yet). A stored stack that no longer fits
    its metadata or scheme raises a ValueError naming the parameter, a metadata file that is not JSON
    (a directory save_quantized did not write, or a damaged one) a ValueError naming the file.

    Examples:
      >>> import tempfile, jax.numpy as jnp, numpy as np
      >>> from jquant.flax import quantize_params, restore_quantized, save_quantized
      >>> params = {"dense": {"kernel": np.random.default_rng(0).standard_normal((64, 32)).astype(np.float32)}}
      >>> qparams, _ = quantize_params(params, "int4_g32")
      >>> directory = tempfile.mkdtemp() + "/checkpoint"
      >>> save_quantized(directory, qparams)
      >>> back = restore_quantized(directory)["dense"]["kernel"]
      >>> back.scheme.name, bool(jnp.array_equal(back.qtensor.data, qparams["dense"]["kernel"].qtensor.data))
      ('int4_g32', True)
    """
    import orbax.checkpoint as ocp

    path = pathlib.Path(directory).absolute()
    if not path.exists():
        raise ValueError(f"no checkpoint at {str(path)!r}")
    try:
        with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckpt:
            restored = ckpt.restore(path, ocp.args.Composite(arrays=ocp.args.StandardRestore(),
                                                             structure=ocp.args.JsonRestore()))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:   # orbax's own error names no file
        raise ValueError(f"{_unreadable_metadata(path)} is not valid JSON ({e}): {str(path)!r} is not a "
                         "checkpoint that save_quantized wrote, or it is damaged") from e
    arrays, structure = restored["arrays"], restored["structure"]

    def build(key):
        node = structure["nodes"][key]
        if "array" in node:
            return jnp.asarray(arrays[node["array"]])
        if "qtensor" in node:
            return _decode_qtensor(node["qtensor"], arrays)
        if "qexperts" in node:
            try:
                scheme = Scheme.from_dict({k: _from_json(v) for k, v in node["scheme"].items()})
                return QExperts(check_stack_arrays(_decode_qtensor(node["qexperts"], arrays), "weight"), scheme)
            except (ValueError, TypeError, KeyError) as e:
                raise ValueError(f"checkpoint parameter {key!r} (expert stack): {e}") from e
        scheme = Scheme.from_dict({k: _from_json(v) for k, v in node["scheme"].items()})  # (older saves: flat)
        qt = _decode_qtensor(node["qparam"], arrays)
        input_scale = jnp.asarray(arrays[node["input_scale"]]) if "input_scale" in node else None
        return QParam(scheme.process_weights_after_loading(qt) if prepare else qt, scheme, input_scale,
                      node.get("input_rotation"))

    return _map_skeleton(structure["skeleton"], build)


def _unreadable_metadata(path: pathlib.Path) -> str:
    """The first of orbax's metadata files under ``path`` (``_CHECKPOINT_METADATA``, ``structure/metadata``,
    ``arrays/_METADATA``, ...) that is not JSON, quoted; else the directory."""
    for file in sorted(path.glob("**/*metadata", case_sensitive=False)):
        try:
            json.loads(file.read_bytes())
        except (UnicodeDecodeError, json.JSONDecodeError):
            return repr(str(file))
    return f"a metadata file under {str(path)!r}"


def _map_skeleton(node, fn: Callable[[str], Any]):
    if isinstance(node, dict):
        return {k: _map_skeleton(v, fn) for k, v in node.items()}
    if isinstance(node, list):
        return [_map_skeleton(v, fn) for v in node]
    return fn(node)


def export_safetensors(params: Any, path: str | os.PathLike, *, name_map: Callable[[str], str] | None = None,
                       layout: str | None = None, **layout_options) -> dict[str, np.ndarray]:
    """Writes each quantized kernel's checkpoint tensors (``to_checkpoint`` in its scheme's layout, or
    ``layout``) and every float leaf into one safetensors file; returns the tensors written.

    ``name_map`` turns a kernel's module path (``layers_0/q_proj``) into the checkpoint prefix
    (``model.layers.0.self_attn.q_proj``); the default joins the path with dots. A kernel's tensors
    are joined to that prefix as its layout names them (``.qweight``; gpt-oss ``_blocks``). Float
    leaves keep their Flax orientation and are named ``name_map`` of their whole path.
    """
    from jquant.checkpoint.writer import save_checkpoint

    return save_checkpoint(params, path, metadata={"format": "np", "producer": "jquant"}, name_map=name_map,
                           layout=layout, layout_options=layout_options)
