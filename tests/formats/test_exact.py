"""``exact_divide`` under ``jit``: numpy's correctly rounded quotient, for broadcast and constant
denominators and every special value, without writing its operands to memory, on CPU and (with
``JQUANT_TEST_GPU=1``) on NVIDIA GPUs, whose XLA divides within 2 ulp (``nearest_quotient``)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from jax import export

from conftest import ON_GPU
import jquant
from jquant.formats import subnormal
from jquant.formats.exact import exact_divide, exact_reciprocal, nearest_quotient, to_float32_exact

# No subnormal operands or quotients: XLA on CPU flushes them (``jquant.formats.subnormal`` handles
# those), so the largest floats are numerators only.
SPECIALS = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 1.0, 448.0, 2.0 ** -60], np.float32)
HUGE = np.array([3.4028235e38, -3.4028235e38], np.float32)


def _bits_equal(a, b):
    """Bit for bit; on the GPU a NaN quotient is its canonical NaN (0x7FFFFFFF), so there NaNs must sit
    where numpy's are, whatever their sign and payload."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    if ON_GPU:
        np.testing.assert_array_equal(np.isnan(a), np.isnan(b))
        a, b = np.where(np.isnan(a), np.float32(np.nan), a), np.where(np.isnan(b), np.float32(np.nan), b)
    np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("shape", [(64, 1), (1, 320), ()])
def test_broadcast_denominator_matches_numpy_bit_for_bit(shape):
    rng = np.random.default_rng()
    x = (rng.standard_normal((64, 320)) * np.exp2(rng.integers(-30, 30, (64, 320)))).astype(np.float32)
    x[:len(SPECIALS), 0] = SPECIALS
    x[0, :len(SPECIALS)] = SPECIALS
    x[-1, :2] = HUGE
    s = np.abs(rng.standard_normal(shape)).astype(np.float32) * np.float32(0.37) + np.float32(1e-3)
    if shape:
        s.flat[:len(SPECIALS)] = SPECIALS[:s.size]
    with np.errstate(all="ignore"):
        expected = x / s
    _bits_equal(jax.jit(exact_divide)(x, s), expected)


def test_plain_division_by_a_broadcast_is_rewritten():
    """What ``exact_divide`` guards against: XLA's ``a / broadcast(b)`` → ``a · broadcast(1 / b)``."""
    rng = np.random.default_rng()
    x = rng.standard_normal((256, 512)).astype(np.float32)
    s = np.abs(rng.standard_normal((256, 1))).astype(np.float32) + np.float32(1e-3)
    assert (np.asarray(jax.jit(jnp.divide)(x, s)) != x / s).any()


def test_constant_denominator_is_divided_not_multiplied():
    x = np.random.default_rng().standard_normal(4096).astype(np.float32)
    _bits_equal(jax.jit(lambda v: exact_divide(v, 448.0))(x), x / np.float32(448.0))


def test_no_optimization_barrier_in_the_compiled_division():
    """The division fuses with its producers: no barrier writing fp32 operands to memory."""
    f = jax.jit(lambda x, s: exact_divide(x.astype(jnp.float32), s))
    text = f.lower(jnp.ones((8, 128), jnp.bfloat16), jnp.ones((8, 1), jnp.float32)).compile().as_text()
    assert "opt-barrier" not in text and "divide" in text


def _normal_operands(rng, shape):
    """Normal float32 operands whose quotients are normal, over a wide exponent range."""
    def draw(lo, hi):
        return (rng.uniform(1.0, 2.0, shape) * np.exp2(rng.integers(lo, hi, shape))).astype(np.float32)
    sign = np.where(rng.random(shape) < 0.5, -1, 1).astype(np.float32)
    return sign * draw(-60, 60), draw(-60, 60)


@pytest.mark.parametrize("ulps", [-2.0, -1.5, -1.0, -0.6, 0.0, 0.6, 1.0, 1.5, 2.0])
def test_nearest_quotient_moves_a_quotient_a_few_ulps_off_to_numpys(ulps):
    """What a GPU's ``div.full.f32`` may give (within 2 ulp of the true quotient), moved back to the
    correctly rounded quotient: random operands, and quotients within 4 ulps of powers of
    two, where the float grid halves below."""
    rng = np.random.default_rng()
    x, s = _normal_operands(rng, (4096,))
    target = np.exp2(rng.integers(-20, 20, 2048)) * (1 + rng.uniform(-4, 4, 2048) * 2.0 ** -24)
    s[:2048] = (np.abs(x[:2048]).astype(np.float64) / target).astype(np.float32)
    expected = x / s
    assert (np.abs(expected[:2048]).view(np.int32) & 0x7FFFFF == 0x7FFFFF).sum() > 100  # just below 2**j
    true = x.astype(np.float64) / s.astype(np.float64)
    off = (true + ulps * np.spacing(np.abs(expected)).astype(np.float64) * np.sign(true)).astype(np.float32)
    _bits_equal(jax.jit(nearest_quotient)(x, s, off), expected)


@settings(max_examples=60, deadline=None)
@given(st.floats(2.0 ** -100, 2.0 ** 100, width=32), st.floats(2.0 ** -100, 2.0 ** 100, width=32),
       st.floats(-2.0, 2.0), st.booleans())
def test_nearest_quotient_random_operands(n, d, ulps, negative):
    x = np.array([-n if negative else n], np.float32)
    s = np.array([d], np.float32)
    expected = x / s
    if not np.isfinite(expected).all() or abs(expected[0]) < np.float32(2.0 ** -124):
        return   # outside the normal range: returned as given
    true = np.float64(x[0]) / np.float64(s[0])
    off = np.array([true + ulps * np.float64(np.spacing(np.abs(expected[0]))) * np.sign(true)], np.float32)
    _bits_equal(nearest_quotient(jnp.asarray(x), jnp.asarray(s), jnp.asarray(off)), expected)


def test_nearest_quotient_leaves_specials_as_given():
    """Zeros, Inf, NaN, a subnormal numerator, overflow, division by zero, and a quotient under
    float32's normal range ((1 + 2**-23) · 2**-127, flushed to 0 by XLA) stay as the division gave
    them."""
    x = np.array([0.0, -0.0, np.inf, np.nan, 1.0, 1e-40, 3.0e38, 1.0, (1 + 2.0 ** -23) * 2.0 ** -100], np.float32)
    s = np.array([3.0, 3.0, 3.0, 3.0, np.inf, 3.0, 1e-38, 0.0, 2.0 ** 27], np.float32)
    q = np.array([0.0, -0.0, np.inf, np.nan, 0.0, 5.0, np.inf, np.inf, 0.0], np.float32)
    _bits_equal(nearest_quotient(jnp.asarray(x), jnp.asarray(s), jnp.asarray(q)), q)


@pytest.mark.parametrize("platform,corrected", [("cuda", True), ("rocm", True), ("cpu", False)])
def test_the_correction_is_lowered_for_gpus_not_for_the_cpu(platform, corrected):
    """``nearest_quotient`` (shifts of the bits) where XLA's division is not IEEE; the CPU divides alone."""
    args = (jax.ShapeDtypeStruct((4, 8), jnp.float32), jax.ShapeDtypeStruct((4, 1), jnp.float32))
    text = export.export(jax.jit(exact_divide), platforms=[platform])(*args).mlir_module()
    assert ("stablehlo.shift_left" in text) == corrected


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.float4_e2m1fn],
                         ids=lambda d: jnp.dtype(d).name)
def test_narrow_round_trips_keep_their_rounding_under_jit(dtype):
    """float32 → narrow → float32 in one program rounds, as it does eagerly (XLA's GPU compiler drops
    the round trip unless ``to_float32_exact`` hides it), and an FP8 quantize-dequantize is not x."""
    x = jnp.asarray(np.random.default_rng().standard_normal(4096) * 3, jnp.float32)
    rounded = jax.jit(lambda v: to_float32_exact(v.astype(dtype)))(x)
    np.testing.assert_array_equal(np.asarray(rounded), np.asarray(x).astype(jnp.dtype(dtype)).astype(np.float32))
    assert not np.array_equal(np.asarray(rounded), np.asarray(x))
    quantize = lambda v: jquant.quantize(v[None], "fp8_e4m3", granularity="channel").dequantize(jnp.float32)
    fake = jax.jit(quantize)(x)
    np.testing.assert_array_equal(np.asarray(fake), np.asarray(quantize(x)))
    assert not np.array_equal(np.asarray(fake)[0], np.asarray(x))


def _random_floats(rng, n, lo_exponent, hi_exponent):
    """float32 values with uniformly random sign, mantissa and biased exponent in [lo, hi], from bits."""
    bits = (rng.integers(lo_exponent, hi_exponent + 1, n, dtype=np.uint32) << 23) | rng.integers(
        0, 1 << 23, n, dtype=np.uint32) | (rng.integers(0, 2, n, dtype=np.uint32) << 31)
    return bits.view(np.float32)


def test_reciprocals_are_numpys():
    """``exact_reciprocal(x)``, as the formats' reciprocals compute it, is numpy's ``1 / x`` (XLA's GPU
    ``1 / x`` was 1 ulp off for 13 % of random floats on the H100), for every normal x whose reciprocal
    is normal: biased exponents 1 … 252, drawn uniformly. Outside that XLA flushes the subnormal operand
    or quotient; ``subnormal.reciprocal`` covers it (below)."""
    x = _random_floats(np.random.default_rng(), 1 << 16, 1, 252)
    x[:4] = [2.0 ** -126, -2.0 ** -126, np.nextafter(np.float32(2.0 ** 126), np.float32(0)), 1.0]
    got = jax.jit(exact_reciprocal)(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(got).view(np.uint32), (np.float32(1) / x).view(np.uint32))


def test_subnormal_reciprocals_are_numpys():
    """``subnormal.reciprocal`` (r, shift) with r · 2^-shift numpy's ``1 / a`` where XLA would flush: a
    subnormal a (1 / a normal, or Inf under 2^-128) and a past 2^126 (1 / a subnormal, r normal)."""
    rng = np.random.default_rng()
    subnormals = (rng.integers(1, 1 << 23, 4096, dtype=np.uint32)).view(np.float32)
    big = _random_floats(rng, 4096, 253, 254)
    a = np.abs(np.concatenate([subnormals, big, np.float32([2.0 ** -149, 2.0 ** -128, 2.0 ** 126, 2.0 ** 127])]))
    r, shift = jax.jit(subnormal.reciprocal)(jnp.asarray(a))
    r, shift = np.asarray(r), np.asarray(shift)
    with np.errstate(over="ignore"):
        expected = np.float32(1) / a
    np.testing.assert_array_equal(shift, np.where(a > np.float32(2.0 ** 126), 64, 0))
    plain = shift == 0
    np.testing.assert_array_equal(r[plain].view(np.uint32), expected[plain].view(np.uint32))
    np.testing.assert_array_equal(np.ldexp(r[~plain].astype(np.float64), -64), expected[~plain].astype(np.float64))
    assert np.isinf(expected).any() and (expected[~plain] < np.float32(2.0 ** -126)).all()


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_subnormal_products_are_numpys(jit):
    """``subnormal.product`` is numpy's float32 ``a · b`` bit for bit: subnormal operands and results
    (where XLA reads and writes ±0), results at 2^-126 and 2^-150 after rounding, ties included, and
    every special value."""
    rng = np.random.default_rng()
    n = 1 << 16
    exponent = np.where(rng.random(n) < 0.4, 0, rng.integers(1, 255, n))
    exponent = np.where(rng.random(n) < 0.3, rng.integers(1, 40, n), exponent)
    bits = (rng.integers(0, 2, n) << 31) | (exponent << 23) | rng.integers(0, 1 << 23, n)
    a = bits.astype(np.uint32).view(np.float32)
    # Partners that put half the products within a factor of 4 of 2^-126.
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        near = (np.float32(2.0 ** -126) / a) * rng.uniform(1 / 256, 4, n).astype(np.float32)
    b = np.where(rng.random(n) < 0.5, near, a[rng.permutation(n)]).astype(np.float32)
    # Exact ties at the 2^-149 grid (odd and even), 2^-150 exactly, and the specials.
    ties = np.float32([3 * 2.0 ** -150, 5 * 2.0 ** -150, 2.0 ** -150, 2.0 ** -126 - 2.0 ** -150])
    special = np.float32([0.0, -0.0, np.inf, -np.inf, np.nan, 2.0 ** -149, -(2.0 ** -149), 1.0])
    a = np.concatenate([a, ties, np.repeat(special, special.size)])
    b = np.concatenate([b, np.ones(ties.size, np.float32), np.tile(special, special.size)])
    product = jax.jit(subnormal.product) if jit else subnormal.product
    with np.errstate(over="ignore", invalid="ignore"):
        expected = a * b
    got = np.asarray(product(jnp.asarray(a), jnp.asarray(b)))
    nan = np.isnan(expected)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got[~nan].view(np.uint32), expected[~nan].view(np.uint32))
    tiny = (np.abs(expected) < np.float32(2.0 ** -126)) & (expected != 0)
    assert tiny.sum() > n // 8   # the range XLA flushes is well covered
