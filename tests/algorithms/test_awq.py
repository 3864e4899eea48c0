import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jquant.algorithms.awq_core import (AWQResult, activation_mean, apply_clip, awq, fold_into_previous_linear,
                                        fold_scales_into_norm, grid_scales, int_qdq, weight_mean)

T, K, N = 512, 512, 256


def fresh_seed() -> int:
    return int(np.random.default_rng().integers(2**31))


def salient_problem(seed, t=T, k=K, n=N, salient=16, boost=10.0):
    """Activations with a few salient (large-magnitude) input channels and a plain Gaussian weight."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((t, k))
    x[:, rng.choice(k, salient, replace=False)] *= boost
    w = rng.standard_normal((n, k)) * 0.05
    return x.astype(np.float32), w.astype(np.float32)


def output_error(x, w, approx):
    return np.linalg.norm(x.astype(np.float64) @ w.T.astype(np.float64) - np.asarray(approx, np.float64))


def awq_output(x, result, qdq):
    """What the deployed layer computes: (x / s) @ Q(W')ᵀ, with 1/s folded upstream."""
    return (x / result.scales) @ qdq(result.weight).T


# Output error relative to RTN (uint4 g128, the default qdq) with 16 of 512 channels 10× larger:
# about 0.71-0.73 with clipping, 0.75-0.77 from the scale search alone (duo scaling: the same).
@pytest.mark.parametrize("duo_scaling", [False, True])
def test_awq_beats_rtn_on_salient_channels(duo_scaling):
    seed = fresh_seed()
    x, w = salient_problem(seed)
    qdq = int_qdq()
    rtn = output_error(x, w, x @ qdq(w).T)
    clipped = awq(w, x, qdq, duo_scaling=duo_scaling)
    scaled_only = awq(w, x, qdq, duo_scaling=duo_scaling, clip=False)
    ratio = output_error(x, w, awq_output(x, clipped, qdq)) / rtn
    ratio_scale = output_error(x, w, awq_output(x, scaled_only, qdq)) / rtn
    print(f"duo={duo_scaling}: AWQ / RTN output error = {ratio:.3f} (scale search only {ratio_scale:.3f}), "
          f"alpha {float(clipped.alpha):.2f}")
    assert 0.0 < float(clipped.alpha) < 1.0
    assert ratio < 0.85 and ratio_scale < 0.9, f"seed {seed}: {ratio:.3f}, {ratio_scale:.3f}"
    assert ratio < ratio_scale, f"seed {seed}: clipping did not help ({ratio:.3f} vs {ratio_scale:.3f})"


def test_result_is_a_pytree_of_the_documented_shapes():
    x, w = salient_problem(fresh_seed(), t=32, k=256, n=16)
    r = awq(w, x, int_qdq(), n_grid=5)
    assert isinstance(r, AWQResult) and len(jax.tree.leaves(r)) == 5
    chex.assert_shape([r.scales, r.weight, r.alpha, r.losses, r.clip_max], [(256,), (16, 256), (), (5,), (16, 2)])
    chex.assert_type([r.scales, r.weight, r.losses], jnp.float32)
    # The returned weight respects its bounds.
    assert bool(jnp.all(jnp.abs(r.weight) <= jnp.repeat(r.clip_max, 128, axis=1)))


def test_alpha_zero_is_plain_rtn():
    x, w = salient_problem(fresh_seed(), t=64, k=256, n=32)
    qdq = int_qdq()
    np.testing.assert_array_equal(grid_scales(activation_mean(x))[0], np.ones(256, np.float32))
    r = awq(w, x, qdq, n_grid=1, clip=False)
    np.testing.assert_array_equal(r.scales, np.ones(256, np.float32))
    np.testing.assert_array_equal(r.weight, w)
    assert float(r.alpha) == 0.0
    rtn_loss = np.mean((x.astype(np.float64) @ w.T - np.asarray(x @ qdq(w).T, np.float64)) ** 2)
    np.testing.assert_allclose(r.losses[0], rtn_loss, rtol=1e-4)


def reference_scales(x, w, group_size, n_grid, duo):
    """grid_scales in float64 numpy, straight from the formulas."""
    x_mean = np.abs(x.astype(np.float64)).mean(0)
    g = np.abs(w.astype(np.float64)).reshape(w.shape[0], -1, group_size)
    w_mean = (g / (g.max(-1, keepdims=True) + 1e-6)).reshape(w.shape).mean(0)
    out = []
    for i in range(n_grid):
        a = i / n_grid
        s = x_mean ** a / (w_mean ** (1 - a) + 1e-4) if duo else x_mean ** a
        s = np.maximum(s, 1e-4)
        out.append(s / np.sqrt(s.max() * s.min()))
    return np.stack(out)


@pytest.mark.parametrize("duo", [False, True])
def test_candidate_scales_match_numpy(duo):
    x, w = salient_problem(fresh_seed(), t=40, k=128, n=8)
    w_mean = weight_mean(w, 32) if duo else None
    np.testing.assert_allclose(grid_scales(activation_mean(x), 20, w_mean), reference_scales(x, w, 32, 20, duo),
                               rtol=2e-5)


def test_scale_and_clip_search_match_a_loop_reimplementation():
    seed = fresh_seed()
    group, n_grid, max_shrink, n_sample = 32, 20, 0.5, 16
    x, w = salient_problem(seed, t=48, k=64, n=8, salient=4)
    qdq = int_qdq(4, group)
    r = awq(w, x, qdq, group_size=group, n_grid=n_grid, max_shrink=max_shrink, n_sample_tokens=n_sample)

    # Scale search: one loss per candidate (the candidates themselves are checked against numpy above).
    cands = np.asarray(grid_scales(activation_mean(x), n_grid))
    y = x.astype(np.float64) @ w.T
    losses = np.array([np.mean((y - x.astype(np.float64) @ (np.asarray(qdq(w * s), np.float64) / s).T) ** 2)
                       for s in cands])
    np.testing.assert_allclose(r.losses, losses, rtol=1e-4, err_msg=f"seed {seed}")
    best = int(np.argmin(np.asarray(r.losses)))
    assert losses[best] <= losses.min() * (1 + 1e-5), f"seed {seed}"
    np.testing.assert_allclose(r.scales, cands[best], rtol=1e-6)  # eager vs compiled: ulp-level

    # Clip search on the scaled weight and inputs, group by group, every 3rd token (48 // 16).
    s = np.asarray(r.scales)
    ws, xs = w * s, (x / s)[:: 48 // n_sample].astype(np.float64)
    absmax = np.abs(ws).reshape(8, -1, group).max(-1)
    ratios = [1 - i / n_grid for i in range(int(max_shrink * n_grid))]
    errors = np.zeros((len(ratios), 8, 64 // group))
    for i, ratio in enumerate(ratios):
        bound = np.repeat(absmax * np.float32(ratio), group, axis=1)
        q = np.asarray(qdq(np.clip(ws, -bound, bound)), np.float64)
        for n in range(8):
            for g in range(64 // group):
                cols = slice(g * group, (g + 1) * group)
                errors[i, n, g] = np.mean((xs[:, cols] @ (q[n, cols] - ws[n, cols])) ** 2)
    chosen = np.rint((1 - np.asarray(r.clip_max) / absmax) * n_grid).astype(int)
    picked = np.take_along_axis(errors, chosen[None], 0)[0]
    np.testing.assert_array_less(picked, errors.min(0) * (1 + 1e-4) + 1e-12, err_msg=f"seed {seed}")
    np.testing.assert_allclose(r.clip_max, absmax * (1 - chosen / n_grid), rtol=1e-6)
    np.testing.assert_array_equal(r.weight, apply_clip(jnp.asarray(ws), r.clip_max))


def test_folding_into_a_norm_preserves_the_output():
    rng = np.random.default_rng(fresh_seed())
    h = rng.standard_normal((16, 128)).astype(np.float32) * 4
    gamma = rng.uniform(0.5, 2.0, 128).astype(np.float32)
    w = rng.standard_normal((32, 128)).astype(np.float32)
    s = jnp.asarray(rng.uniform(0.05, 20.0, 128), jnp.float32)
    normed = h / np.sqrt(np.mean(h ** 2, axis=-1, keepdims=True) + 1e-6)
    folded = (normed * fold_scales_into_norm(gamma, s)) @ (w * s).T
    np.testing.assert_allclose(folded, (normed * gamma) @ w.T, rtol=1e-4, atol=1e-4)


def test_folding_into_a_previous_linear_preserves_the_output():
    rng = np.random.default_rng(fresh_seed())
    z = rng.standard_normal((16, 96)).astype(np.float32)
    w_prev, b_prev = rng.standard_normal((128, 96)).astype(np.float32), rng.standard_normal(128).astype(np.float32)
    w = rng.standard_normal((32, 128)).astype(np.float32)
    s = jnp.asarray(rng.uniform(0.05, 20.0, 128), jnp.float32)
    hidden = z @ fold_into_previous_linear(w_prev, s).T + fold_scales_into_norm(b_prev, s)
    np.testing.assert_allclose(hidden @ (w * s).T, (z @ w_prev.T + b_prev) @ w.T, rtol=1e-4, atol=1e-3)


def test_bad_shapes_are_refused():
    qdq = int_qdq(4, 32)
    with pytest.raises(ValueError, match="positive divisor of K"):
        awq(jnp.ones((4, 96)), jnp.ones((8, 96)), qdq, group_size=64)
    with pytest.raises(ValueError, match=r"2-D \[N, K\]"):
        awq(jnp.ones((4, 2, 64)), jnp.ones((8, 64)), qdq, group_size=32)
    with pytest.raises(ValueError, match="must have K = 64"):
        awq(jnp.ones((4, 64)), jnp.ones((8, 32)), qdq, group_size=32)
    with pytest.raises(ValueError, match=r"\[K, K_in\] with K = 8"):
        fold_into_previous_linear(jnp.ones((4, 8)), jnp.ones(8))


def test_scale_search_loss_on_sampled_tokens_keeps_the_full_statistic():
    from jquant.algorithms.awq_core import scale_search
    x, w = salient_problem(fresh_seed(), t=1024)
    qdq = int_qdq()
    scales, _, losses = scale_search(w, x, qdq, n_loss_tokens=256)
    candidates = grid_scales(activation_mean(x), 20)            # x_mean from all 1024 tokens
    xs = x[::4]
    want = [np.mean((xs @ w.T - xs @ (np.asarray(qdq(w * s)) / np.asarray(s)).T) ** 2) for s in candidates]
    np.testing.assert_allclose(np.asarray(losses), want, rtol=2e-4)
    # The chosen candidate is the reference's best up to that tolerance (two candidates closer than it
    # may swap places), and the scales returned are that candidate's.
    best = int(np.argmin(np.asarray(losses)))
    assert want[best] <= min(want) * (1 + 2e-4)
    chex.assert_trees_all_equal(scales, candidates[best])
