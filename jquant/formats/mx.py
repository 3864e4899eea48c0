"""MX formats (OCP Microscaling v1.0): ``"mxfp4"``, ``"mxfp8_e4m3"``, ``"mxfp8_e5m2"``.

Every block of 32 values along ``axis`` shares one E8M0 scale (a power of two, stored as
``float8_e8m0fnu``: byte ``b`` means ``2^(b-127)``, 0xFF is NaN); elements are E2M1 codes packed two
per byte (low nibble = even element) for MXFP4, or float8 codes for MXFP8; ``x ≈ element · scale``.

``scale_mode`` picks the shared exponent exactly as torchao 0.18's ``to_mx`` (its
``ScaleCalculationMode``); ``emax`` is 2 (E2M1), 8 (E4M3) or 15 (E5M2), ``max`` 6, 448 or 57344:

- ``"floor"`` (OCP): ``floor(log2 amax) - emax`` from amax's float32 exponent bits.
- ``"ceil"``: the same plus one when amax's mantissa bits are non-zero.
- ``"even"``: amax rounded to the element's mantissa width (half up, on the bits) first, then floor.
- ``"even_e2m1"``: as "even" with E2M1's one mantissa bit whatever the element: compressed-tensors'
  ``generate_mx_scales`` for MXFP4 and MXFP8 (an amax from 1.75 · 2^e up rounds to 2^(e+1), where
  "even" on E4M3's three bits rounds from 1.9375 · 2^e).
- ``"rceil"`` (cuBLAS / NVIDIA): ``ceil(log2(amax / max))`` of the float32 quotient, exactly (from its
  bits, as the hardware ``cvt.rp.satfinite.ue8m0`` does; a quotient in the float32 subnormal range,
  which XLA flushes, is decided on amax itself).
- ``"rceil_log2f"``: torchao's eager RCEIL fallback bit for bit, ``ceil`` of a float32 ``log2``,
  which rounds quotients a few float32 steps above 2^k down onto k (also just above 2^-127).

Exponents are clamped to [-127, 127] ("floor", "ceil" and the "even" modes allow 128, which only NaN
reaches). Elements: these modes divide by the scale (floored at 2^-126, as torchao does so an
all-zero block divides by a normal number; compressed-tensors' elements below do not floor it);
"rceil" multiplies by ``2^(127-b)`` (by 1 when ``b == 0``, again as torchao). Then round-half-to-even,
saturating at ±max. Every scale is a power of two, so elements are scaled exactly, subnormal inputs
included (XLA reads those as zero; they are rebuilt from their bits): codes match torchao's for every
finite input.

``element_rounding="ggml"`` (MXFP4) is gguf-py's MXFP4 quantizer, which picks the nearest E2M1
value by an ``argmin`` over its table: ties go to the smaller magnitude and a value that rounds to
zero is stored as +0. Its exponent is ``uint8(floor(log2f(amax)) - 2 + 127)``: float32 ``log2f``
rounds amaxes a few float32 steps below 2^k up onto k (reproduced from a table of those windows,
checked against numpy's log2f), the uint8 cast wraps (amaxes below 2^-125 give bytes 232-255), byte 0
means 2^-127 for the elements too, and under byte 253 (2^126) GGML's candidates 4 and 6 overflow so
the largest element is 3. One byte cannot be matched: gguf's wrapped 255 (amax in [2^-126, 2^-125))
is NaN in E8M0, so jquant stores 254, which gives the same zero codes and dequantized zeros.

``element_rounding="compressed-tensors"`` (with ``scale_mode="even"`` for MXFP4 and ``"even_e2m1"`` for
MXFP8: the ``like="compressed-tensors"`` presets) is compressed-tensors' MXFP4A16 / MXFP8A16 quantizer
(``generate_mx_scales``: the group amax rounded up to the next power of two from 1.75 · 2^e in the
weight's dtype, then ``floor(log2) - emax``): elements are divided by the scale itself, 2^-127 under byte
0 where torchao divides by 2^-126 (groups of amax below about 2^-124 for MXFP4, 2^-118 for MXFP8), then
rounded half to even; MXFP4 stores -0.0 as +0 (``cast_to_fp4``'s ``sign(x) · |q|``), MXFP8 keeps it (a
float8 cast). Its rounded amax overflows to Inf from 1.75 · 2^127 up and for ±Inf, and a NaN makes its
exponent 0: such blocks come out of it as zero codes (or ±max under 2^-127); jquant keeps torchao's results
for them (below).

``element_rounding="modelopt"`` (MXFP8, with ``scale_mode="rceil_log2f"``: the ``like="modelopt"`` preset) is
TensorRT Model Optimizer's ``MXFP8QTensor`` (``2^ceil(log2(amax / 448))`` in float32, as torchao's eager RCEIL):
elements are multiplied by ``2^(127-b)`` for every byte, 2^127 under byte 0 where torchao multiplies by 1.

Non-finite and zero blocks (torchao's behaviour): a NaN in a block makes its scale NaN (0xFF), so the
whole block dequantizes to NaN (its element codes are unspecified), at every tensor size (the amax is
an integer max of |x|'s bits, which keeps NaN where XLA's float max drops it); ±Inf saturates to
±max in its element under a scale of about 2^126, so it dequantizes to ±Inf again, and the block's
other values round to (signed) zero; other blocks are untouched. An all-zero block gets scale byte 0
(2^-127) and zero codes. With "ggml", NaN blocks follow torchao (NaN scale) and an Inf block gets
torchao's scale byte 253 too, but GGML's element grid stops at 3 under that byte, so ±Inf dequantizes
to ±3·2^126 ≈ ±2.55e38, the largest value the block holds, not to ±Inf (deliberately not gguf-py's
result: it writes exponent 0 for NaN and Inf blocks, so both silently become tiny finite values).
Dequantized values below 2^-126 (an element under 2 with scale byte 0, under 1 with byte 1, or an FP8
subnormal element with a small scale) are float32 subnormals, exact as PyTorch keeps them: they are
built from their bits (``subnormal.unlift64``), as XLA flushes such products.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jquant.formats import subnormal
from jquant.formats.base import register_preset, register_quantizer
from jquant.formats.blocking import block_axes, check_float_input, group_block, per_block, to_blocks
from jquant.formats.exact import abs_bits, exact_divide, to_float32_exact
from jquant.formats.fp8 import saturating_cast
from jquant.formats.packing import pack_bits, unpack_bits
from jquant.qtensor import QTensor, register_format

BLOCK_SIZE = 32
SCALE_MODES = ("floor", "ceil", "even", "even_e2m1", "rceil", "rceil_log2f")
ELEMENT_ROUNDINGS = ("even", "ggml", "compressed-tensors", "modelopt")
# element_rounding → (E2M1 ties, when the sign bit is set): see ``e2m1_codes``.
_E2M1_RULES = {"even": ("even", "signbit"), "ggml": ("zero", "nonzero"), "compressed-tensors": ("even", "negative")}
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


def _times_pow2_exact(x: jax.Array, exponent: jax.Array) -> jax.Array:
    """``_times_pow2`` that also scales subnormal ``x`` (XLA reads them as zero, PyTorch does not).

    A subnormal is its mantissa field (an integer below 2^23) times 2^-149, rebuilt here from the bits
    as ``(mantissa · 2^-23) · 2^(exponent - 126)``; a result still below 2^-126 is flushed, which no
    element format can tell from zero except by its sign.
    """
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    magnitude = _mantissa_field(bits).astype(jnp.float32) * np.float32(2.0 ** -_F32_MANTISSA_BITS)
    tiny = _times_pow2(jnp.where(bits < 0, -magnitude, magnitude), jnp.maximum(exponent - 126, -252))
    return jnp.where(_exponent_field(bits) == 0, tiny, _times_pow2(x, exponent))


def _exponent_field(bits: jax.Array) -> jax.Array:
    return (bits >> _F32_MANTISSA_BITS) & 0xFF


def _mantissa_field(bits: jax.Array) -> jax.Array:
    return bits & ((1 << _F32_MANTISSA_BITS) - 1)


@functools.cache
def _log2f_windows(direction: int) -> np.ndarray:
    """For 2^k, k in [-127, 128] (index k + 127): how many float32 steps below (direction -1) or above
    (+1) 2^k float32 ``log2`` still returns exactly k; steps below 2^-126 are subnormal ones.

    log2 there is ``k ± ε/ln 2``, which rounds onto k while under half an ulp of k. These counts use
    correctly rounded log2f (float64 log2 rounded once), which agrees with numpy's float32 log2
    (gguf-py) and torch's (torchao's eager rceil) at every such boundary (checked when the
    adversarial goldens were made: tests/test_fp4_adversarial.py).
    """
    counts = np.zeros(256, np.int32)
    for k in range(-127, 129 if direction < 0 else 128):
        power = (k + _E8M0_BIAS) << _F32_MANTISSA_BITS if k > -127 else 1 << 22  # 2^128: +Inf's bits
        bits = power + direction * np.arange(1, 4096, dtype=np.int32)
        values = bits.view(np.float32).astype(np.float64)
        counts[k + 127] = np.argmin(np.log2(values).astype(np.float32) == np.float32(k))
    return counts


@functools.cache
def _tiny_quotient_threshold(element_max: float, steps: int) -> int:
    """Bits of the largest float32 amax for which fl(amax / max), a float32 subnormal that XLA
    flushes, is at most ``2^-127 + steps · 2^-149`` (decided on amax itself, exactly).

    fl rounds to the nearest multiple of 2^-149, ties to an even mantissa: the boundary quotient is
    ``2^-127 + (steps + 1/2) · 2^-149``, which goes up exactly when ``steps`` is odd.
    """
    bound = np.float64(element_max) * (2.0 ** -127 + (steps + 0.5) * 2.0 ** -149)  # exact
    floor = np.float32(bound)
    if np.float64(floor) > bound or (np.float64(floor) == bound and steps % 2):
        floor = np.nextafter(floor, np.float32(0))
    return int(floor.view(np.int32))


def _rceil_exponent(amax_bits: jax.Array, element: _Element, log2f: bool) -> jax.Array:
    """ceil(log2(fl(amax / max))), exact or (``log2f``) of float32 log2 as torchao's eager fallback."""
    amax = jax.lax.bitcast_convert_type(amax_bits, jnp.float32)
    bits = jax.lax.bitcast_convert_type(exact_divide(amax, np.float32(element.max)), jnp.int32)
    field, mantissa = _exponent_field(bits), _mantissa_field(bits)
    floor_log2 = field - _E8M0_BIAS
    above = mantissa > 0
    tiny_steps = 0
    if log2f:
        window = jnp.asarray(_log2f_windows(+1))[jnp.clip(floor_log2, -127, 127) + 127]
        above = above & (mantissa > window)
        tiny_steps = int(_log2f_windows(+1)[0])
    # A subnormal (flushed) quotient is 2^-126 or below: exponent -126 or -127, told on amax.
    tiny = jnp.where(amax_bits > _tiny_quotient_threshold(element.max, tiny_steps), -126, -127)
    return jnp.where(field == 0, tiny, floor_log2 + above)


def _ggml_biased(amax_bits: jax.Array) -> jax.Array:
    """gguf-py's ``uint8(floor(log2f(amax)) - 2 + 127)`` (0 when amax is 0), from the bits.

    ``log2f`` may round an amax a few float32 steps below 2^k up to k, and the uint8 conversion
    wraps: amaxes below 2^-125 (subnormal ones included, whose floor(log2) is the top set bit - 149)
    give bytes 232-255 in gguf.
    """
    field, mantissa = _exponent_field(amax_bits), _mantissa_field(amax_bits)
    top_bit = 31 - jax.lax.clz(mantissa)  # subnormals: floor(log2) = top set bit - 149
    floor_log2 = jnp.where(field == 0, top_bit - 149, field - _E8M0_BIAS)
    next_pow2 = jnp.clip(floor_log2 + 1, -127, 128)
    steps_below = _pow2_bits(next_pow2) - amax_bits
    window = jnp.asarray(_log2f_windows(-1))[next_pow2 + 127]
    floor_log2 = floor_log2 + ((floor_log2 < 128) & (steps_below <= window))
    biased = (floor_log2 - 2 + _E8M0_BIAS) & 0xFF  # uint8 wrap-around, as numpy's cast
    # gguf's 255 (amax in [2^-126, 2^-125)) reads as 2^128 there, NaN in E8M0: 254 codes the same
    # zeros. A NaN amax keeps its NaN scale (gguf writes 0 and loses the NaN).
    biased = jnp.where(biased == 255, 254, jnp.where(amax_bits == 0, 0, biased))
    return jnp.where(amax_bits > 0x7F800000, 255, biased)


def _pow2_bits(exponent: jax.Array) -> jax.Array:
    """Bits of float32 2^exponent for exponents in [-149, 128] (subnormals included; 2^128 is +Inf)."""
    normal = (exponent + _E8M0_BIAS) << _F32_MANTISSA_BITS
    return jnp.where(exponent < -126, 1 << jnp.clip(exponent + 149, 0, 22), normal)


def _shared_exponent(amax_bits: jax.Array, mode: str, element: _Element) -> jax.Array:
    """Biased E8M0 exponent (int32 in [0, 255]) of each block from the int32 bits of its float32
    amax (``exact.abs_bits``), as torchao's to_mx; ``mode="ggml"`` is gguf-py's rule."""
    nan = amax_bits > 0x7F800000
    if mode == "ggml":
        return _ggml_biased(amax_bits)
    if mode in ("rceil", "rceil_log2f"):
        exponent = _rceil_exponent(amax_bits, element, log2f=mode == "rceil_log2f")
        # ±Inf has field 255, mantissa 0 → clamps to 127 → byte 254, torchao's value for Inf.
        biased = jnp.clip(exponent, -_E8M0_BIAS, _E8M0_BIAS) + _E8M0_BIAS
    else:
        bits = amax_bits
        if mode in ("even", "even_e2m1"):
            # Round amax to the element's (or E2M1's) mantissa width: add half a unit, drop the mantissa.
            width = ELEMENTS["mxfp4"].mantissa_bits if mode == "even_e2m1" else element.mantissa_bits
            half_unit = 1 << (_F32_MANTISSA_BITS - width - 1)
            bits = (bits + half_unit) & ~((1 << _F32_MANTISSA_BITS) - 1)
        exponent = _exponent_field(bits) - _E8M0_BIAS
        if mode == "ceil":
            exponent = exponent + (_mantissa_field(bits) > 0)
        biased = jnp.clip(exponent - element.emax, -_E8M0_BIAS, _E8M0_BIAS + 1) + _E8M0_BIAS
    return jnp.where(nan, 255, biased)


def _scale_elements(blocks: jax.Array, biased: jax.Array, mode: str, element_rounding: str) -> jax.Array:
    """Blocks (from ``to_blocks``) brought to the element range, before rounding; every scale is a
    power of two, so scaling is exact (subnormal inputs included, see ``_times_pow2_exact``)."""
    biased = per_block(biased, blocks.ndim // 2)
    if mode in ("rceil", "rceil_log2f"):
        # x · 2^(127-b); 2^-127 (b = 254, an Inf block) must not be flushed.
        scaled = _times_pow2_exact(blocks, jnp.clip(_E8M0_BIAS - biased, -127, 127))
        if element_rounding != "modelopt":
            scaled = jnp.where(biased == 0, blocks, scaled)  # torchao multiplies by 1 when b == 0
    elif mode == "ggml":
        # x / 2^(b-127): GGML's byte 0 is 2^-127 for the elements too. Under 2^126 (b = 253) GGML's
        # candidates 4 and 6 overflow to Inf (4 · 2^126 = 2^128), so its nearest value stops at 3.
        scaled = _times_pow2_exact(blocks, -jnp.clip(biased - _E8M0_BIAS, -127, 127))
        scaled = jnp.where(biased == 253, jnp.clip(scaled, -3.0, 3.0), scaled)
    else:
        # x / max(2^(b-127), 2^-126): torchao floors the divisor at the smallest normal number;
        # compressed-tensors divides by 2^-127 itself.
        lowest = -127 if element_rounding == "compressed-tensors" else -126
        scaled = _times_pow2_exact(blocks, -jnp.clip(biased - _E8M0_BIAS, lowest, 127))
    return jnp.where(biased == 255, jnp.nan, scaled)  # a NaN block stays NaN


# ---- quantize / dequantize -------------------------------------------------------------------------

def quantize_mx(x, fmt: str = "mxfp4", *, axis: int = -1, scale_mode: str = "floor",
                element_rounding: str = "even") -> QTensor:
    """Quantizes ``x`` to an MX format in blocks of 32 along ``axis`` (which 32 must divide).

    Args:
      x: float array (computed in float32).
      fmt: ``"mxfp4"``, ``"mxfp8_e4m3"`` or ``"mxfp8_e5m2"``.
      axis: the blocked axis (for a PyTorch ``[N, K]`` weight, -1).
      scale_mode: ``"floor"``, ``"ceil"``, ``"even"``, ``"even_e2m1"``, ``"rceil"`` or ``"rceil_log2f"``
        (module docstring).
      element_rounding: ``"even"`` (torchao, OCP), ``"ggml"`` (MXFP4 with "floor" only),
        ``"compressed-tensors"`` (the true scale as divisor; half to even; MXFP4 stores -0.0 as +0) or
        ``"modelopt"`` (MXFP8 with an rceil mode: 2^127 under byte 0).
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
    if element_rounding == "modelopt" and (fmt == "mxfp4" or scale_mode not in ("rceil", "rceil_log2f")):
        raise ValueError(f"element_rounding='modelopt' is Model Optimizer's MXFP8 quantizer: it needs an MXFP8 fmt "
                         f"and an rceil scale_mode, got fmt={fmt!r}, scale_mode={scale_mode!r}")
    if element_rounding == "compressed-tensors" and fmt not in ("mxfp4", "mxfp8_e4m3"):
        raise ValueError(f"element_rounding='compressed-tensors' is compressed-tensors' MXFP4 / MXFP8 quantizer: "
                         f"it needs fmt='mxfp4' or 'mxfp8_e4m3', got {fmt!r}")
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
    # The amax is an integer max of |x|'s bits: it keeps NaN (XLA's float max drops NaN from large
    # reductions, see blocking.nan_max) and subnormals (XLA's float compares read them as zero).
    amax_bits = jnp.max(abs_bits(blocks), axis=block_axes(x.ndim))
    mode = "ggml" if element_rounding == "ggml" else scale_mode
    biased = _shared_exponent(amax_bits, mode, element)
    scaled = _scale_elements(blocks, biased, mode, element_rounding).reshape(x.shape)
    if element.fp8_fmt is None:
        ties, sign = _E2M1_RULES[element_rounding]
        data = pack_bits(e2m1_codes(scaled, ties, sign), 4, axis)
    else:
        data = saturating_cast(scaled, element.fp8_fmt)
    return data, jax.lax.bitcast_convert_type(biased.astype(jnp.uint8), jnp.float8_e8m0fnu)


def block_multipliers(qt: QTensor) -> jax.Array:
    """float32 ``2^(b-127)`` of each block's E8M0 scale byte ``b`` (2^-127 is a float32 subnormal, kept
    exactly); NaN for 0xFF."""
    biased = jax.lax.bitcast_convert_type(qt.scale, jnp.uint8).astype(jnp.int32)
    pow2 = jax.lax.bitcast_convert_type(_pow2_bits(jnp.clip(biased - _E8M0_BIAS, -127, 127)), jnp.float32)
    return jnp.where(biased == 255, jnp.nan, pow2)


@functools.partial(jax.jit, static_argnums=1)
def dequantize_mx(qt: QTensor, dtype) -> jax.Array:
    """``element · 2^(b-127)`` in float32 (exact; byte 0 is 2^-127, as in torchao), then cast to
    ``dtype``; scale byte 0xFF gives NaN."""
    if qt.pack_axis is None:
        values = to_float32_exact(qt.data)
    else:
        values = e2m1_values(unpack_bits(qt.data, 4, axis=qt.pack_axis))
    biased = qt.expand(jax.lax.bitcast_convert_type(qt.scale, jnp.uint8).astype(jnp.int32))
    exponent = jnp.clip(biased - _E8M0_BIAS, -127, 127)
    # element · 2^exponent is exact in float32; below 2^-126 it is a subnormal, made 2^64 larger first.
    tiny = subnormal.unlift64(_times_pow2(values, jnp.minimum(exponent + 64, 127)))
    out = jnp.where(exponent < -64, tiny, _times_pow2(values, exponent))
    return jnp.where(biased == 255, jnp.nan, out).astype(dtype)


def _quantize_registered(fmt):
    def quantize(x, *, axis: int = -1, scale_mode: str = "floor", element_rounding: str = "even"):
        return quantize_mx(x, fmt, axis=axis, scale_mode=scale_mode, element_rounding=element_rounding)
    quantize.__doc__ = f"``quantize(x, {fmt!r}, axis=-1, scale_mode='floor')``: see ``jquant.formats.mx``."
    return quantize


for _fmt in ELEMENTS:
    register_format(_fmt, dequantize_mx)
    register_quantizer(_fmt, _quantize_registered(_fmt))
    # torchao's to_mx default (ScaleCalculationMode.FLOOR); its eager RCEIL is scale_mode="rceil_log2f".
    register_preset("torchao", _fmt, {"scale_mode": "floor", "element_rounding": "even"})
register_preset("gguf", "mxfp4", {"scale_mode": "floor", "element_rounding": "ggml"})
# compressed-tensors' MXFP4A16 (generate_mx_scales, cast_to_fp4): "even" scales, sign(x) · |q| elements.
register_preset("compressed-tensors", "mxfp4", {"scale_mode": "even", "element_rounding": "compressed-tensors"})
# Its MXFP8A16 / MXFP8 (generate_mx_scales with E2M1's mantissa width, a float8_e4m3fn cast).
register_preset("compressed-tensors", "mxfp8_e4m3",
                {"scale_mode": "even_e2m1", "element_rounding": "compressed-tensors"})
# Model Optimizer's MXFP8QTensor (float32 log2 ceiling, elements times 2^(127-b) for every byte).
register_preset("modelopt", "mxfp8_e4m3", {"scale_mode": "rceil_log2f", "element_rounding": "modelopt"})
