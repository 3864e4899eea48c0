"""GPTQ: error vs RTN, agreement with a float64 transcription of the reference loop, exact
QTensor and checkpoint export / load, dead inputs, block and damping edge cases, streaming Hessians."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jquant.algorithms.gptq import Hessian, accumulate_hessian, gptq_quantize_kernel, gptq_quantize_weight, to_qtensor
from jquant.algorithms.gptq_core import gptq_quantize, hessian_update
from jquant.checkpoint import from_checkpoint, to_checkpoint
from jquant.formats.integer import quantize_int
from jquant.schemes.scheme import get_scheme
from jquant.schemes.spec import WeightSpec

F16 = jnp.float16


def _problem(seed, n=64, k=256, tokens=1024):
    """Correlated inputs ``Z @ A`` with a few outlier channels, and a weight ``[N, K]``."""
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((k, k)) / np.sqrt(k) + np.eye(k)
    x = rng.standard_normal((tokens, k)) @ a
    x[:, rng.choice(k, 4, replace=False)] *= 8.0
    w = rng.standard_normal((n, k)) * 0.05
    return x.astype(np.float32), w.astype(np.float32)


def _hessian(x):
    h, _ = hessian_update(jnp.zeros((x.shape[-1],) * 2, jnp.float32), jnp.int32(0), x)
    return h


def _output_error(x, w, q):
    return float(np.sum((x.astype(np.float64) @ (w - np.asarray(q, np.float64)).T) ** 2))


def _reference(w, h, *, bits, group_size, symmetric, act_order=False, static_groups=False, block_size=128,
               damp_percent=0.01):
    """The GPTQ loop written plainly in float64 (scales rounded to float16 as the core does)."""
    w, h = w.astype(np.float64), h.astype(np.float64)
    n, k = w.shape
    maxq = 2 ** bits - 1

    def find(x):
        lo, hi = np.minimum(x.min(1), 0), np.maximum(x.max(1), 0)
        if symmetric:
            hi = np.maximum(-lo, hi)
            lo = np.where(lo < 0, -hi, lo)
        empty = (lo == 0) & (hi == 0)
        lo, hi = np.where(empty, -1, lo), np.where(empty, 1, hi)
        s = ((hi - lo) / maxq).astype(np.float16).astype(np.float64)
        return s, np.full_like(s, (maxq + 1) / 2) if symmetric else np.clip(np.round(-lo / s), 0, maxq)

    s, z = find(w)
    dead = np.diag(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    static = [find(w[:, i:i + group_size]) for i in range(0, k, group_size)] if static_groups else None
    perm = np.argsort(-np.diag(h), kind="stable") if act_order else np.arange(k)
    w, h = w[:, perm], h[np.ix_(perm, perm)]
    h[np.diag_indices(k)] += damp_percent * np.mean(np.diag(h))
    u = np.linalg.cholesky(np.linalg.inv(h)).T
    q = np.zeros_like(w)
    for i1 in range(0, k, block_size):
        i2 = min(i1 + block_size, k)
        w1, err = w[:, i1:i2].copy(), np.zeros((n, i2 - i1))
        for i in range(i2 - i1):
            c = i1 + i
            if static_groups:
                s, z = static[perm[c] // group_size]
            elif group_size is not None and c % group_size == 0:
                s, z = find(w[:, c:c + group_size])  # w, not w1: the block's own updates are not in yet
            q[:, c] = s * (np.clip(np.round(w1[:, i] / s) + z, 0, maxq) - z)
            err[:, i] = (w1[:, i] - q[:, c]) / u[c, c]
            w1[:, i:] -= np.outer(err[:, i], u[c, c:i2])
        w[:, i2:] -= err @ u[i1:i2, i2:]
    return q[:, np.argsort(perm)]


# (group_size, symmetric, act_order, static_groups): per-channel, g128, g32, both symmetries, act-order, static.
CONFIGS = [(None, True, False, False), (None, False, True, False), (128, True, False, False),
           (128, False, True, False), (32, True, True, False), (32, False, False, False),
           (32, True, True, True), (32, False, True, True)]


@pytest.mark.parametrize("seed,config", list(enumerate(CONFIGS)))
def test_gptq_beats_rtn_and_matches_reference(seed, config):
    group_size, symmetric, act_order, static_groups = config
    x, w = _problem(seed)
    h = _hessian(x)
    opts = dict(bits=4, group_size=group_size, symmetric=symmetric, scale_dtype=F16)
    got = gptq_quantize(w, h, act_order=act_order, static_groups=static_groups, **opts)
    # An identity Hessian propagates no error: RTN on the same grid.
    rtn = gptq_quantize(w, np.eye(w.shape[1], dtype=np.float32), **opts)
    ratio = _output_error(x, w, got.weight) / _output_error(x, w, rtn.weight)
    assert ratio < 0.8, f"GPTQ / RTN output error {ratio:.3f}"
    want = _reference(w, np.asarray(h), group_size=group_size, symmetric=symmetric, act_order=act_order,
                      static_groups=static_groups, bits=4)
    # float32 vs float64 arithmetic may flip a rare near-tie rounding; everything else agrees.
    assert np.mean(np.asarray(got.weight) != want.astype(np.float32)) < 0.005
    chex.assert_trees_all_equal(got.loss.shape, (w.shape[1],))
    assert bool(jnp.all(jnp.isfinite(got.loss)))


@pytest.mark.parametrize("group_size,symmetric", [(None, True), (128, False), (32, True)])
def test_identity_hessian_is_round_to_nearest(group_size, symmetric):
    _, w = _problem(10)
    got = gptq_quantize(w, np.eye(w.shape[1], dtype=np.float32), bits=4, group_size=group_size,
                        symmetric=symmetric, scale_dtype=F16)
    rtn = jax.jit(lambda v: quantize_int(v, bits=4, symmetric=symmetric, axis=1, group_size=group_size,
                                         scale_dtype=F16, symmetric_range="full" if symmetric else None))(w)
    chex.assert_trees_all_equal(got.weight, rtn.dequantize())


@pytest.mark.parametrize("name,act_order", [("int4_g128", True), ("int4_g128_asym", True), ("int4_g32", False),
                                            ("int8_ch", True)])
def test_qtensor_is_the_scheme_format_and_dequantizes_to_the_loop(name, act_order):
    x, w = _problem(20)
    scheme = get_scheme(name)
    h = Hessian.zeros(w.shape[1]).update(x)
    spec = scheme.weight
    result = gptq_quantize(w, h.h, bits=spec.bits, group_size=spec.group_size, symmetric=spec.symmetric,
                           act_order=act_order, scale_dtype=spec.scale_dtype or jnp.float32)
    qt = gptq_quantize_weight(w, h, scheme=name, act_order=act_order)
    chex.assert_trees_all_equal(qt, to_qtensor(result, spec))
    chex.assert_trees_all_equal(qt.dequantize(), result.weight)
    rtn = scheme.quantize_weight(jnp.asarray(w))
    assert (qt.fmt, qt.block, qt.pack_axis, qt.k_axis, qt.scale.dtype) == \
        (rtn.fmt, rtn.block, rtn.pack_axis, rtn.k_axis, rtn.scale.dtype)
    assert (qt.group_index is not None) == (act_order and spec.group_size is not None)
    y = scheme.apply(jnp.asarray(x[:8]), scheme.process_weights_after_loading(qt))
    chex.assert_trees_all_close(y, x[:8] @ np.asarray(result.weight).T, rtol=1e-4, atol=1e-4)
    # The kernel entry point ([K, N]) with a list of batches: the QTensor of gptq_quantize_weight on those
    # batches' Hessian. Its float32 sum differs from one batch's in the last bits, which can flip a rare
    # rounding (int8_ch: 16 of 16384 codes on an AVX-512 Xeon), as float32 against float64 does above.
    batches = [x[:300], x[300:]]
    qk = gptq_quantize_kernel(w.T, batches, scheme=name, act_order=act_order)
    chex.assert_trees_all_equal(qk, gptq_quantize_weight(w, accumulate_hessian(batches, w.shape[1]), scheme=name,
                                                         act_order=act_order))
    assert np.mean(np.asarray(qk.dequantize()) != np.asarray(result.weight)) < 0.005


@pytest.mark.parametrize("checkpoint_format", ["gptq", "gptq_v2"])
@pytest.mark.parametrize("name,act_order,static_groups", [("int4_g128", True, False), ("int4_g128_asym", True, False),
                                                          ("int4_g32", False, False), ("int4_g32", True, True)])
def test_gptq_checkpoint_round_trip(checkpoint_format, name, act_order, static_groups):
    x, w = _problem(30)
    qt = gptq_quantize_weight(w, x, scheme=name, act_order=act_order, static_groups=static_groups)
    tensors = to_checkpoint(qt, "gptq", checkpoint_format=checkpoint_format)
    group = get_scheme(name).weight.group_size
    trivial = np.arange(w.shape[1]) // group
    assert np.array_equal(tensors["g_idx"], trivial) == (not act_order or static_groups)
    back = from_checkpoint(tensors, "gptq", checkpoint_format=checkpoint_format)
    chex.assert_trees_all_equal(back.dequantize(), qt.dequantize())
    chex.assert_trees_all_equal(back.group_index, qt.group_index)


@pytest.mark.parametrize("group_size", [None, 32])
def test_dead_columns_and_zero_inputs(group_size):
    x, w = _problem(40)
    dead = np.array([0, 5, 77, 200, 255])
    x[:, dead] = 0
    for inputs in (x, np.zeros_like(x)):
        for act_order in (False, True):
            qt = gptq_quantize_weight(w, inputs, scheme=WeightSpec.integer(4, group_size, symmetric=False),
                                      act_order=act_order)
            q = np.asarray(qt.dequantize())
            assert np.all(np.isfinite(q))
            assert np.all(q[:, dead] == 0)
            if not inputs.any():
                assert np.all(q == 0)


@pytest.mark.parametrize("k,group_size,block_size", [(320, 64, 128), (96, 32, 128), (256, 128, 32), (256, None, 48)])
def test_block_edges(k, group_size, block_size):
    """K not a multiple of the block, K below it, groups spanning several blocks."""
    x, w = _problem(50 + k, n=48, k=k)
    h = _hessian(x)
    opts = dict(bits=4, group_size=group_size, symmetric=False)
    got = gptq_quantize(w, h, block_size=block_size, act_order=True, scale_dtype=F16, **opts)
    want = _reference(w, np.asarray(h), act_order=True, block_size=block_size, **opts)
    assert np.mean(np.asarray(got.weight) != want.astype(np.float32)) < 0.005
    rtn = gptq_quantize(w, np.eye(k, dtype=np.float32), scale_dtype=F16, **opts)
    assert _output_error(x, w, got.weight) < 0.8 * _output_error(x, w, rtn.weight)


def test_damping():
    x, w = _problem(60)
    h = _hessian(x)
    opts = dict(bits=4, group_size=32, symmetric=True, scale_dtype=F16)
    rtn = _output_error(x, w, gptq_quantize(w, np.eye(w.shape[1], dtype=np.float32), **opts).weight)
    undamped = gptq_quantize(w, h, damp_percent=0.0, **opts)  # full-rank H needs no damping
    assert np.all(np.isfinite(np.asarray(undamped.weight)))
    assert _output_error(x, w, undamped.weight) < 0.8 * rtn
    # Damping far above H's scale leaves H⁻¹ nearly diagonal: almost RTN.
    heavy = gptq_quantize(w, h, damp_percent=1e5, **opts)
    assert abs(_output_error(x, w, heavy.weight) / rtn - 1) < 0.02
    with pytest.raises(ValueError, match="damp_percent"):
        gptq_quantize(w, h, damp_percent=-0.1, **opts)
    with pytest.raises(ValueError, match="group_size"):
        gptq_quantize(w, h, bits=4, group_size=48)


def test_hessian_streaming_equals_one_batch():
    rng = np.random.default_rng(70)
    x = rng.standard_normal((600, 96)).astype(np.float32) * rng.uniform(0.1, 10, 96).astype(np.float32)
    whole = accumulate_hessian(x, 96)
    assert int(whole.n) == 600
    np.testing.assert_allclose(whole.h, 2 / 600 * x.T.astype(np.float64) @ x, rtol=1e-5, atol=1e-4)
    # Uneven batches, leading batch axes, an empty batch.
    batches = [x[:7].reshape(1, 7, 96), x[7:7], x[7:250], x[250:].reshape(10, 35, 96)]
    streamed = jax.jit(lambda hs, b: hs.update(b))
    acc = Hessian.zeros(96)
    for b in batches:
        acc = streamed(acc, b)
    assert int(acc.n) == 600
    chex.assert_trees_all_close(acc.h, whole.h, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"\[\.\.\., 96\]"):
        acc.update(x[:, :95])


def test_singular_hessian_retries_with_more_dampening_and_bad_inputs_raise():
    rng = np.random.default_rng(11)
    w = jnp.asarray(rng.standard_normal((64, 128)), jnp.float32)
    x = jnp.asarray(np.outer(rng.standard_normal(256), rng.standard_normal(128)), jnp.float32)   # rank 1
    undamped = gptq_quantize(w, accumulate_hessian(x, 128).h, bits=4, group_size=32, damp_percent=0.0)
    assert np.isnan(np.asarray(undamped.weight)).any()      # the core alone fails here
    qt = gptq_quantize_weight(w, x, scheme="int4_g32", damp_percent=0.0)
    assert np.isfinite(np.asarray(qt.dequantize())).all()
    with pytest.raises(ValueError, match="finite"):
        gptq_quantize_weight(w, x.at[3, 5].set(jnp.nan), scheme="int4_g32")
    with pytest.raises(ValueError, match="finite"):
        gptq_quantize_weight(w.at[0, 0].set(jnp.inf), x, scheme="int4_g32")
