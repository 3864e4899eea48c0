"""grouped_matmul: ragged_dot's contract with [E, N, K] experts, against a row-by-row loop; input checks."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

import jquant
from jquant.kernels.moe import QExperts, choose_impl, expert, grouped_matmul, quantize_expert_weights
from jquant.schemes.xla import quantize_activation
from moe_reference import grouped_matmul_loop

E, N, K, T = 4, 8, 32, 24
W = jax.random.normal(jax.random.key(0), (E, N, K), jnp.float32)
X = jax.random.normal(jax.random.key(1), (T, K), jnp.float32)
jitted = jax.jit(grouped_matmul)


def check(x, w, sizes, **tol):
    y = jitted(x, w, jnp.asarray(sizes, jnp.int32))
    chex.assert_shape(y, (x.shape[0], w.shape[1]))
    np.testing.assert_allclose(np.asarray(y), grouped_matmul_loop(x, w, sizes), rtol=1e-5, atol=1e-5, **tol)
    return y


@given(st.lists(st.integers(0, T // E), min_size=E, max_size=E))
def test_matches_loop_for_any_group_sizes(sizes):
    y = check(X, W, sizes)
    assert not np.any(np.asarray(y)[sum(sizes):]), "rows past the groups are zeros"


@given(st.lists(st.integers(0, 7), min_size=E - 1, max_size=E - 1))
def test_groups_that_fill_every_row(head):
    sizes = head + [T - sum(head)]  # the last expert takes the rest: sum(group_sizes) == T
    check(X, W, sizes)


@pytest.mark.parametrize("sizes", [[0, 0, 0, 0], [T, 0, 0, 0], [0, 0, 0, T], [0, 7, 0, 13], [1, 2, 3, 5]],
                         ids=["empty", "first-takes-all", "last-takes-all", "empty-between", "odd-sizes"])
def test_edge_group_sizes(sizes):
    check(X, W, sizes)


def test_one_row_and_no_rows():
    check(X[:1], W, [0, 0, 1, 0])
    y = grouped_matmul(X[:0], W, jnp.zeros((E,), jnp.int32))
    chex.assert_shape(y, (0, N))


@pytest.mark.parametrize("scheme", ["int4_g32", "nf4"])
def test_quantized_stack_equals_its_dequantized_weights(scheme):
    qw = quantize_expert_weights(W, scheme)
    sizes = jnp.array([5, 0, 11, 3], jnp.int32)
    y = jitted(X, qw, sizes)
    chex.assert_trees_all_equal(y, jitted(X, qw.dequantize(), sizes))
    assert float(jnp.abs(y - jitted(X, W, sizes)).max()) > 0  # it did use the quantized weights


def test_bfloat16_rows_keep_their_dtype():
    y = grouped_matmul(X.astype(jnp.bfloat16), W, jnp.array([6, 6, 6, 6], jnp.int32))
    assert y.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(y, np.float32), grouped_matmul_loop(X.astype(jnp.bfloat16),
                               W.astype(jnp.bfloat16), [6, 6, 6, 6]), rtol=2e-2, atol=5e-2)


def test_qexperts_apply_quantizes_activations_for_block_fp8():
    w = jax.random.normal(jax.random.key(2), (2, 128, 128), jnp.float32)
    x = jax.random.normal(jax.random.key(3), (5, 128), jnp.float32)
    scheme = jquant.get_scheme("fp8_e4m3_block128x128")
    experts = QExperts(quantize_expert_weights(w, scheme), scheme)

    @jax.jit
    def run(x, experts):
        sizes = jnp.array([2, 3], jnp.int32)
        xq = quantize_activation(scheme, x).dequantize(jnp.float32)
        # each expert's rows are what the 2-D scheme computes for that expert alone
        alone = [scheme.apply(x[:2], expert(experts.weight, 0)), scheme.apply(x[2:], expert(experts.weight, 1))]
        return experts.apply(x, sizes), grouped_matmul(xq, experts.weight, sizes), jnp.concatenate(alone)

    y, from_dequantized, per_expert = run(x, experts)
    chex.assert_trees_all_close(y, from_dequantized, rtol=1e-6)
    chex.assert_trees_all_close(y, per_expert, rtol=1e-5, atol=1e-5)


def test_auto_is_xla_everywhere():
    assert choose_impl(W) == "xla" and choose_impl(quantize_expert_weights(W, "mxfp4")) == "xla"


@pytest.mark.parametrize("sizes, match", [
    ([3, -1, 2, 0], r"group_sizes must be >= 0, got \[3, -1, 2, 0\] \(negative at expert 1\)"),
    ([10, 10, 10, 0], r"group_sizes sum to 30, more than the 24 rows of x"),
    ([4, 4, 4], r"group_sizes must have shape \(4,\) \(one size per expert\), got \(3,\)"),
])
def test_bad_group_sizes_are_named(sizes, match):
    with pytest.raises(ValueError, match=match):
        grouped_matmul(X, W, jnp.asarray(sizes, jnp.int32))


def test_bad_inputs_are_named():
    sizes = jnp.array([6, 6, 6, 6], jnp.int32)
    with pytest.raises(TypeError, match="group_sizes must be integers"):
        grouped_matmul(X, W, sizes.astype(jnp.float32))
    with pytest.raises(ValueError, match=r"x has K=16 .* expect K=32"):
        grouped_matmul(X[:, :16], W, sizes)
    with pytest.raises(ValueError, match=r"x must be rows \[T, K\]"):
        grouped_matmul(X[None], W, sizes)
    with pytest.raises(TypeError, match="x must be bfloat16, float16 or float32"):
        grouped_matmul(X.astype(jnp.int32), W, sizes)
    with pytest.raises(ValueError, match=r"experts must be \[E, N, K\] \(3-D\)"):
        grouped_matmul(X, W[0], sizes)
    with pytest.raises(ValueError, match=r"experts must be a stacked expert QTensor \[E, N, K\] \(3-D\)"):
        grouped_matmul(X, jquant.quantize(W[0], "int4", group_size=32), sizes)
    with pytest.raises(ValueError, match="experts records K on axis 1"):
        grouped_matmul(X, jquant.quantize(W, "int4", axis=1, group_size=8), sizes)
    with pytest.raises(ValueError, match="impl must be one of"):
        grouped_matmul(X, W, sizes, impl="pallas")


def test_traced_group_sizes_skip_the_value_checks():
    # under jit the values are unknown: shape and dtype are still checked
    jax.jit(grouped_matmul)(X, W, jnp.array([6, 6, 6, 6], jnp.int32))
    with pytest.raises(ValueError, match="one size per expert"):
        jax.jit(grouped_matmul)(X, W, jnp.array([6, 6], jnp.int32))
