"""Arithmetic that stays bit-exact with PyTorch/numpy under XLA's optimisations.

Three XLA rewrites break bit-exactness with the reference libraries, also under ``jit`` on CPU:
- ``a / broadcast(b)`` (a constant included) becomes ``a * broadcast(1 / b)``, an ulp off often enough
  to change codes and scales; ``exact_divide`` keeps a true division, fused, by making the
  denominator a select on the numerator instead of a broadcast.
- ``(a / b) / c`` becomes ``a / (b * c)``, one rounding where PyTorch rounds twice; ``exact_divide``
  makes its numerator a select, so no quotient of quotients is left to regroup.
- a float32 → bf16/fp16 → float32 round trip may be dropped ("excess precision"), so PyTorch's
  "compute in the weight's dtype" arithmetic would differ; ``round_to_precision`` uses
  ``reduce_precision``, which XLA never elides.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def exact_divide(numerator: jax.Array, denominator) -> jax.Array:
    """``numerator / denominator`` correctly rounded, also under ``jit`` and on NVIDIA GPUs.

    The denominator becomes ``where(isnan(n), n, d)``: the same quotient (a NaN numerator gives NaN
    whatever it is divided by), but no broadcast for XLA to turn into a reciprocal. An optimization
    barrier did the same by writing both operands, as fp32, to memory: at 4096 × 8192 on the H100
    dropping it took the per-token W8A8 FP8 GEMM (activation quantization included) from 641 to 493
    µs and block FP8 from 944 to 811 (bench/results/h100/gemm8_fp8_dispatch.md).

    XLA divides float32 on NVIDIA GPUs with PTX's ``div.full.f32`` (LLVM's ``-nvptx-prec-divf32=1``),
    within 2 ulp: on the H100 ``x / 448`` was 1 ulp off numpy for 54 % of normal floats. The quotient
    is therefore moved to the nearest float with integer arithmetic (``nearest_quotient``) on every
    platform but the CPU, whose division is IEEE.
    """
    denominator = jnp.asarray(denominator, numerator.dtype)
    full = jnp.broadcast_to(denominator, numerator.shape)
    # The numerator becomes where(isnan(n), 1, n), so it is no quotient itself: XLA's simplifier
    # regroups (a / b) / c into a / (b · c), one rounding instead of two (an NVFP4 block scale
    # (amax / 6) / global came out one E4M3 step off torchao's, compiled on the CPU). A NaN n still
    # gives n's NaN, its sign included (1 / n); the predicate is n's, as d may be a constant XLA folds.
    numerator_kept = jnp.where(jnp.isnan(numerator), jnp.ones_like(numerator), numerator)
    quotient = numerator_kept / jnp.where(jnp.isnan(numerator), numerator, full)
    if quotient.dtype != jnp.float32:
        return quotient
    # Lowered for CPU, whose division is IEEE, the correction would move nothing; it only slowed the
    # CPU test suite (.ci/run: 30.0 min with it, 25.9 without).
    return lax.platform_dependent(numerator, denominator, quotient, cpu=lambda n, d, q: q,
                                  default=nearest_quotient)


def exact_reciprocal(values: jax.Array) -> jax.Array:
    """``1 / values`` correctly rounded, as ``exact_divide`` (XLA's GPU ``1 / x`` was 1 ulp off numpy
    for 13 % of random floats on the H100), for normal values under 2**126. XLA reads a subnormal as
    ±0 (giving ±Inf) and flushes a subnormal reciprocal; ``subnormal.reciprocal`` keeps both."""
    return exact_divide(jnp.ones_like(values), values)


_MANTISSA, _IMPLICIT = 0x7FFFFF, 0x800000


def _significand(abs_bits_: jax.Array) -> jax.Array:
    """The 24-bit integer significand (implicit bit set) of normal floats' magnitude bits, uint32."""
    return ((abs_bits_ & _MANTISSA) | _IMPLICIT).astype(jnp.uint32)


def _in_range(values: jax.Array, lo: int, hi: int) -> jax.Array:
    """lo <= values <= hi for int32 values, as one unsigned compare."""
    return (values - lo).astype(jnp.uint32) <= hi - lo


def nearest_quotient(numerator: jax.Array, denominator: jax.Array, quotient: jax.Array) -> jax.Array:
    """float32 ``quotient``, within 2 ulp of ``numerator / denominator`` (the true quotient's ulp, as
    PTX bounds ``div.full.f32``), moved to the correctly rounded quotient. ``denominator`` broadcasts
    against ``numerator`` (a per-row scale is decoded once a row). Normal operands and quotients only;
    anything else (0, Inf, NaN, subnormals, a quotient at the ends of the exponent range) is returned
    as given.

    The true quotient's binade follows from the significands ``N, D`` (24-bit integers): ``[2**e,
    2**(e+1))`` with ``e`` from the exponents, one lower where ``N < D``. The candidate is first clamped
    into that binade, where floats are evenly spaced; its significand ``Q`` then misses the true
    quotient by ``T / D`` floats, ``T = N · 2**s − Q · D`` with ``s`` 23 or 24, exact from uint32
    arithmetic modulo 2**32 as ``|T| < 2**31``. Moving ``round(T / D)`` floats (two integer compares)
    lands on the nearest float, carrying into the next binade where that is nearest. A quotient of two
    floats never lies halfway between two floats, so there are no ties. It costs ~25 integer ops an
    element: the per-token W8A8 FP8 GEMM at 8192² (activations quantized in the call) took 146.8 /
    558.7 µs at M = 1024 / 4096 against 131.3 / 507.9 without it (H100,
    bench/results/h100/gemm8_exact_division*.md).
    """
    n_bits, d_bits = abs_bits(numerator), abs_bits(denominator)
    n_exp, d_exp = n_bits >> 23, d_bits >> 23
    n_sig, d_sig = _significand(n_bits), _significand(d_bits)
    below = n_sig < d_sig
    exponent = n_exp - (d_exp - 127) - below.astype(jnp.int32)   # biased exponent of the true quotient
    lo_bits = exponent << 23
    q_bits = jnp.clip(abs_bits(quotient), lo_bits, lo_bits | _MANTISSA)
    scaled = n_sig << (23 + below.astype(jnp.uint32))
    twice = 2 * lax.bitcast_convert_type(scaled - _significand(q_bits) * d_sig, jnp.int32)
    d = d_sig.astype(jnp.int32)
    floats = (jnp.abs(twice) > d).astype(jnp.int32) + (jnp.abs(twice) > 3 * d)
    ok = _in_range(n_exp, 1, 254) & _in_range(d_exp, 1, 254) & _in_range(exponent, 1, 253)
    sign = float_bits(quotient) & jnp.int32(-0x80000000)
    return jnp.where(ok, bits_float((q_bits + jnp.where(twice < 0, -floats, floats)) | sign), quotient)


def round_to_precision(values: jax.Array, dtype) -> jax.Array:
    """float32 ``values`` rounded (half to even) to ``dtype``'s precision and range, kept as float32.

    This is PyTorch's bf16/fp16 op semantics: compute in float32, round the result to the dtype. Its
    bfloat16 conversion also makes every NaN the positive quiet NaN 0x7FC0 (float16 keeps the sign).
    """
    if jnp.dtype(dtype) == jnp.float32:
        return values
    info = jnp.finfo(dtype)
    rounded = lax.reduce_precision(values, exponent_bits=info.nexp, mantissa_bits=info.nmant)
    if jnp.dtype(dtype) == jnp.float16:
        # reduce_precision flushes results below the smallest normal (float16: 2^-14) to zero, where
        # PyTorch keeps float16's subnormals. Below 2^-14 float16 is the fixed grid of 2^-24, and
        # round(v · 2^24) · 2^-24 is that rounding, exact in float32 (powers of two, normal operands).
        subnormal = jnp.round(values * 2.0 ** 24) * 2.0 ** -24
        rounded = jnp.where(jnp.abs(values) < float(info.smallest_normal), subnormal, rounded)
    if jnp.dtype(dtype) == jnp.bfloat16:
        rounded = jnp.where(jnp.isnan(rounded), jnp.asarray(np.nan, rounded.dtype), rounded)
    return rounded


# ---- magnitudes below float32's normal range ------------------------------------------------------
#
# XLA on CPU and GPU flushes float32 subnormals to zero, on input and output of every arithmetic op,
# where PyTorch and numpy keep them. A block whose amax is under ``TINY`` is therefore computed
# "lifted": every value times 2**LIFT (exactly, from the bits), so inputs, amax and quotients are all
# normal floats; quotients are invariant under the lift, and a scale that is subnormal in the true
# domain is rounded to that grid with integer arithmetic (``unlift_quotient``), as IEEE would.
TINY = 2.0 ** -60
LIFT = 64


def float_bits(values: jax.Array) -> jax.Array:
    """The int32 bit patterns of float32 ``values`` (no arithmetic, so nothing is flushed)."""
    return lax.bitcast_convert_type(values.astype(jnp.float32), jnp.int32)


def bits_float(bits: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(bits.astype(jnp.int32), jnp.float32)


def abs_bits(values: jax.Array) -> jax.Array:
    """int32 bits of float32 ``|values|``: ordered like the values, subnormals kept, NaN above +Inf."""
    return float_bits(values) & 0x7FFFFFFF


def exact_abs_max(values: jax.Array, axis) -> jax.Array:
    """Max |values| over ``axis`` from the bit patterns: exact for subnormals, NaN if any is NaN
    (NaN patterns sort above Inf), whatever XLA's float reductions do with either."""
    return bits_float(jnp.max(abs_bits(values), axis=axis))


def is_tiny(amax: jax.Array) -> jax.Array:
    """True where an (exact, from ``exact_abs_max``) amax is under ``TINY`` (0 included)."""
    return abs_bits(amax) < float_bits(jnp.float32(TINY))


def lift(values: jax.Array, tiny: jax.Array) -> jax.Array:
    """float32 ``values`` times 2**LIFT where ``tiny`` (broadcast), exactly, subnormals included."""
    values = values.astype(jnp.float32)
    bits = float_bits(values)
    subnormal = (bits & 0x7F800000) == 0
    # mantissa · 2**(LIFT-149): an integer under 2**23 times a normal power of two, both exact.
    from_subnormal = (bits & 0x7FFFFF).astype(jnp.float32) * jnp.float32(2.0 ** (LIFT - 149))
    from_subnormal = jnp.where(bits < 0, -from_subnormal, from_subnormal)
    lifted = jnp.where(subnormal, from_subnormal, values * jnp.float32(2.0 ** LIFT))
    return jnp.where(tiny, lifted, values)


def _odd_times_pow2(divisor: float) -> tuple[int, int]:
    """``divisor = c · 2**j`` with odd integer ``c < 256`` (every divisor the formats use)."""
    mantissa, exponent = np.frexp(np.float64(divisor))
    c, j = int(mantissa * 2 ** 53), int(exponent) - 53
    while c % 2 == 0:
        c, j = c // 2, j + 1
    if c >= 256:
        raise ValueError(f"divisor {divisor} is not a small odd integer times a power of two")
    return c, j


def unlift_quotient(numerator: jax.Array, divisor: float, tiny: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(true, lifted) float32 ``numerator / divisor`` of a lifted ``numerator`` (``tiny`` marks the lifted
    entries): the true quotient correctly rounded, subnormal ones included (as float32 bit patterns
    XLA would flush in arithmetic), and that same value times 2**LIFT for computing with.

    A subnormal quotient is ``round(M · 2**t / c)`` units of 2**-149 for the numerator's 24-bit
    significand ``M`` and ``divisor = c · 2**j``: integer division with the remainder deciding the
    rounding (half to even), since rounding the float quotient again would round twice.
    """
    numerator = numerator.astype(jnp.float32)
    quotient = exact_divide(numerator, divisor)  # normal ones: the true quotient times 2**LIFT
    subnormal = tiny & (quotient < jnp.float32(2.0 ** (LIFT - 126)))
    c, j = _odd_times_pow2(divisor)
    bits = abs_bits(numerator)
    significand = _significand(bits)
    t = ((bits >> 23) - 1 - LIFT - j).astype(jnp.int32)
    # t >= 0: N = M << t < c · 2**23 < 2**31 wherever the quotient is subnormal.
    n = significand << jnp.clip(t, 0, 31).astype(jnp.uint32)
    q_up, r_up = n // c, n % c
    up_units = q_up + (2 * r_up > c).astype(jnp.uint32)
    # t < 0: divide M by D = c << -t; beyond -t = 24 the quotient is under 1/2 a unit, so 0.
    d = jnp.uint32(c) << jnp.clip(-t, 0, 24).astype(jnp.uint32)
    q_dn, r_dn = significand // d, significand % d
    half = (r_dn > d - r_dn) | ((r_dn == d - r_dn) & (q_dn % 2 == 1))
    down_units = jnp.where(-t > 24, jnp.uint32(0), q_dn + half.astype(jnp.uint32))
    units = jnp.where(bits == 0, jnp.uint32(0), jnp.where(t >= 0, up_units, down_units))
    units_lifted = units.astype(jnp.float32) * jnp.float32(2.0 ** (LIFT - 149))
    true = jnp.where(subnormal, bits_float(units.astype(jnp.int32)),
                     jnp.where(tiny, quotient * jnp.float32(2.0 ** -LIFT), quotient))
    true = jnp.where(jnp.isnan(quotient), quotient, true)
    return true, jnp.where(subnormal, units_lifted, quotient)


def unlift_exact(lifted: jax.Array, tiny: jax.Array) -> jax.Array:
    """The true float32 of a lifted value representable in the true domain (a power of two ≥ 2**-149,
    or a subnormal scale): ``lifted · 2**-LIFT`` as bits, subnormal results included."""
    normal = lifted * jnp.float32(2.0 ** -LIFT)
    units = (lifted * jnp.float32(2.0 ** (149 - LIFT))).astype(jnp.int32)
    small = tiny & (jnp.abs(lifted) < jnp.float32(2.0 ** (LIFT - 126)))
    return jnp.where(small, bits_float(units), jnp.where(tiny, normal, lifted))


def bfloat16_bits_exact(values: jax.Array) -> jax.Array:
    """float32 ``values`` rounded (half to even) to bfloat16 on the bits, subnormals kept (XLA's cast
    would flush them); every NaN becomes 0x7FC0, as PyTorch's conversion makes it."""
    bits = float_bits(values)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    rounded = jnp.where(jnp.isnan(values), 0x7FC0, rounded)
    return lax.bitcast_convert_type(rounded.astype(jnp.uint16), jnp.bfloat16)


def to_float32_exact(values: jax.Array) -> jax.Array:
    """``values`` as float32 without flushing and with their rounding kept: bfloat16 by its bits, other
    dtypes by XLA's cast behind an optimization barrier.

    XLA's GPU compiler drops a float32 → narrower float → float32 round trip (``SimplifyFPConversions``,
    on by default with ``xla_allow_excess_precision``): on the H100 a jitted float32 → float4_e2m1fn →
    float32 returned its input, an NVFP4 scale cast to e4m3 and read back divided by the unrounded scale,
    and an FP8 quantize-dequantize returned x. The barrier hides the narrow value's origin from it.
    """
    if values.dtype == jnp.float32:
        return values
    if values.dtype == jnp.bfloat16:
        widened = lax.bitcast_convert_type(values, jnp.uint16).astype(jnp.int32) << 16
        return bits_float(widened)
    return lax.optimization_barrier(values).astype(jnp.float32)


def store_exact(values: jax.Array, dtype) -> jax.Array:
    """float32 ``values`` (subnormals as bit patterns) in ``dtype`` without XLA's flush to zero."""
    dtype = jnp.dtype(dtype)
    values = to_float32_exact(values)
    if dtype == jnp.float32:
        return values
    if dtype == jnp.bfloat16:
        return bfloat16_bits_exact(values)
    return values.astype(dtype)  # float16 / fp8 ranges end far above float32's subnormals
