"""FP8 formats: ``"fp8_e4m3"`` (float8_e4m3fn, max 448) and ``"fp8_e5m2"`` (float8_e5m2, max 57344).

Codes are stored one per element as real float8 arrays (``pack_axis=None``); ``x ≈ code · scale``.
Every conversion saturates: values are clipped to ±max before the cast, because XLA/ml_dtypes
casts (like PyTorch's eager ``.to(float8)``) do not saturate on their own.

Each granularity follows the arithmetic of the library that produces such tensors, so bytes match:

- ``tensor`` / ``channel`` / ``block`` (weights; compressed-tensors 0.20.1, torchao 0.18):
  ``s = amax / max`` computed in x's dtype, a zero scale replaced by ``finfo(x.dtype).eps``
  (compressed-tensors); codes ``sat(x / s)`` with the quotient rounded to ``divide_dtype`` (x's dtype
  like compressed-tensors, or float32 like torchao; the same for float32 inputs).
- ``dynamic_tensor`` (vLLM): fp32 ``s = max(amax / max, 1 / (max·512))``; codes ``sat(x · (1/s))``.
- ``token`` (vLLM): the same scale per row of the last axis; codes ``sat(x / s)`` (its CUDA kernel).
- ``token_group`` (DeepSeek / vLLM): fp32 ``s = max(amax_g, 1e-10) / max`` per group of the last
  axis (with ``ue8m0``: ``2^ceil(log2 max(s, 1e-10))``, as vLLM's CUDA kernel); codes ``sat(x / s)``.
- ``static`` (vLLM): a given scale, e.g. a checkpoint's ``input_scale``; codes ``sat(x · (1/s))``.

``block`` tiles the last two axes (default 128×128). Like DeepSeek V3 and compressed-tensors, the
shape need not be a multiple of the block: edge blocks are zero-padded when taking their amax, and
the scale grid is ``ceil(N / 128) × ceil(K / 128)``. ``ue8m0=True`` (weight granularities and
``token_group``) rounds each scale *up* to a power of two, ``s = 2^ceil(log2 s)`` (DeepSeek
``scale_fmt: ue8m0``); such scales may be stored as ``float8_e8m0fnu``.

Zeros: under ``convention="compressed-tensors"`` (its preset, and the default) a zero scale becomes
``finfo(x.dtype).eps`` and -0.0 stores code +0 (it adds its float zero point 0.0 to ``x / s``); under
``"torchao"`` (its preset) a zero scale stays 0, so an all-zero block's codes are 0 / 0 = NaN, as
torchao stores them, and -0.0 stores -0. Tiny magnitudes: XLA flushes float32 subnormals, so weight
scales are computed from exact (bit-level) amax values, lifted by 2**64 below 2**-60 and rounded to
the subnormal grid with integer arithmetic (``exact.py``); scales and codes equal PyTorch's down to
the smallest subnormal, for float32, bfloat16 and float16 weights. One byte differs: under
compressed-tensors a nonzero negative element whose quotient is a float32 subnormal (|x / s| < 2^-126,
e.g. a float32-subnormal weight) stores +0 where PyTorch's tiny quotient casts to -0 (0x80); both
dequantize to zero. NaN codes: E4M3 has one per sign; for E5M2
every NaN is stored as ``sign | 0x7F``, as PyTorch converts (``saturating_cast``).

Non-finite inputs follow the references rather than being special-cased (checked at 256×4096 for every
granularity, and bit for bit against torchao and compressed-tensors on small inputs): with a static
scale NaN stays NaN (a NaN code) and ±Inf saturates to ±max; with a dynamic scale a NaN or ±Inf makes
its block's amax, hence its scale, non-finite (NaN / Inf); finite values then get code ±0 (x / Inf),
the Inf itself NaN, so that block dequantizes to NaN (0 · Inf) while other blocks are unaffected,
exactly as torchao, compressed-tensors and vLLM do; per tensor, that is the whole tensor.

Presets (``quantize(x, fmt, like=...)``, weight granularities): ``"torchao"`` for both formats
(``TORCHAO_OPTIONS``), ``"compressed-tensors"`` for E4M3, the only FP8 it has
(``COMPRESSED_TENSORS_OPTIONS``; its ``group`` strategy is ``granularity="block"``,
``block_size=(1, g)``). vLLM's arithmetic is chosen by the activation granularities themselves.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from jquant.formats.base import register_preset, register_quantizer
from jquant.formats.blocking import (block_amax, block_axes, check_float_input, group_block, pad_to_blocks,
                                     to_blocks)
from jquant.formats.exact import (LIFT, exact_abs_max, exact_divide, exact_reciprocal, is_tiny, lift,
                                  round_to_precision, store_exact, to_float32_exact, unlift_exact, unlift_quotient)
from jquant.qtensor import QTensor, expand_blocks, register_format

FP8_DTYPES = {"fp8_e4m3": jnp.dtype(jnp.float8_e4m3fn), "fp8_e5m2": jnp.dtype(jnp.float8_e5m2)}
WEIGHT_GRANULARITIES = ("tensor", "channel", "block")
GRANULARITIES = WEIGHT_GRANULARITIES + ("dynamic_tensor", "token", "token_group", "static")
SCALE_DTYPES = tuple(jnp.dtype(d) for d in (jnp.float32, jnp.bfloat16, jnp.float16, jnp.float8_e8m0fnu))
# vLLM's floor on dynamic activation scales (``min_scaling_factor``): 1 / (max · 512).
_MIN_SCALE_DIVISOR = 512.0
# DeepSeek / vLLM per-token-group kernels clamp the group amax to this before dividing.
GROUP_AMAX_EPS = 1e-10
CONVENTIONS = ("compressed-tensors", "torchao")


def fp8_format(fmt) -> str:
    """The format name for ``fmt``: ``"fp8_e4m3"``/``"fp8_e5m2"``, or the float8 dtypes themselves."""
    if isinstance(fmt, str) and fmt in FP8_DTYPES:
        return fmt
    try:
        as_dtype = jnp.dtype(fmt)
    except TypeError:
        as_dtype = None
    for name, fp8 in FP8_DTYPES.items():
        if as_dtype == fp8:
            return name
    raise ValueError(f"fmt must be one of {sorted(FP8_DTYPES)} or float8_e4m3fn/float8_e5m2, got {fmt!r}")


def fp8_max(fmt: str) -> float:
    """Largest finite value of format ``fmt`` (448 for E4M3, 57344 for E5M2)."""
    return float(jnp.finfo(FP8_DTYPES[fp8_format(fmt)]).max)


def saturating_cast(values: jnp.ndarray, fmt: str) -> jnp.ndarray:
    """``values`` clipped to ±max of ``fmt`` then cast (round-to-nearest-even); NaN stays NaN.

    E5M2 has several NaN codes: like PyTorch's conversion, every NaN becomes ``sign | 0x7F`` (XLA's
    cast keeps the top mantissa bits, 0x7E).
    """
    limit = fp8_max(fmt)
    codes = jnp.clip(values, -limit, limit).astype(FP8_DTYPES[fmt])
    if fmt != "fp8_e5m2":
        return codes
    negative = lax.bitcast_convert_type(values.astype(jnp.float32), jnp.int32) < 0
    nan_code = jnp.where(negative, jnp.uint8(0xFF), jnp.uint8(0x7F))
    bits = jnp.where(jnp.isnan(values), nan_code, lax.bitcast_convert_type(codes, jnp.uint8))
    return lax.bitcast_convert_type(bits, FP8_DTYPES[fmt])


def round_scale_up_to_pow2(scale: jnp.ndarray) -> jnp.ndarray:
    """``2^ceil(log2 s)`` computed exactly from the float's exponent (log2 can be off by an ulp).

    Non-finite scales pass through unchanged, as ``exp2(ceil(log2(s)))`` would leave them.
    """
    scale = scale.astype(jnp.float32)
    mantissa, exponent = jnp.frexp(scale)  # scale = mantissa · 2^exponent, mantissa in [0.5, 1)
    exponent = jnp.where(mantissa == 0.5, exponent - 1, exponent)
    pow2 = jnp.ldexp(jnp.ones_like(scale), exponent)
    return jnp.where(jnp.isfinite(scale) & (scale > 0), pow2, scale)


# ---- weights (compressed-tensors / torchao arithmetic) -------------------------------------------

def quantize_fp8(x, fmt: str = "fp8_e4m3", *, granularity: str = "tensor", axis: int = -1,
                 block_size=(128, 128), ue8m0: bool = False, scale_dtype=jnp.float32,
                 divide_dtype=None, convention: str = "compressed-tensors") -> QTensor:
    """Quantizes a weight to FP8 with one scale per tensor, per channel or per 2-D block.

    Args:
      x: float array.
      fmt: ``"fp8_e4m3"`` or ``"fp8_e5m2"``.
      granularity: ``"tensor"``, ``"channel"`` (one scale per slice reduced along ``axis``: for a
        PyTorch ``[N, K]`` weight and ``axis=-1`` the ``[N, 1]`` per-output-channel scales) or
        ``"block"`` (``block_size`` tiles over the last two axes, edge blocks padded; ``(1, g)`` is
        compressed-tensors' ``group`` strategy).
      axis: the reduced axis of ``"channel"``.
      block_size: ``(rows, cols)`` of a ``"block"`` tile.
      ue8m0: round every scale up to a power of two.
      scale_dtype: dtype the scales are stored in (float32, bfloat16, float16, or float8_e8m0fnu
        with ``ue8m0``); None: x's dtype (compressed-tensors). Scales are computed in x's dtype, so
        storing them in it or wider is exact.
      divide_dtype: dtype ``x / s`` is rounded to before the FP8 cast. None: x's dtype, as
        compressed-tensors divides bf16 weights in bf16; ``jnp.float32``: torchao, which divides in
        fp32. Both agree for float32 inputs.
      convention: ``"compressed-tensors"``: a zero scale becomes ``finfo(x.dtype).eps`` (all-zero
        blocks give codes 0) and a zero quotient gets code +0 (it adds its float zero point 0.0, so
        -0.0 stores 0x00); ``"torchao"``: a zero scale stays 0, so an all-zero block's codes are
        0 / 0 = NaN as torchao stores them, and -0.0 stores -0 (0x80).
    """
    fmt = fp8_format(fmt)
    x = check_float_input(x, "x")
    if granularity not in WEIGHT_GRANULARITIES:
        raise ValueError(f"quantize_fp8: granularity must be one of {WEIGHT_GRANULARITIES} "
                         f"(activations: quantize_fp8_per_token / _per_token_group / _static), "
                         f"got {granularity!r}")
    if convention not in CONVENTIONS:
        raise ValueError(f"quantize_fp8: convention must be one of {CONVENTIONS}, got {convention!r}")
    scale_dtype = _check_scale_dtype(x.dtype if scale_dtype is None else scale_dtype, ue8m0)
    divide_dtype = x.dtype if divide_dtype is None else _check_float_dtype(divide_dtype, "divide_dtype")
    block = _weight_block(x.shape, granularity, axis, block_size)
    padded = pad_to_blocks(x, block)
    limit = fp8_max(fmt)
    # Exact for amax down to the smallest subnormal, which XLA would flush (see exact.py); the scale is
    # the float32 quotient rounded to x's dtype, as PyTorch divides bf16 / fp16 tensors.
    amax = exact_abs_max(to_blocks(to_float32_exact(padded), block), block_axes(x.ndim))
    tiny = is_tiny(amax)
    scale, lifted = unlift_quotient(lift(amax, tiny), limit, tiny)
    if x.dtype != jnp.float32:
        scale = store_exact(scale, x.dtype)
        lifted = lift(to_float32_exact(scale), tiny)
    if convention == "compressed-tensors":
        # A zero scale becomes its dtype's eps, so all-zero blocks stay 0, not NaN.
        eps = jnp.asarray(jnp.finfo(x.dtype).eps, scale.dtype)
        eps32 = eps.astype(jnp.float32)   # lifted in float32: 2^64 overflows a float16 eps
        scale, lifted = (jnp.where(lifted == 0, eps, scale),
                         jnp.where(lifted == 0, jnp.where(tiny, eps32 * 2.0 ** LIFT, eps32), lifted))
    if ue8m0:
        lifted = round_scale_up_to_pow2(lifted).astype(scale.dtype)
        scale = unlift_exact(lifted, tiny).astype(scale.dtype)
    tiny_elements = expand_blocks(tiny, x.shape, block)
    quotient = exact_divide(lift(to_float32_exact(x), tiny_elements),
                            expand_blocks(lifted.astype(jnp.float32), x.shape, block))
    quotient = round_to_precision(quotient, divide_dtype)
    if convention == "compressed-tensors":
        quotient = jnp.where(quotient == 0, 0.0, quotient)  # x / s + 0.0: -0.0 becomes +0.0
    codes = saturating_cast(quotient, fmt)
    return _qtensor(x, codes, store_exact(scale, scale_dtype), block, fmt, granularity)


def _weight_block(shape, granularity, axis, block_size) -> tuple[int, ...]:
    if granularity == "tensor":
        return tuple(shape)
    if granularity == "channel":
        return group_block(shape, axis, None)
    if len(shape) < 2:
        raise ValueError(f"granularity='block' needs an array with at least 2 dimensions, "
                         f"got shape {tuple(shape)}")
    if (not isinstance(block_size, (tuple, list)) or len(block_size) != 2
            or not all(isinstance(b, int) and b > 0 for b in block_size)):
        raise ValueError(f"block_size must be two positive ints (rows, cols), got {block_size!r}")
    return (1,) * (len(shape) - 2) + tuple(block_size)


# ---- activations (vLLM arithmetic: fp32 throughout) ----------------------------------------------

def quantize_fp8_dynamic_per_tensor(x, fmt="fp8_e4m3") -> QTensor:
    """vLLM dynamic per-tensor: ``s = max(amax / max, 1 / (max·512))``, codes ``sat(x · (1/s))``."""
    fmt = fp8_format(fmt)
    x = check_float_input(x, "x")
    block = tuple(x.shape)
    scale = _dynamic_scale(block_amax(x.astype(jnp.float32), block), fmt)
    # vLLM's per-tensor kernel and its torch fallback both multiply by the reciprocal.
    codes = saturating_cast(x.astype(jnp.float32) * exact_reciprocal(scale), fmt)
    return _qtensor(x, codes, scale, block, fmt, "dynamic_tensor")


def quantize_fp8_per_token(x, fmt="fp8_e4m3") -> QTensor:
    """vLLM dynamic per-token: one scale per row of the last axis, ``max(amax / max, 1/(max·512))``."""
    fmt = fp8_format(fmt)
    x = check_float_input(x, "x")
    block = group_block(x.shape, -1, None)
    scale = _dynamic_scale(block_amax(x.astype(jnp.float32), block), fmt)
    # vLLM's CUDA per-token kernel divides (its torch fallback multiplies by the reciprocal).
    codes = saturating_cast(exact_divide(x.astype(jnp.float32), scale), fmt)
    return _qtensor(x, codes, scale, block, fmt, "token")


def quantize_fp8_per_token_group(x, group_size: int = 128, ue8m0: bool = False, fmt="fp8_e4m3",
                                 scale_dtype=jnp.float32) -> QTensor:
    """DeepSeek / vLLM per-token-group activations: ``s = max(amax_g, 1e-10) / max`` per
    ``group_size`` values of the last axis (which must divide it, as vLLM asserts), optionally
    rounded up to a power of two (``ue8m0``) and stored as ``float8_e8m0fnu`` (``scale_dtype``)."""
    fmt = fp8_format(fmt)
    x = check_float_input(x, "x")
    scale_dtype = _check_scale_dtype(scale_dtype, ue8m0)
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size <= 0:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    block = group_block(x.shape, -1, group_size)
    amax = block_amax(x.astype(jnp.float32), block)
    scale = exact_divide(jnp.maximum(amax, GROUP_AMAX_EPS), fp8_max(fmt))
    if ue8m0:
        # vLLM's CUDA kernel rounds max(s, 1e-10) up, so the smallest UE8M0 scale is 2^-33, not 2^-42.
        scale = round_scale_up_to_pow2(jnp.maximum(scale, GROUP_AMAX_EPS))
    codes = saturating_cast(exact_divide(x.astype(jnp.float32), expand_blocks(scale, x.shape, block)), fmt)
    return _qtensor(x, codes, scale.astype(scale_dtype), block, fmt, "token_group")


def quantize_fp8_static(x, scale, fmt="fp8_e4m3") -> QTensor:
    """Quantizes with a given scale (a checkpoint's ``input_scale``): ``sat(x · (1/s))`` as vLLM.

    ``scale`` is a scalar / ``[1]`` (per tensor) or has x's rank with each axis 1 or x's size there
    (e.g. ``[T, 1]`` per row).
    """
    fmt = fp8_format(fmt)
    x = check_float_input(x, "x")
    scale = jnp.asarray(scale)
    if not jnp.issubdtype(scale.dtype, jnp.floating):
        raise TypeError(f"scale must have a floating dtype, got {scale.dtype} (shape {scale.shape})")
    if scale.size == 1 and scale.ndim <= max(x.ndim, 1):
        scale = scale.reshape((1,) * x.ndim)
    if scale.ndim != x.ndim or any(s not in (1, n) for s, n in zip(scale.shape, x.shape)):
        raise ValueError(f"scale with shape {scale.shape} does not fit x with shape {x.shape}: "
                         f"expected a scalar, [1], or rank {x.ndim} with each axis 1 or x's size")
    block = tuple(n if s == 1 else 1 for s, n in zip(scale.shape, x.shape))
    scale = to_float32_exact(scale)
    codes = saturating_cast(x.astype(jnp.float32) * expand_blocks(exact_reciprocal(scale),
                                                                  x.shape, block), fmt)
    return _qtensor(x, codes, scale, block, fmt, "static")


def dynamic_min_scale(fmt) -> float:
    """vLLM's floor on dynamic per-tensor / per-token scales, ``1 / (max · 512)``."""
    return 1.0 / (fp8_max(fmt) * _MIN_SCALE_DIVISOR)


def _dynamic_scale(amax, fmt):
    return jnp.maximum(exact_divide(amax, fp8_max(fmt)), dynamic_min_scale(fmt))


# ---- shared ----------------------------------------------------------------------------------------

def _check_float_dtype(dtype, name):
    try:
        dtype = jnp.dtype(dtype)
    except TypeError as err:
        raise TypeError(f"{name} must be a float dtype, got {dtype!r}") from err
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"{name} must be a float dtype, got {dtype}")
    return dtype


def _check_scale_dtype(scale_dtype, ue8m0):
    if not isinstance(ue8m0, bool):
        raise TypeError(f"ue8m0 must be a bool, got {ue8m0!r}")
    scale_dtype = _check_float_dtype(scale_dtype, "scale_dtype")
    if scale_dtype not in SCALE_DTYPES:
        raise ValueError(f"scale_dtype must be one of {[str(d) for d in SCALE_DTYPES]}, got {scale_dtype}")
    if scale_dtype == jnp.float8_e8m0fnu and not ue8m0:
        raise ValueError("scale_dtype=float8_e8m0fnu holds only powers of two: pass ue8m0=True")
    return scale_dtype


def _qtensor(x, codes, scale, block, fmt, granularity) -> QTensor:
    return QTensor(data=codes, scale=scale, fmt=fmt, shape=x.shape, dtype=x.dtype, block=block,
                   options=(("granularity", granularity),))


def dequantize_fp8(qt: QTensor, dtype) -> jnp.ndarray:
    """``code · scale`` in float32 (exact for bf16/fp16/e8m0 scales), then cast to ``dtype``."""
    values = to_float32_exact(qt.data) * qt.expand(to_float32_exact(qt.scale))
    return values.astype(dtype)


def _quantize_registered(fmt):
    def quantize(x, granularity=None, scale=None, **options):
        if granularity is None:
            granularity = "tensor" if scale is None else "static"
        if (granularity == "static") != (scale is not None):
            given = "given" if scale is not None else "None"
            raise ValueError(f"{fmt}: pass scale= exactly when granularity='static' "
                             f"(got granularity={granularity!r}, scale {given})")
        if granularity == "static":
            return quantize_fp8_static(x, scale, fmt=fmt, **options)
        activation = {"dynamic_tensor": quantize_fp8_dynamic_per_tensor,
                      "token": quantize_fp8_per_token,
                      "token_group": quantize_fp8_per_token_group}
        if granularity in activation:
            return activation[granularity](x, fmt=fmt, **options)
        if granularity not in WEIGHT_GRANULARITIES:
            raise ValueError(f"{fmt}: granularity must be one of {GRANULARITIES}, got {granularity!r}")
        return quantize_fp8(x, fmt, granularity=granularity, **options)
    quantize.__doc__ = f"``quantize(x, {fmt!r}, granularity=..., ...)``: see ``jquant.formats.fp8``."
    return quantize


# Weight presets (tensor / channel / block granularities): torchao divides in float32 and keeps zero
# scales; compressed-tensors (FP8 is E4M3 only there) divides in the weight's dtype and stores scales in it.
TORCHAO_OPTIONS = dict(convention="torchao", divide_dtype=jnp.dtype(jnp.float32), scale_dtype=jnp.dtype(jnp.float32))
COMPRESSED_TENSORS_OPTIONS = dict(convention="compressed-tensors", divide_dtype=None, scale_dtype=None)

for _fmt in FP8_DTYPES:
    register_format(_fmt, dequantize_fp8)
    register_quantizer(_fmt, _quantize_registered(_fmt))
    register_preset("torchao", _fmt, TORCHAO_OPTIONS)
register_preset("compressed-tensors", "fp8_e4m3", COMPRESSED_TENSORS_OPTIONS)

