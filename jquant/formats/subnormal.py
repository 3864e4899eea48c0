"""float32 arithmetic that keeps PyTorch's subnormals, which XLA flushes to zero on CPU and GPU.

XLA reads a subnormal input as ±0 and flushes a subnormal result to ±0; PyTorch (CPU) keeps both.
Where a reference library's bytes depend on a subnormal (a tiny element, ``1 / absmax`` for an
absmax above 2^126), these helpers rebuild the value from its bits and keep every intermediate
normal, so the result is PyTorch's correctly rounded one whenever that result is itself normal.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jquant.formats.exact import abs_bits, bits_float, exact_divide, exact_reciprocal, float_bits

_MANTISSA_BITS = 23
_MANTISSA_MASK = (1 << _MANTISSA_BITS) - 1
# 1/a is a subnormal exactly when a > 2^126; its steps of 2^-149 are counted by long division.
_RECIPROCAL_SHIFT = 64
_BIG = np.float32(2.0 ** 126)


def is_subnormal(x: jax.Array) -> jax.Array:
    bits = abs_bits(x)
    return (bits > 0) & (bits <= _MANTISSA_MASK)


def _subnormal_magnitude(bits: jax.Array) -> jax.Array:
    """m · 2^-23 for the mantissa field m: a subnormal x is that times 2^-126, exact and normal."""
    return (bits & _MANTISSA_MASK).astype(jnp.float32) * np.float32(2.0 ** -_MANTISSA_BITS)


def _subnormal_reciprocal_steps(a: jax.Array) -> jax.Array:
    """int32 n with fl(1/a) = n · 2^-149 (round half to even) for float32 a in (2^126, 2^128).

    a = M · 2^(E-23) with a 24-bit M and E in {126, 127}, so n rounds 2^(172-E) / M: 47 steps of
    binary long division give floor(2^47 / M) and a remainder, all below 2^25.
    """
    bits = abs_bits(a)
    divisor = (bits & _MANTISSA_MASK) | (1 << _MANTISSA_BITS)
    drop = jnp.where((bits >> _MANTISSA_BITS) - 127 == 126, 1, 2)  # 2^46/M or 2^45/M from 2^47/M

    def step(_, state):
        quotient, remainder = state
        remainder = remainder << 1
        digit = (remainder >= divisor).astype(jnp.int32)
        return (quotient << 1) | digit, remainder - digit * divisor

    # A loop, not 47 unrolled steps, which XLA would fuse into (and recompile for) every consumer.
    quotient, remainder = jax.lax.fori_loop(0, 47, step, (jnp.zeros_like(bits), jnp.ones_like(bits)))
    kept = quotient >> drop
    half = (quotient >> (drop - 1)) & 1
    sticky = ((quotient & ((1 << (drop - 1)) - 1)) != 0) | (remainder != 0)
    return kept + (half & (sticky | (kept & 1)).astype(jnp.int32))


def reciprocal(a: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(r, shift) with r · 2^-shift = PyTorch's float32 ``1 / a`` for positive float32 ``a``; r is
    normal wherever 1/a is a subnormal (a in (2^126, 2^128): shift 64), shift 0 elsewhere
    (a subnormal ``a`` included: its 1/a is normal, or Inf below 2^-128 as in PyTorch)."""
    a = a.astype(jnp.float32)
    big = (abs_bits(a) > abs_bits(_BIG)) & jnp.isfinite(a)
    steps = _subnormal_reciprocal_steps(jnp.where(big, a, _BIG)).astype(jnp.float32)
    scaled = steps * np.float32(2.0 ** (_RECIPROCAL_SHIFT - 149))  # exact: steps < 2^24
    # A subnormal a is m_s · 2^-126 (m_s = m · 2^-23 normal): 1/a = (1/m_s) · 2^126, Inf past 2^128.
    tiny = exact_reciprocal(_subnormal_magnitude(abs_bits(a))) * np.float32(2.0 ** 126)
    plain = jnp.where(is_subnormal(a), tiny, exact_reciprocal(a))
    return jnp.where(big, scaled, plain), jnp.where(big, _RECIPROCAL_SHIFT, 0)


def multiply(x: jax.Array, r: jax.Array, shift) -> jax.Array:
    """float32 ``x · (r · 2^-shift)`` rounded once, as PyTorch, for any float32 ``x`` (subnormal
    ones included) and normal ``r``; ``shift`` is 0 or 64 (see ``reciprocal``). A result below
    2^-126 is flushed by XLA (PyTorch keeps a subnormal): callers that tell ±tiny from zero use
    ``tiny_product_sign``."""
    x = x.astype(jnp.float32)
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    m = _subnormal_magnitude(bits)
    unshift = jnp.where(shift == 0, np.float32(1), np.float32(2.0 ** -_RECIPROCAL_SHIFT))
    tiny = (jnp.where(bits < 0, -m, m) * r) * np.float32(2.0 ** -126) * unshift
    return jnp.where(is_subnormal(x), tiny, (x * r) * unshift)


def tiny_product_sign(x: jax.Array, r: jax.Array, shift) -> jax.Array:
    """int32 sign (-1, 0, 1) of PyTorch's float32 ``x · (r · 2^-shift)``, also where XLA flushes it:
    PyTorch rounds a tiny product to a multiple of 2^-149, which is zero only at or below 2^-150 in
    magnitude. Judged on the product scaled by a power of two into the normal range (rounded once
    there, so a product within a float32 step of 2^-150 may be misjudged)."""
    x = x.astype(jnp.float32)
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    subnormal = is_subnormal(x)
    shift = jnp.asarray(shift, jnp.int32)
    # subnormal: |x·r| = (m·r) · 2^(-126-shift); normal: (|x|·2^64 · r) · 2^(-64-shift).
    product = jnp.where(subnormal, _subnormal_magnitude(bits), jnp.abs(x) * np.float32(2.0 ** 64)) * r
    limit_exponent = jnp.where(subnormal, shift - 24, shift - 86)  # 2^-150 moved alike
    limit = jax.lax.bitcast_convert_type((limit_exponent + 127) << _MANTISSA_BITS, jnp.float32)
    return jnp.where(product > limit, jnp.where(bits < 0, -1, 1), 0)


def _to_normal(v: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(v · 2^s, s) with s = 64 for a subnormal v (exact, normal), 0 otherwise."""
    bits = jax.lax.bitcast_convert_type(v, jnp.int32)
    m = _subnormal_magnitude(bits) * np.float32(2.0 ** -62)
    scaled = jnp.where(is_subnormal(v), jnp.where(bits < 0, -m, m), v)
    return scaled, jnp.where(is_subnormal(v), 64, 0)


def divide(x: jax.Array, a: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(PyTorch's float32 ``x / a`` rounded once, its sign where XLA flushes it) for float32 ``x``
    and positive ``a`` with |x| ≤ a, subnormals included (see ``tiny_product_sign`` for the sign)."""
    x_s, x_shift = _to_normal(x.astype(jnp.float32))
    a_s, a_shift = _to_normal(a.astype(jnp.float32))
    a_shift = jnp.broadcast_to(a_shift, x_s.shape)
    quotient = exact_divide(x_s, a_s)
    # |x| ≤ a, so the shifts differ only as (x subnormal, a normal): undo 2^64 in x.
    quotient = jnp.where(x_shift > a_shift, quotient * np.float32(2.0 ** -64), quotient)
    # |x/a| > 2^-150 in the domain scaled by 2^64 more (x_s · 2^64 may overflow only for large x).
    big = exact_divide(jnp.abs(x_s) * np.float32(2.0 ** 64), a_s)
    limit = jnp.where(x_shift > a_shift, np.float32(2.0 ** -22), np.float32(2.0 ** -86))
    negative = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32) < 0
    sign = jnp.where(big > limit, jnp.where(negative, -1, 1), 0)
    return quotient, sign


_LIFT64 = np.float32(2.0 ** 64)


def lift64(x: jax.Array) -> jax.Array:
    """float32 ``x · 2^64``, exact for subnormal ``x`` too (XLA reads them as 0), for |x| < 2^60.
    Scaled so, float32 sums, differences and quotients of tiny values round as PyTorch's do unscaled:
    a result PyTorch keeps as a subnormal is exact there, and exact here."""
    x = x.astype(jnp.float32)
    scaled, shift = _to_normal(x)
    return jnp.where(shift == 64, scaled, x * _LIFT64)


def unlift64(v: jax.Array) -> jax.Array:
    """float32 ``v · 2^-64``, a subnormal result built from its bits (XLA's multiply would flush it),
    rounded half to even to a multiple of 2^-149 (exact for ``lift64``'s image)."""
    v = v.astype(jnp.float32)
    small = jnp.abs(v) < np.float32(2.0 ** -62)
    units = jnp.round(jnp.abs(v) * np.float32(2.0 ** 85)).astype(jnp.int32)   # < 2^23 where small
    sign = float_bits(v) & jnp.int32(-0x80000000)
    return jnp.where(small, bits_float(units | sign), v * np.float32(2.0 ** -64))


def _significand_and_exponent(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(24-bit integer significand M, unbiased exponent e) with |x| = M · 2^(e - 23), for finite
    nonzero float32 x, subnormals included (normalized from their bits)."""
    bits = abs_bits(x)
    field = bits >> _MANTISSA_BITS
    mantissa = bits & _MANTISSA_MASK
    # A subnormal's leading one sits at bit floor(log2 m); shift it up to bit 23.
    lead = jnp.where(mantissa > 0, 31 - jax.lax.clz(jnp.maximum(mantissa, 1)), 0)
    shift = _MANTISSA_BITS - lead
    normal = field > 0
    significand = jnp.where(normal, mantissa | (1 << _MANTISSA_BITS), mantissa << shift)
    exponent = jnp.where(normal, field - 127, -126 - shift)
    return significand.astype(jnp.uint32), exponent


def product(a: jax.Array, b: jax.Array) -> jax.Array:
    """PyTorch's float32 ``a · b`` (rounded once, half to even), subnormal operands and results kept.

    A result below 2^-126 is rounded from the exact 48-bit product of the significands (two 24-bit
    halves in uint32 arithmetic); a normal result of a subnormal operand is the lifted product
    (``lift64``, exact, then one rounding); anything else is XLA's product.
    """
    a, b = jnp.broadcast_arrays(a.astype(jnp.float32), b.astype(jnp.float32))
    ma, ea = _significand_and_exponent(a)
    mb, eb = _significand_and_exponent(b)
    # ma · mb = hi · 2^24 + lo from 12-bit limbs (each partial product below 2^24).
    a1, a0, b1, b0 = ma >> 12, ma & 0xFFF, mb >> 12, mb & 0xFFF
    mid = a1 * b0 + a0 * b1
    low = a0 * b0 + ((mid & 0xFFF) << 12)
    lo, hi = low & 0xFFFFFF, a1 * b1 + (mid >> 12) + (low >> 24)
    # |a·b| = (hi · 2^24 + lo) · 2^(ea + eb - 46): in units of 2^-149 a right shift by 24 + k, with
    # k = -127 - ea - eb ≥ 0 where the result is below 2^-125 (2^24 units: the bits are the units
    # there, normal or not); from k = 25 it rounds to 0.
    k = -127 - ea - eb
    tiny_range = k >= 0
    ku = jnp.clip(k, 0, 25).astype(jnp.uint32)
    kept = jnp.where(ku >= 24, jnp.uint32(0), hi >> jnp.minimum(ku, 23))
    rest = jnp.where(ku >= 25, jnp.uint32(0), hi & ((jnp.uint32(1) << jnp.minimum(ku, 24)) - 1))
    half = jnp.uint32(1) << (jnp.maximum(ku, 1) - 1)
    above = jnp.where(ku == 0, lo > (1 << 23), (rest > half) | ((rest == half) & (lo > 0)))
    tie = jnp.where(ku == 0, lo == (1 << 23), (rest == half) & (lo == 0))
    above, tie = above & (ku < 25), tie & (ku < 25)
    units = kept + (above | (tie & ((kept & 1) == 1))).astype(jnp.uint32)
    sign = (float_bits(a) ^ float_bits(b)) & jnp.int32(-0x80000000)
    tiny = bits_float(units.astype(jnp.int32) | sign)
    lifted_a = (lift64(a) * b) * np.float32(2.0 ** -64)
    lifted_b = (a * lift64(b)) * np.float32(2.0 ** -64)
    plain = jnp.where(is_subnormal(a), lifted_a, jnp.where(is_subnormal(b), lifted_b, a * b))
    nonzero = (abs_bits(a) > 0) & (abs_bits(b) > 0) & jnp.isfinite(a) & jnp.isfinite(b)
    return jnp.where(tiny_range & nonzero, tiny, plain)
