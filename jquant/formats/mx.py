"""MX formats (OCP Microscaling v1.0): ``"mxfp4"``, ``"mxfp8_e4m3"``, ``"mxfp8_e5m2"``.

Every block of 32 values along ``axis`` shares one E8M0 scale (a power of two, stored as
``float8_e8m0fnu``: byte ``b`` means ``2^(b-127)``, 0xFF is NaN); elements are E2M1 codes packed two
per byte (low nibble = even element) for MXFP4, or float8 codes for MXFP8; ``x ≈ element · scale``.

``scale_mode`` picks the shared exponent exactly as torchao 0.18's ``to_mx`` (its
``ScaleCalculationMode``); ``emax`` is 2 (E2M1), 8 (E4M3) or 15 (E5M2), ``max`` 6, 448 or 57344:

- ``"floor"`` (OCP): ``floor(log2 amax) - emax`` from amax's float32 exponent bits.
- ``"ceil"``: the same plus one when amax's mantissa bits are non-zero.
- ``"even"``: amax rounded to the element's mantissa width (half up, on the bits) first, then floor.
- ``"rceil"`` (cuBLAS / NVIDIA): ``ceil(log2(amax / max))`` of the float32 quotient. torchao's eager
  fallback takes ``ceil`` of a float32 ``log2``; jquant uses the exact ceiling from the bits, as the
  hardware ``cvt.rp.satfinite.ue8m0`` does. The two differ only when ``amax / max`` lies within a few
  ulps above a power of two (float32 ``log2`` then rounds down onto the integer).

Exponents are clamped to [-127, 127] ("floor"/"ceil"/"even" allow 128, which only NaN reaches).
Elements: "floor"/"ceil"/"even" divide by the scale (floored at 2^-126, as torchao does so an
all-zero block divides by a normal number); "rceil" multiplies by ``2^(127-b)`` (by 1 when
``b == 0``, again as torchao). Then round-half-to-even, saturating at ±max.

``element_rounding="ggml"`` (MXFP4 with "floor") reproduces GGML / gguf-py's MXFP4 quantizer, which
picks the nearest E2M1 value by an ``argmin`` over its table: ties go to the smaller magnitude and a
value that rounds to zero is always stored as +0. Its exponent rule ``floor(log2f(amax)) - 2`` is
"floor", except that float32 ``log2f`` may round amaxes a few ulps below a power of two up onto it,
and that GGML wraps (does not clamp) exponents below -127.

Non-finite and zero blocks (torchao's behaviour): a NaN in a block makes its scale NaN (0xFF), so the
whole block dequantizes to NaN (its element codes are unspecified); ±Inf saturates to ±max in its
element under a scale of about 2^126, so it dequantizes to ±Inf again, and the block's other values
round to (signed) zero; an all-zero block
gets scale byte 0 (2^-127) and zero codes. XLA flushes float32 subnormals to zero, so scales or
values below 2^-126 (scale bytes 0 and 1) dequantize to zero where PyTorch would keep a subnormal.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jquant.formats.base import register_quantizer
from jquant.formats.blocking import block_axes, check_float_input, group_block, per_block, to_blocks
from jquant.formats.fp8 import saturating_cast
from jquant.formats.packing import pack_bits, unpack_bits
from jquant.qtensor import QTensor, register_format

BLOCK_SIZE = 32
SCALE_MODES = ("floor", "ceil", "even", "rceil")
ELEMENT_ROUNDINGS = ("even", "ggml")
E2M1_MAX = 6.0
# E2M1 code → value: bit 3 is the sign, bits 0-2 index the magnitudes.
E2M1_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)
_E8M0_BIAS = 127
_F32_MANTISSA_BITS = 23


@dataclasses.dataclass(frozen=True)
class _Element:
    max: float  # largest finite element value
    emax: int  # exponent of the largest power of two below ``max``
    mantissa_bits: int
    fp8_fmt: str | None  # fp8 format of the codes; None for packed E2M1


ELEMENTS = {
    "mxfp4": _Element(E2M1_MAX, 2, 1, None),
    "mxfp8_e4m3": _Element(448.0, 8, 3, "fp8_e4m3"),
    "mxfp8_e5m2": _Element(57344.0, 15, 2, "fp8_e5m2"),
}


# ---- E2M1 (shared with NVFP4) ----------------------------------------------------------------------

def e2m1_codes(values: jax.Array, ties: str = "even", sign: str = "signbit") -> jax.Array:
    """uint8 E2M1 codes of float32 ``values``, saturating at ±6.

    ``ties``: "even" (IEEE round-half-to-even) or "zero" (ties to the smaller magnitude, GGML).
    ``sign`` decides when bit 3 is set: "signbit" (any negative value, -0.0 too: torchao),
    "negative" (``v < 0``, so -0.0 stores +0: compressed-tensors' ``sign(x) · |q|``) or
    "nonzero" (``v < 0`` and a non-zero magnitude: GGML). Codes of NaN are unspecified.
    """
    magnitude = jnp.minimum(jnp.abs(values), E2M1_MAX)
    # E2M1 spacing: 0.5 below 2, 1 in [2, 4), 2 in [4, 6]; dividing by a power of two is exact.
    step = jnp.where(magnitude < 2, 0.5, jnp.where(magnitude < 4, 1.0, 2.0)).astype(jnp.float32)
    steps = magnitude / step
    steps = jnp.round(steps) if ties == "even" else jnp.ceil(steps - 0.5)
    rounded = steps * step
    code = jnp.where(rounded < 2, 2 * rounded, jnp.where(rounded < 4, rounded + 2, rounded / 2 + 4))
    negative = {"signbit": jnp.signbit(values),
                "negative": values < 0,
                "nonzero": (values < 0) & (rounded > 0)}[sign]
    return code.astype(jnp.uint8) | (negative.astype(jnp.uint8) << 3)


def e2m1_values(codes: jax.Array) -> jax.Array:
    """float32 values of uint8 E2M1 codes."""
    return jnp.asarray(E2M1_VALUES)[codes.astype(jnp.int32)]


# ---- E8M0 scales -----------------------------------------------------------------------------------

def _pow2(exponent: jax.Array) -> jax.Array:
    """Exact float32 ``2^exponent`` for integer exponents in [-126, 127] (built from the bits)."""
    return jax.lax.bitcast_convert_type((exponent + _E8M0_BIAS) << _F32_MANTISSA_BITS, jnp.float32)


def _times_pow2(x: jax.Array, exponent: jax.Array) -> jax.Array:
    """``x · 2^exponent`` for exponents in [-127, 127], as two normal factors: 2^-127 alone is a
    float32 subnormal, which XLA flushes to zero (PyTorch keeps it)."""
    half = exponent // 2
    return x * _pow2(half) * _pow2(exponent - half)


def _exponent_field(bits: jax.Array) -> jax.Array:
    return (bits >> _F32_MANTISSA_BITS) & 0xFF


def _mantissa_field(bits: jax.Array) -> jax.Array:
    return bits & ((1 << _F32_MANTISSA_BITS) - 1)


def _shared_exponent(amax: jax.Array, mode: str, element: _Element) -> jax.Array:
    """Biased E8M0 exponent (int32 in [0, 255]) of each block's float32 amax, as torchao's to_mx."""
    if mode == "rceil":
        bits = jax.lax.bitcast_convert_type(amax / element.max, jnp.int32)
        field, mantissa = _exponent_field(bits), _mantissa_field(bits)
        # Exact ceil(log2 d); a subnormal d is above 2^-127 exactly when its top mantissa bit is set.
        exponent = jnp.where(field == 0, jnp.where(mantissa > (1 << 22), -126, -127),
                             field - _E8M0_BIAS + (mantissa > 0))
        # ±Inf has field 255, mantissa 0 → clamps to 127 → byte 254, torchao's value for Inf.
        biased = jnp.clip(exponent, -_E8M0_BIAS, _E8M0_BIAS) + _E8M0_BIAS
    else:
        bits = jax.lax.bitcast_convert_type(amax, jnp.int32)
        if mode == "even":
            # Round amax to the element's mantissa width (add half a unit, drop the mantissa).
            half_unit = 1 << (_F32_MANTISSA_BITS - element.mantissa_bits - 1)
            bits = (bits + half_unit) & ~((1 << _F32_MANTISSA_BITS) - 1)
        exponent = _exponent_field(bits) - _E8M0_BIAS
        if mode == "ceil":
            exponent = exponent + (_mantissa_field(bits) > 0)
        biased = jnp.clip(exponent - element.emax, -_E8M0_BIAS, _E8M0_BIAS + 1) + _E8M0_BIAS
    return jnp.where(jnp.isnan(amax), 255, biased)


def _scale_elements(blocks: jax.Array, biased: jax.Array, mode: str) -> jax.Array:
    """Blocks (from ``to_blocks``) brought to the element range, before rounding."""
    biased = per_block(biased, blocks.ndim // 2)
    if mode == "rceil":
        # x · 2^(127-b); 2^-127 (b = 254, an Inf block) must not be flushed.
        scaled = _times_pow2(blocks, jnp.clip(_E8M0_BIAS - biased, -127, 126))
        scaled = jnp.where(biased == 0, blocks, scaled)  # torchao multiplies by 1 when b == 0
        return jnp.where(biased == 255, jnp.nan, scaled)  # a NaN block stays NaN
    scale = jax.lax.bitcast_convert_type(biased << _F32_MANTISSA_BITS, jnp.float32)  # b=255 → inf
    return blocks / jnp.maximum(scale, np.float32(2.0 ** -126))


# ---- quantize / dequantize -------------------------------------------------------------------------

def quantize_mx(x, fmt: str = "mxfp4", *, axis: int = -1, scale_mode: str = "floor",
                element_rounding: str = "even") -> QTensor:
    """Quantizes ``x`` to an MX format in blocks of 32 along ``axis`` (which 32 must divide).

    Args:
      x: float array (computed in float32).
      fmt: ``"mxfp4"``, ``"mxfp8_e4m3"`` or ``"mxfp8_e5m2"``.
      axis: the blocked axis (for a PyTorch ``[N, K]`` weight, -1).
      scale_mode: ``"floor"``, ``"ceil"``, ``"even"`` or ``"rceil"`` (see the module docstring).
      element_rounding: ``"even"`` (torchao, OCP) or ``"ggml"`` (MXFP4 with "floor" only).
    """
    if fmt not in ELEMENTS:
        raise ValueError(f"fmt must be one of {sorted(ELEMENTS)}, got {fmt!r}")
    if scale_mode not in SCALE_MODES:
        raise ValueError(f"scale_mode must be one of {SCALE_MODES}, got {scale_mode!r}")
    if element_rounding not in ELEMENT_ROUNDINGS:
        raise ValueError(f"element_rounding must be one of {ELEMENT_ROUNDINGS}, got {element_rounding!r}")
    if element_rounding == "ggml" and (fmt != "mxfp4" or scale_mode != "floor"):
        raise ValueError(f"element_rounding='ggml' is GGML's MXFP4 quantizer: it needs fmt='mxfp4' and "
                         f"scale_mode='floor', got fmt={fmt!r}, scale_mode={scale_mode!r}")
    x = check_float_input(x, "x")
    block = group_block(x.shape, axis, BLOCK_SIZE, "x")
    axis %= x.ndim
    data, scale = _encode(x, fmt, block, axis, scale_mode, element_rounding)
    return QTensor(data=data, scale=scale, fmt=fmt, shape=x.shape, dtype=x.dtype, block=block,
                   pack_axis=axis if fmt == "mxfp4" else None)


# One compiled program per shape and setting instead of dozens of eagerly dispatched ops.
@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4, 5))
def _encode(x, fmt, block, axis, scale_mode, element_rounding):
    element = ELEMENTS[fmt]
    blocks = to_blocks(x.astype(jnp.float32), block)
    amax = jnp.max(jnp.abs(blocks), axis=block_axes(x.ndim))
    biased = _shared_exponent(amax, scale_mode, element)
    scaled = _scale_elements(blocks, biased, scale_mode).reshape(x.shape)
    if element.fp8_fmt is None:
        ties, sign = ("zero", "nonzero") if element_rounding == "ggml" else ("even", "signbit")
        data = pack_bits(e2m1_codes(scaled, ties, sign), 4, axis)
    else:
        data = saturating_cast(scaled, element.fp8_fmt)
    return data, jax.lax.bitcast_convert_type(biased.astype(jnp.uint8), jnp.float8_e8m0fnu)


@functools.partial(jax.jit, static_argnums=1)
def dequantize_mx(qt: QTensor, dtype) -> jax.Array:
    """``element · 2^(b-127)`` in float32 (exact; byte 0 is 2^-127, as in torchao), then cast to
    ``dtype``; scale byte 0xFF gives NaN."""
    if qt.pack_axis is None:
        values = qt.data.astype(jnp.float32)
    else:
        values = e2m1_values(unpack_bits(qt.data, 4, axis=qt.pack_axis))
    biased = qt.expand(jax.lax.bitcast_convert_type(qt.scale, jnp.uint8).astype(jnp.int32))
    out = _times_pow2(values, jnp.clip(biased - _E8M0_BIAS, -127, 127))
    return jnp.where(biased == 255, jnp.nan, out).astype(dtype)


def _quantize_registered(fmt):
    def quantize(x, *, axis: int = -1, scale_mode: str = "floor", element_rounding: str = "even"):
        return quantize_mx(x, fmt, axis=axis, scale_mode=scale_mode, element_rounding=element_rounding)
    quantize.__doc__ = f"``quantize(x, {fmt!r}, axis=-1, scale_mode='floor')``: see ``jquant.formats.mx``."
    return quantize


for _fmt in ELEMENTS:
    register_format(_fmt, dequantize_mx)
    register_quantizer(_fmt, _quantize_registered(_fmt))
