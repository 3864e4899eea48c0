import chex
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st
from hypothesis.extra import numpy as hnp

from jquant.formats.fake_quant import blockwise_symmetric_fake_quant


def test_seed_lesson_example():
    y, scales = blockwise_symmetric_fake_quant(jnp.array([0.0, 1.0, -2.0, 8.0]), 2, 7)
    chex.assert_trees_all_close(scales, jnp.array([1 / 7, 8 / 7]), rtol=1e-7)
    # 1.0 is exactly representable at scale 1/7; -2 rounds to -2 steps of 8/7.
    chex.assert_trees_all_close(y, jnp.array([0.0, 1.0, -16 / 7, 8.0]), rtol=1e-6)


def test_all_zero_block_gets_scale_one():
    y, scales = blockwise_symmetric_fake_quant(jnp.array([0.0, 0.0, 3.0, -1.5]), 2, 7)
    assert float(scales[0]) == 1.0
    assert np.all(np.asarray(y[:2]) == 0)


@given(hnp.arrays(np.float32, st.sampled_from([4, 8, 16]),
                  elements=st.floats(-1e4, 1e4, width=32, allow_subnormal=False)),
       st.sampled_from([1, 2, 4]), st.sampled_from([1, 7, 127]))
def test_error_at_most_half_a_step(x, block, qmax):
    y, scales = blockwise_symmetric_fake_quant(jnp.asarray(x), block, qmax)
    step = np.repeat(np.asarray(scales), block)
    assert np.all(np.abs(np.asarray(y) - x) <= step / 2 * (1 + 1e-6) + 1e-30)


@pytest.mark.parametrize("args, err", [
    ((jnp.zeros((2, 2)), 2, 7), ValueError),
    ((jnp.arange(5.0), 2, 7), ValueError),
    ((jnp.arange(4), 2, 7), TypeError),
    ((jnp.arange(4.0), 0, 7), ValueError),
    ((jnp.arange(4.0), 2, 0), ValueError),
    ((jnp.zeros((0,)), 2, 7), ValueError),
])
def test_bad_input(args, err):
    with pytest.raises(err):
        blockwise_symmetric_fake_quant(*args)
