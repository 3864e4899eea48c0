"""NVFP4 (``"nvfp4"``): E2M1 codes in blocks of 16 along ``axis``, an E4M3 scale per block and an
optional float32 per-tensor scale. Codes are packed two per byte, low nibble = even element.

Two conventions for the per-tensor scale, each with its library's exact arithmetic (bytes and
dequantized values match bit for bit):

- ``"compressed-tensors"`` (0.20.1; llm-compressor checkpoints): ``global_scale = 448·6 / amax``
  is a *divisor*. Block scale ``s = e4m3(clamp(global · (amax_b / 6), ±448))``, a zero ``s``
  replaced by 0.125; codes ``e2m1(clamp(x / (s / global), ±6))``; ``x ≈ q · (s / global)``. Like
  compressed-tensors, ``amax_b / 6`` and the dynamic global scale are computed in x's dtype (bf16
  for bf16 weights), the rest in float32; a non-finite global (all-zero or NaN tensor) becomes 1.
- ``"modelopt"`` (torchao 0.18 ``NVFP4Tensor``; ModelOpt's ``weight_scale_2``): ``scale_2 =
  amax / (448·6)`` is a *multiplier*. In float32: ``s = e4m3(clamp((amax_b / 6) / scale_2, 2^-6,
  448))``; codes ``e2m1(clamp(x · ((1 / scale_2) / s), ±6))``; ``x ≈ q · (scale_2 · s)``. An
  all-zero tensor gets ``scale_2 = 1`` (torchao would divide by zero).

``global_scale="dynamic"`` derives the per-tensor scale from x's amax (weights, or torchao's dynamic
activations); an explicit value (the convention's own units, see ``global_scale_from_amax``) is
the static path (a calibrated ``input_global_scale`` / ``input_scale`` for activations, whose block
scales are then computed per call); ``None`` quantizes with block scales only (torchao's
``per_tensor_scale=None``; compressed-tensors without a global scale).

E2M1 rounding is round-half-to-even in both. Sign of zero: torchao keeps the sign bit of values that
round to zero (-0.0 included); compressed-tensors stores -0.0 itself as +0.

Non-finite inputs follow the libraries, at every tensor size (amaxes use ``blocking.nan_max``; XLA's
float max drops NaN from large reductions): a NaN gives its block a NaN scale (the block dequantizes
to NaN; its codes are unspecified) and an Inf a saturated one (448). With a dynamic per-tensor scale
an Inf amax makes that scale 0 ("compressed-tensors") or Inf ("modelopt"), so the whole tensor
dequantizes to NaN, as in both libraries; a NaN amax leaves the other blocks intact in
"compressed-tensors" (its global falls back to 1, and an Inf elsewhere then only saturates) and makes
scale_2 and so every value NaN in "modelopt" (torchao).

Extreme magnitudes: "compressed-tensors" with an amax past 2^126 takes the subnormal reciprocal
``1 / amax`` as PyTorch rounds it (``jquant.formats.subnormal``), so the global scale is the
library's instead of 0 (which would make every value NaN), and subnormal elements keep their sign.
"modelopt" cannot hold torchao's subnormal ``scale_2`` (amax below 2688 · 2^-126 ≈ 3.2e-35, or an
all-zero tensor): such tensors get ``scale_2 = 1`` and dequantize to (near) zero instead.
Divisions use ``exact_divide`` (XLA turns a division by a constant or broadcast into a multiply by its
reciprocal, an ulp off for some amaxes), so the bytes are the same eager and under ``jit``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jquant.formats import subnormal
from jquant.formats.base import register_preset, register_quantizer
from jquant.formats.exact import exact_divide, exact_reciprocal, round_to_precision, to_float32_exact
from jquant.formats.blocking import block_amax, check_float_input, group_block, nan_max
from jquant.formats.fp8 import saturating_cast
from jquant.formats.mx import E2M1_MAX, e2m1_codes, e2m1_values
from jquant.formats.packing import pack_bits, unpack_bits
from jquant.qtensor import QTensor, expand_blocks, register_format

BLOCK_SIZE = 16
CONVENTIONS = ("compressed-tensors", "modelopt")
E4M3_MAX = 448.0
# 448 · 6: maps the tensor amax to the largest block scale times the largest element.
_SCALE_RANGE = E4M3_MAX * E2M1_MAX
# compressed-tensors' stand-in for a zero E4M3 block scale.
_CT_ZERO_SCALE = 0.125
# torchao clamps block scales to the smallest normal E4M3 value (finfo(float8_e4m3fn).tiny).
_TORCHAO_MIN_SCALE = 2.0 ** -6


def global_scale_from_amax(amax, convention: str = "compressed-tensors") -> jax.Array:
    """The per-tensor scale for a tensor (or calibrated activation) with absolute maximum ``amax``.

    "compressed-tensors": ``448·6 / max(amax, tiny)`` in amax's dtype, non-finite → 1, as float32.
    PyTorch evaluates ``scalar / tensor`` as ``tensor.reciprocal() * scalar``, so this rounds twice.
    "modelopt": ``amax / (448·6)`` in float32, 0 → 1.
    """
    _check_convention(convention)
    amax = jnp.asarray(amax)
    if convention == "compressed-tensors":
        dtype = amax.dtype
        amax = jnp.maximum(amax, jnp.finfo(dtype).tiny).astype(jnp.float32)
        # Past 2^126 the reciprocal is a float32 subnormal (XLA would flush it and the whole tensor
        # would dequantize to NaN): it is carried scaled by 2^shift and rounded where torch rounds.
        reciprocal, shift = subnormal.reciprocal(amax)
        if jnp.dtype(dtype) == jnp.bfloat16:  # bf16 subnormals are multiples of 2^-133
            step = np.float32(2.0 ** (133 - 64))
            reciprocal = jnp.where(shift > 0, jnp.round(reciprocal * step) / step, reciprocal)
        reciprocal = jnp.where(shift > 0, reciprocal, round_to_precision(reciprocal, dtype))
        scale = round_to_precision(reciprocal * _SCALE_RANGE, dtype)
        scale = jnp.where(shift > 0, scale * np.float32(2.0 ** -64), scale)
        return jnp.where(jnp.isfinite(scale), scale, 1).astype(jnp.float32)
    scale = exact_divide(amax.astype(jnp.float32), jnp.float32(_SCALE_RANGE))
    return jnp.where(scale == 0, 1, scale).astype(jnp.float32)


def quantize_nvfp4(x, *, axis: int = -1, convention: str = "compressed-tensors",
                   global_scale="dynamic") -> QTensor:
    """Quantizes ``x`` to NVFP4 in blocks of 16 along ``axis`` (which 16 must divide).

    Args:
      x: float array.
      axis: the blocked axis (-1 for a PyTorch ``[N, K]`` weight or ``[tokens, K]`` activations).
      convention: ``"compressed-tensors"`` (divisor global scale) or ``"modelopt"`` (multiplier).
      global_scale: ``"dynamic"`` (from x's amax), a scalar in the convention's units (static), or
        None (block scales only).
    """
    _check_convention(convention)
    x = check_float_input(x, "x")
    block = group_block(x.shape, axis, BLOCK_SIZE, "x")
    axis %= x.ndim
    dynamic = isinstance(global_scale, str)
    if dynamic and global_scale != "dynamic":
        raise ValueError(f"global_scale must be 'dynamic', None or a scalar, got {global_scale!r}")
    if not dynamic and global_scale is not None:
        global_scale = _check_scalar(global_scale)
    data, scale, global_scale = _encode(x, None if dynamic else global_scale, block, axis, convention,
                                        dynamic)
    return QTensor(data=data, scale=scale, global_scale=global_scale, fmt="nvfp4", shape=x.shape,
                   dtype=x.dtype, block=block, pack_axis=axis, options=(("convention", convention),))


# One compiled program per shape and setting instead of dozens of eagerly dispatched ops.
@functools.partial(jax.jit, static_argnums=(2, 3, 4, 5))
def _encode(x, global_scale, block, axis, convention, dynamic):
    if dynamic:
        # compressed-tensors observes the amax in x's dtype; torchao upcasts to float32 first.
        amax_dtype = x.dtype if convention == "compressed-tensors" else jnp.float32
        global_scale = global_scale_from_amax(nan_max(jnp.abs(x.astype(amax_dtype))), convention)
    quantize = _quantize_ct if convention == "compressed-tensors" else _quantize_modelopt
    scale, scaled = quantize(x, block, global_scale)
    sign = "negative" if convention == "compressed-tensors" else "signbit"
    codes = e2m1_codes(jnp.clip(scaled, -E2M1_MAX, E2M1_MAX), "even", sign)
    if convention == "compressed-tensors":
        # sign(x) · |q| takes the sign from x itself, subnormal x included (XLA reads those as 0).
        negative = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32) < 0
        codes = jnp.where(subnormal.is_subnormal(x), (codes & 7) | (negative.astype(jnp.uint8) << 3), codes)
    return pack_bits(codes, 4, axis), scale, global_scale


def _quantize_ct(x, block, global_scale):
    """compressed-tensors: calculate_qparams (TENSOR_GROUP, FP4) then ``_quantize``."""
    scale = round_to_precision(exact_divide(block_amax(x, block).astype(jnp.float32), E2M1_MAX), x.dtype)
    if global_scale is not None:
        scale = global_scale * scale
    scale = saturating_cast(scale, "fp8_e4m3")
    scale = jnp.where(to_float32_exact(scale) == 0, jnp.float8_e4m3fn(_CT_ZERO_SCALE), scale)
    divisor = to_float32_exact(scale)
    if global_scale is not None:
        divisor = exact_divide(divisor, global_scale)
    scaled = exact_divide(x.astype(jnp.float32), expand_blocks(divisor, x.shape, block))
    # Without a global scale the division stays in x's dtype (a bf16 weight divides in bf16).
    return scale, scaled if global_scale is not None else round_to_precision(scaled, x.dtype)


def _quantize_modelopt(x, block, global_scale):
    """torchao ``nvfp4_quantize``: float32 throughout, multiplying by reciprocals."""
    x = x.astype(jnp.float32)
    scale = exact_divide(block_amax(x, block), E2M1_MAX)
    if global_scale is not None:
        scale = exact_divide(scale, global_scale)
    scale = saturating_cast(jnp.clip(scale, _TORCHAO_MIN_SCALE, E4M3_MAX), "fp8_e4m3")
    one = jnp.float32(1)
    numerator = one if global_scale is None else exact_divide(one, global_scale)
    reciprocal = exact_divide(jnp.broadcast_to(numerator, scale.shape), to_float32_exact(scale))
    return scale, x * expand_blocks(reciprocal, x.shape, block)


def block_scales(qt: QTensor) -> jax.Array:
    """float32 per-block multipliers of an NVFP4 QTensor: ``s / global`` or ``scale_2 · s``."""
    scale = to_float32_exact(qt.scale)
    if qt.global_scale is None:
        return scale
    if qt.option("convention") == "compressed-tensors":
        return exact_divide(scale, qt.global_scale)
    return qt.global_scale * scale


def global_multiplier(qt: QTensor) -> jax.Array:
    """float32 factor of every block scale: ``1 / global`` (compressed-tensors) or ``scale_2``
    (ModelOpt); kernels apply it once instead of folding it into each block scale."""
    if qt.option("convention") == "compressed-tensors":
        return exact_reciprocal(qt.global_scale.astype(jnp.float32))
    return qt.global_scale.astype(jnp.float32)


@functools.partial(jax.jit, static_argnums=1)
def dequantize_nvfp4(qt: QTensor, dtype) -> jax.Array:
    """``q · block multiplier`` in float32, then cast to ``dtype`` (both libraries' order)."""
    values = e2m1_values(unpack_bits(qt.data, 4, axis=qt.pack_axis))
    return (values * qt.expand(block_scales(qt))).astype(dtype)



def _check_convention(convention):
    if convention not in CONVENTIONS:
        raise ValueError(f"convention must be one of {CONVENTIONS}, got {convention!r}")


def _check_scalar(value) -> jax.Array:
    value = jnp.asarray(value)
    if value.size != 1 or not jnp.issubdtype(value.dtype, jnp.floating):
        raise ValueError(f"global_scale must be a float scalar (or [1]), got dtype {value.dtype} "
                         f"shape {tuple(value.shape)}")
    return value.reshape(()).astype(jnp.float32)


register_format("nvfp4", dequantize_nvfp4)
register_quantizer("nvfp4", quantize_nvfp4)
register_preset("compressed-tensors", "nvfp4", {"convention": "compressed-tensors"})
register_preset("modelopt", "nvfp4", {"convention": "modelopt"})
register_preset("torchao", "nvfp4", {"convention": "modelopt"})  # NVFP4Tensor: ModelOpt's scales
