"""FP4 checkpoint layouts: ``"gpt-oss"`` and ``"compressed-tensors/mxfp4-pack-quantized"`` (MXFP4),
``"compressed-tensors/nvfp4-pack-quantized"`` and ``"modelopt/nvfp4"``.

All take and give QTensors in PyTorch orientation ``[..., N, K]`` blocked along K (the last axis),
codes packed two per byte with the even element in the low nibble, as every one of these files is.

- gpt-oss (transformers' ``integrations/mxfp4``): ``blocks`` uint8 ``[..., N, K/32, 16]`` and
  ``scales`` uint8 ``[..., N, K/32]`` (biased exponents, 2^(s-127)). The checkpoint names them
  ``<proj>_blocks`` / ``<proj>_scales`` (e.g. ``mlp.experts.gate_up_proj_blocks``), joined with "_".
  Leading expert axes are kept.
- compressed-tensors 0.20.1 ``mxfp4-pack-quantized``: ``weight_packed`` uint8 ``[N, K/2]`` and
  ``weight_scale`` uint8 ``[N, K/32]`` (biased exponents, as gpt-oss's ``scales``).
- compressed-tensors 0.20.1 ``nvfp4-pack-quantized``: ``weight_packed`` uint8 ``[N, K/2]``,
  ``weight_scale`` float8_e4m3fn ``[N, K/16]``, ``weight_global_scale`` float32 ``[1]`` (the divisor)
  and, with static activation scales, ``input_global_scale`` float32 ``[1]``.
- ModelOpt NVFP4: ``weight`` uint8 ``[N, K/2]``, ``weight_scale`` float8_e4m3fn ``[N, K/16]``,
  ``weight_scale_2`` float32 scalar (the multiplier, written 0-d; ``[1]`` is read too) and
  ``input_scale`` float32 scalar.

An NVFP4 QTensor of the other convention is written with the reciprocal per-tensor scale computed
in float32, as compressed-tensors' ModelOpt converter does. Its dequantized values then differ in
the last bit unless the scale is a power of two, so such an export raises a ValueError with the
largest change unless ``lossy=True`` (a warning); quantize with the layout's ``convention=`` to export
exactly. One without a per-tensor scale is written with 1.0, which dequantizes identically.

NVFP4 blocks are 16 elements along K; ``from_checkpoint`` refuses a ``group_size=`` option or scales
implying any other block. Loaded QTensors have the logical dtype ``dtype=`` (default float32).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jquant.checkpoint.base import check_exact, register_layout, require
from jquant.formats import mx, nvfp4
from jquant.qtensor import QTensor

_CT = "compressed-tensors/nvfp4-pack-quantized"
_CT_MXFP4 = "compressed-tensors/mxfp4-pack-quantized"
_MODELOPT = "modelopt/nvfp4"


# ---- shared checks ---------------------------------------------------------------------------------

def _check_last_axis(qt: QTensor, fmt: str, block: int, layout: str) -> None:
    if qt.fmt != fmt:
        raise ValueError(f"{layout} stores fmt={fmt!r}, got a QTensor with fmt={qt.fmt!r}")
    expected = (1,) * (qt.ndim - 1) + (block,)
    if qt.ndim < 2 or qt.block != expected or qt.pack_axis != qt.ndim - 1:
        raise ValueError(f"{layout} needs a [..., N, K] weight blocked by {block} and packed along K "
                         f"(the last axis); got shape {qt.shape}, block {qt.block}, "
                         f"pack_axis {qt.pack_axis}")


def _array(tensors: dict, name: str, dtype, layout: str) -> np.ndarray:
    array = np.asarray(tensors[name])
    if array.dtype != np.dtype(dtype):
        raise ValueError(f"{layout}: tensor {name!r} must be {np.dtype(dtype)}, got {array.dtype} "
                         f"(shape {array.shape})")
    return array


def _check_packed(packed: np.ndarray, scale: np.ndarray, names: tuple[str, str], block: int,
                  layout: str) -> tuple[int, ...]:
    """Logical [..., N, K] shape of packed codes [..., N, K/2] with scales [..., N, K/block]."""
    k = packed.shape[-1] * 2 if packed.ndim else 0
    fits = packed.ndim >= 2 and scale.shape[:-1] == packed.shape[:-1] and scale.ndim == packed.ndim
    if fits and scale.shape[-1] and k % scale.shape[-1] == 0 and k // scale.shape[-1] != block:
        raise ValueError(f"{layout}: tensor {names[1]!r} {scale.shape} holds one scale per "
                         f"{k // scale.shape[-1]} elements of K={k} ({names[0]!r} {packed.shape}), but the "
                         f"layout's blocks are {block} elements (group_size {block}); other group sizes "
                         f"are not supported")
    if not fits or scale.shape[-1] * block != k:
        raise ValueError(f"{layout}: tensors {names[0]!r} {packed.shape} and {names[1]!r} {scale.shape} "
                         f"do not fit: expected [..., N, K/2] and [..., N, K/{block}] with K a "
                         f"multiple of {block}")
    return packed.shape[:-1] + (k,)


def _scalar(tensors: dict, name: str, layout: str) -> jax.Array:
    value = np.asarray(tensors[name])
    if value.dtype != np.float32 or value.size != 1 or value.ndim > 1:
        raise ValueError(f"{layout}: tensor {name!r} must be a float32 scalar or [1], got "
                         f"{value.dtype} shape {value.shape}")
    return jnp.asarray(value.reshape(()))


def _nvfp4_qtensor(packed, scale, global_scale, shape, convention, dtype) -> QTensor:
    ndim = len(shape)
    return QTensor(data=jnp.asarray(packed), scale=jnp.asarray(scale), global_scale=global_scale,
                   fmt="nvfp4", shape=shape, dtype=dtype, block=(1,) * (ndim - 1) + (nvfp4.BLOCK_SIZE,),
                   pack_axis=ndim - 1, options=(("convention", convention),))


def _global_scale_as(qt: QTensor, convention: str) -> np.ndarray:
    """The QTensor's per-tensor scale in ``convention``'s units (a reciprocal across conventions)."""
    if qt.global_scale is None:
        return np.float32(1.0)
    value = np.asarray(qt.global_scale, np.float32).reshape(())
    return value if qt.option("convention") == convention else np.float32(1.0) / value


def _optional_scalar(value, name: str) -> np.ndarray | None:
    if value is None:
        return None
    value = np.asarray(value, np.float32)
    if value.size != 1:
        raise ValueError(f"{name} must be a scalar, got shape {value.shape}")
    return value.reshape(())


# ---- gpt-oss (MXFP4) -------------------------------------------------------------------------------

def gpt_oss_to_checkpoint(qt: QTensor) -> dict[str, np.ndarray]:
    _check_last_axis(qt, "mxfp4", mx.BLOCK_SIZE, "gpt-oss")
    scales = _mxfp4_scale_bytes(qt, "gpt-oss")
    groups = qt.shape[-1] // mx.BLOCK_SIZE
    blocks = np.asarray(qt.data).reshape(*qt.shape[:-1], groups, mx.BLOCK_SIZE // 2)
    return {"blocks": blocks, "scales": scales}


def gpt_oss_from_checkpoint(tensors: dict, dtype=jnp.float32) -> QTensor:
    require(tensors, ("blocks", "scales"), "gpt-oss")
    blocks = _array(tensors, "blocks", np.uint8, "gpt-oss")
    scales = _array(tensors, "scales", np.uint8, "gpt-oss")
    if blocks.ndim < 3 or blocks.shape[-1] != mx.BLOCK_SIZE // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"gpt-oss: tensors 'blocks' {blocks.shape} and 'scales' {scales.shape} do not "
                         f"fit: expected [..., N, K/32, 16] and [..., N, K/32]")
    shape = scales.shape[:-1] + (scales.shape[-1] * mx.BLOCK_SIZE,)
    return _mxfp4_qtensor(blocks.reshape(*shape[:-1], shape[-1] // 2), scales, shape, dtype)


def _mxfp4_qtensor(packed: np.ndarray, scales: np.ndarray, shape: tuple[int, ...], dtype) -> QTensor:
    """An MXFP4 QTensor from codes [..., N, K/2] and biased exponents [..., N, K/32] (uint8)."""
    ndim = len(shape)
    return QTensor(data=jnp.asarray(packed), scale=jnp.asarray(scales.view(ml_dtypes.float8_e8m0fnu)), fmt="mxfp4",
                   shape=shape, dtype=dtype, block=(1,) * (ndim - 1) + (mx.BLOCK_SIZE,), pack_axis=ndim - 1)


def _mxfp4_scale_bytes(qt: QTensor, layout: str) -> np.ndarray:
    if np.asarray(qt.scale).dtype != ml_dtypes.float8_e8m0fnu:
        raise ValueError(f"{layout} stores scales as E8M0 bytes, got a QTensor with {np.asarray(qt.scale).dtype} "
                         f"scales; quantize with jquant.quantize(x, 'mxfp4')")
    return np.asarray(qt.scale).view(np.uint8)


def _is_gpt_oss(tensors: dict) -> bool:
    return "blocks" in tensors and "scales" in tensors


# ---- compressed-tensors mxfp4-pack-quantized -------------------------------------------------------

def ct_mxfp4_to_checkpoint(qt: QTensor) -> dict[str, np.ndarray]:
    _check_last_axis(qt, "mxfp4", mx.BLOCK_SIZE, _CT_MXFP4)
    return {"weight_packed": np.asarray(qt.data), "weight_scale": _mxfp4_scale_bytes(qt, _CT_MXFP4)}


def ct_mxfp4_from_checkpoint(tensors: dict, dtype=jnp.float32, group_size: int | None = None) -> QTensor:
    if group_size is not None and group_size != mx.BLOCK_SIZE:
        raise ValueError(f"{_CT_MXFP4}: group_size={group_size!r} given, but MXFP4 blocks are {mx.BLOCK_SIZE} "
                         f"elements along K")
    require(tensors, ("weight_packed", "weight_scale"), _CT_MXFP4)
    packed = _array(tensors, "weight_packed", np.uint8, _CT_MXFP4)
    scale = _array(tensors, "weight_scale", np.uint8, _CT_MXFP4)
    shape = _check_packed(packed, scale, ("weight_packed", "weight_scale"), mx.BLOCK_SIZE, _CT_MXFP4)
    return _mxfp4_qtensor(packed, scale, shape, dtype)


def _is_ct_mxfp4(tensors: dict) -> bool:
    packed, scale = tensors.get("weight_packed"), tensors.get("weight_scale")
    return (packed is not None and scale is not None and np.asarray(packed).dtype == np.uint8
            and np.asarray(scale).dtype == np.uint8 and "weight_global_scale" not in tensors)


# ---- NVFP4: compressed-tensors nvfp4-pack-quantized and ModelOpt ----------------------------------
# The two layouts store the same codes and E4M3 block scales; they differ in tensor names and in the
# global scale's convention (compressed-tensors keeps the divisor [1], ModelOpt its reciprocal []).

@dataclasses.dataclass(frozen=True)
class _NVFP4Names:
    layout: str
    convention: str
    packed: str
    global_scale: str
    input_scale: str
    global_shape: tuple[int, ...]


_CT_NAMES = _NVFP4Names(_CT, "compressed-tensors", "weight_packed", "weight_global_scale", "input_global_scale", (1,))
_MODELOPT_NAMES = _NVFP4Names(_MODELOPT, "modelopt", "weight", "weight_scale_2", "input_scale", ())


def _check_convention(qt: QTensor, names: _NVFP4Names, stored: np.ndarray, lossy: bool) -> None:
    """Refuses (warns, with ``lossy``) a per-tensor scale whose reciprocal changes the weight's values."""
    if qt.global_scale is None or qt.option("convention") == names.convention:
        return
    restored = _nvfp4_qtensor(qt.data, qt.scale, jnp.asarray(stored.reshape(())), qt.shape, names.convention,
                              qt.dtype)
    check_exact(qt.dequantize(jnp.float32), restored.dequantize(jnp.float32), layout=names.layout, lossy=lossy,
                what=f"tensor {names.global_scale!r} (the {qt.option('convention')} per-tensor scale "
                     f"{float(np.asarray(qt.global_scale))!r} stored as its float32 reciprocal "
                     f"{float(stored.reshape(()))!r}) dequantized",
                fix=f"quantize with jquant.quantize(x, 'nvfp4', convention={names.convention!r})")


def _nvfp4_to(names: _NVFP4Names):
    def to_checkpoint(qt: QTensor, lossy: bool = False, **options) -> dict[str, np.ndarray]:
        unknown = set(options) - {names.input_scale}
        if unknown:
            raise TypeError(f"{names.layout}: unknown option(s) {sorted(unknown)}; accepted: {names.input_scale}")
        _check_last_axis(qt, "nvfp4", nvfp4.BLOCK_SIZE, names.layout)
        global_scale = _global_scale_as(qt, names.convention)
        _check_convention(qt, names, global_scale, lossy)
        out = {names.packed: np.asarray(qt.data),
               "weight_scale": np.asarray(qt.scale),
               names.global_scale: global_scale.reshape(names.global_shape)}
        input_scale = _optional_scalar(options.get(names.input_scale), names.input_scale)
        if input_scale is not None:
            out[names.input_scale] = input_scale.reshape(names.global_shape)
        return out

    return to_checkpoint


def _nvfp4_from(names: _NVFP4Names):
    def from_checkpoint(tensors: dict, dtype=jnp.float32, group_size: int | None = None) -> QTensor:
        if group_size is not None and group_size != nvfp4.BLOCK_SIZE:
            raise ValueError(f"{names.layout}: group_size={group_size!r} given, but NVFP4 blocks are "
                             f"{nvfp4.BLOCK_SIZE} elements along K (group_size {nvfp4.BLOCK_SIZE}); other group "
                             f"sizes are not supported")
        require(tensors, (names.packed, "weight_scale", names.global_scale), names.layout)
        packed = _array(tensors, names.packed, np.uint8, names.layout)
        scale = _array(tensors, "weight_scale", ml_dtypes.float8_e4m3fn, names.layout)
        shape = _check_packed(packed, scale, (names.packed, "weight_scale"), nvfp4.BLOCK_SIZE, names.layout)
        global_scale = _scalar(tensors, names.global_scale, names.layout)
        if names.input_scale in tensors:
            # A W4A4 checkpoint's static activation scale: NVFP4 runs weight-only here, as vLLM runs it on
            # Hopper (Marlin, W4A16), which loads the scale and leaves it unused. Read and shape-checked
            # (nvfp4_input_global_scale gives it to a caller that quantizes activations), not applied.
            _scalar(tensors, names.input_scale, names.layout)
        return _nvfp4_qtensor(packed, scale, global_scale, shape, names.convention, dtype)

    return from_checkpoint


def _nvfp4_detect(names: _NVFP4Names):
    def detect(tensors: dict) -> bool:
        packed = tensors.get(names.packed)
        return packed is not None and np.asarray(packed).dtype == np.uint8 and names.global_scale in tensors

    return detect


# ---- activations -----------------------------------------------------------------------------------

def nvfp4_input_global_scale(tensors: dict, convention: str = "compressed-tensors") -> jax.Array | None:
    """A checkpoint's static activation scale (``input_global_scale`` or ModelOpt's ``input_scale``)
    in ``convention``'s units, for ``quantize(x, "nvfp4", convention=..., global_scale=...)``; None
    when the checkpoint has none (dynamic activations)."""
    if convention not in nvfp4.CONVENTIONS:
        raise ValueError(f"convention must be one of {nvfp4.CONVENTIONS}, got {convention!r}")
    for name, own in (("input_global_scale", "compressed-tensors"), ("input_scale", "modelopt")):
        if name in tensors:
            value = _scalar(tensors, name, "nvfp4")
            return value if own == convention else jnp.float32(1.0) / value
    return None


register_layout("gpt-oss", gpt_oss_to_checkpoint, gpt_oss_from_checkpoint, fmts=("mxfp4",),
                detect=_is_gpt_oss)
register_layout(_CT_MXFP4, ct_mxfp4_to_checkpoint, ct_mxfp4_from_checkpoint, fmts=("mxfp4",),
                detect=_is_ct_mxfp4)
for _names in (_CT_NAMES, _MODELOPT_NAMES):
    register_layout(_names.layout, _nvfp4_to(_names), _nvfp4_from(_names), fmts=("nvfp4",),
                    detect=_nvfp4_detect(_names), rounds=True)
