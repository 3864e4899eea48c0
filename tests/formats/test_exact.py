"""``exact_divide`` under ``jit``: numpy's correctly rounded quotient, for broadcast and constant
denominators and every special value, without writing its operands to memory."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import ON_GPU
from jquant.formats.exact import exact_divide

# XLA's float32 division on NVIDIA GPUs is not correctly rounded: on the H100 x / 448 was 1 ulp off
# numpy's quotient for 54 % of 65536 normal floats, with the operands behind an optimization barrier
# as with the select (the HLO keeps a true divide). Bit-exactness with the reference libraries is a
# CPU property; these tests state it there.
pytestmark = pytest.mark.skipif(ON_GPU, reason="XLA's GPU float32 division is approximate (1 ulp)")

# No subnormal operands or quotients: XLA on CPU flushes them (``jquant.formats.subnormal`` handles
# those), so the largest floats are numerators only.
SPECIALS = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 1.0, 448.0, 2.0 ** -60], np.float32)
HUGE = np.array([3.4028235e38, -3.4028235e38], np.float32)


def _bits_equal(a, b):
    np.testing.assert_array_equal(np.asarray(a).view(np.uint32), np.asarray(b).view(np.uint32))


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
