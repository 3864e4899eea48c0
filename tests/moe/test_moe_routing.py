"""Routing: softmax top-k (gpt-oss), sigmoid + correction bias + groups (DeepSeek-V3) against a
token-by-token loop, ties, NaN logits, argument checks; sort / gather / combine."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jquant.kernels.moe import check_router_logits, combine, gather_rows, route, route_checked, sort_by_expert
from moe_reference import route_loop


def tied_logits(t, e, seed=0):
    """Small integers: many equal logits per token, so selection is decided by tie-breaking."""
    return jnp.asarray(np.random.default_rng(seed).integers(-2, 3, (t, e)), jnp.float32)


CASES = {
    "gpt-oss softmax": dict(top_k=4),
    "softmax unnormalized": dict(top_k=3, normalize=False),
    "softmax groups": dict(top_k=3, n_group=4, topk_group=2, group_score="max"),
    "deepseek-v3": dict(top_k=4, scoring="sigmoid", n_group=4, topk_group=2, routed_scaling_factor=2.5,
                        correction_bias=jnp.asarray(np.tile([0.0, 0.25, -0.25, 0.5], 4), jnp.float32)),
    "sigmoid no groups": dict(top_k=2, scoring="sigmoid", normalize=False),
    "one expert a group": dict(top_k=2, scoring="sigmoid", n_group=16, topk_group=3),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("logits", ["ties", "random"])
def test_route_matches_the_loop(case, logits):
    options = CASES[case]
    x = tied_logits(9, 16) if logits == "ties" else jax.random.normal(jax.random.key(0), (9, 16)) * 3
    got = route(x, **options)
    weights, indices = route_loop(x, **options)
    chex.assert_shape(got.indices, indices.shape)
    assert got.indices.dtype == jnp.int32 and got.weights.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(got.indices), indices)
    np.testing.assert_allclose(np.asarray(got.weights), weights, rtol=1e-6, atol=1e-7)


def test_ties_go_to_the_lowest_expert():
    got = route(jnp.zeros((2, 8)), 3)
    np.testing.assert_array_equal(np.asarray(got.indices), [[0, 1, 2], [0, 1, 2]])
    np.testing.assert_allclose(np.asarray(got.weights), np.full((2, 3), 1 / 3), rtol=1e-6)
    # equal group scores: the lowest group wins, then the lowest experts in it
    got = route(jnp.zeros((1, 8)), 2, scoring="sigmoid", n_group=4, topk_group=1)
    np.testing.assert_array_equal(np.asarray(got.indices), [[0, 1]])


def test_correction_bias_selects_but_does_not_weigh():
    logits = jnp.array([[2.0, 0.0, 0.0, 0.0]])
    bias = jnp.array([0.0, 0.0, 0.0, 5.0])
    got = route(logits, 1, scoring="sigmoid", correction_bias=bias, normalize=False)
    assert int(got.indices[0, 0]) == 3
    np.testing.assert_allclose(float(got.weights[0, 0]), 0.5, rtol=1e-6)  # sigmoid(0), not sigmoid(0) + 5


def test_gpt_oss_order_topk_then_softmax():
    logits = jnp.array([[1.0, 3.0, 2.0, -1.0]])
    got = route(logits, 2)
    np.testing.assert_array_equal(np.asarray(got.indices), [[1, 2]])
    expected = np.exp([3.0, 2.0]) / np.exp([3.0, 2.0]).sum()
    np.testing.assert_allclose(np.asarray(got.weights[0]), expected, rtol=1e-6)


def test_nan_logits_stay_in_their_token():
    clean = jax.random.normal(jax.random.key(1), (4, 8))
    logits = clean.at[1, 3].set(jnp.nan).at[2].set(jnp.nan)
    for options in ({}, {"scoring": "sigmoid", "n_group": 2, "topk_group": 1}):
        got = route(logits, 2, **options)
        indices, weights = np.asarray(got.indices), np.asarray(got.weights)
        assert np.all((indices >= 0) & (indices < 8)), "indices stay valid experts"
        assert np.all(np.isnan(weights[1:3])) and np.all(np.isfinite(weights[[0, 3]]))
        assert 3 not in indices[1], "a NaN score is never chosen over finite ones"
        expected = route(clean, 2, **options)  # the other tokens route as without the NaNs
        np.testing.assert_array_equal(indices[[0, 3]], np.asarray(expected.indices)[[0, 3]])
        np.testing.assert_array_equal(weights[[0, 3]], np.asarray(expected.weights)[[0, 3]])


def test_checked_routing_names_nan_tokens():
    logits = np.zeros((5, 4), np.float32)
    logits[3, 1] = np.nan
    with pytest.raises(ValueError, match=r"router logits hold NaN for 1 of 5 tokens \(first: token 3\)"):
        route_checked(logits, 2)
    with pytest.raises(TypeError, match="call it outside jit"):
        jax.jit(check_router_logits)(jnp.asarray(logits))
    check_router_logits(np.zeros((5, 4), np.float32))
    chex.assert_shape(route_checked(np.zeros((5, 4), np.float32), 2).indices, (5, 2))


@pytest.mark.parametrize("options, match", [
    (dict(top_k=9), r"top_k=9 exceeds the number of experts num_experts=8"),
    (dict(top_k=0), r"top_k must be a positive int, got 0"),
    (dict(top_k=2, n_group=3), r"n_group=3 does not divide num_experts=8"),
    (dict(top_k=2, n_group=4, topk_group=5), r"topk_group=5 exceeds n_group=4"),
    (dict(top_k=5, n_group=4, topk_group=2), r"top_k=5 exceeds the 4 experts of the topk_group=2 groups"),
    (dict(top_k=2, scoring="relu"), r"scoring must be one of"),
    (dict(top_k=2, correction_bias=jnp.zeros(7)), r"correction_bias must have shape \(8,\)"),
])
def test_bad_arguments_are_named(options, match):
    with pytest.raises(ValueError, match=match):
        route(jnp.zeros((3, 8)), **options)


def test_one_token_and_no_tokens():
    got = route(jnp.array([[0.5, -1.0, 2.0]]), 3)
    np.testing.assert_array_equal(np.asarray(got.indices), [[2, 0, 1]])
    chex.assert_shape(route(jnp.zeros((0, 4)), 2).indices, (0, 2))


def test_sort_gather_combine():
    t, e, k, h = 7, 5, 2, 3
    routing = route(jax.random.normal(jax.random.key(2), (t, e)), k)
    d = sort_by_expert(routing.indices, e)
    flat = np.asarray(routing.indices).reshape(-1)
    np.testing.assert_array_equal(np.asarray(d.group_sizes), np.bincount(flat, minlength=e))
    experts = np.asarray(d.experts)
    assert np.all(np.diff(experts) >= 0) and np.array_equal(experts, flat[np.asarray(d.order)])
    order = np.asarray(d.order)
    for expert_id in range(e):  # stable: tokens ascending inside an expert
        assert np.all(np.diff(order[experts == expert_id]) > 0)
    x = jax.random.normal(jax.random.key(3), (t, h))
    rows = gather_rows(x, d)
    np.testing.assert_array_equal(np.asarray(rows), np.asarray(x)[order // k])
    # combining the gathered rows with weights w gives sum_j w[t, j] · x[t]
    out = combine(rows, d, routing.weights)
    expected = np.asarray(x) * np.asarray(routing.weights).sum(1, keepdims=True)
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-6, atol=1e-6)
    assert out.dtype == jnp.float32
