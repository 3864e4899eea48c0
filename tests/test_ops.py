import chex
import jax
import jax.numpy as jnp
import pytest

import jquant


@pytest.mark.parametrize("variant", [lambda f: f, jax.jit], ids=["eager", "jit"])
def test_qdot_is_dot_with_the_dequantized_kernel(variant):
    kernel = jax.random.normal(jax.random.key(0), (128, 48))  # Flax [K, N], quantized along K
    qk = jquant.quantize(kernel, "int8", axis=0, group_size=32)
    x = jax.random.normal(jax.random.key(1), (2, 5, 128), jnp.bfloat16)
    y = variant(jquant.qdot)(x, qk)
    assert y.shape == (2, 5, 48) and y.dtype == jnp.bfloat16
    want = jnp.dot(x.astype(jnp.float32), qk.dequantize(jnp.bfloat16).astype(jnp.float32))
    chex.assert_trees_all_close(y.astype(jnp.float32), want, rtol=1e-2, atol=1e-2)
    assert float(jnp.linalg.norm(y.astype(jnp.float32) - x.astype(jnp.float32) @ kernel)) < 0.05 * float(
        jnp.linalg.norm(want))


def test_qdot_errors():
    qk = jquant.quantize(jax.random.normal(jax.random.key(0), (64, 16)), "fp8_e4m3", granularity="channel", axis=0)
    with pytest.raises(ValueError, match=r"\(3, 32\).*\(64, 16\)"):
        jquant.qdot(jnp.ones((3, 32)), qk)
    with pytest.raises(TypeError, match="QTensor"):
        jquant.qdot(jnp.ones((3, 64)), jnp.ones((64, 16)))
