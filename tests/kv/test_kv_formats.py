import functools

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jquant.kv import (allocate, append_reference, attention_reference,
                       calibrate_kv_scales, insert_reference, kv_cache_spec, validate_append)
from jquant.kv import lloyd_max, scalar, turboquant

ALL = ["bf16", "fp8_e4m3", "fp8_e5m2", "int8_per_token_head", "fp8_per_token_head",
       "turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc"]


def test_names_and_unknown():
    assert kv_cache_spec("auto") == kv_cache_spec("bf16") == kv_cache_spec("bfloat16")
    assert kv_cache_spec("fp8") == kv_cache_spec("fp8_e4m3")
    with pytest.raises(ValueError, match="turboquant_3bit_nc"):
        kv_cache_spec("fp4")


def test_bytes_per_token_head():
    bf16 = kv_cache_spec("bf16").bytes_per_token_per_head(128)
    assert bf16 == 512
    got = {n: kv_cache_spec(n).bytes_per_token_per_head(128) for n in ALL[5:]}
    assert got == {"turboquant_k8v4": 196, "turboquant_4bit_nc": 134,
                   "turboquant_k3v4_nc": 118, "turboquant_3bit_nc": 102}
    assert abs(bf16 / got["turboquant_3bit_nc"] - 4.9) / 4.9 < 0.05
    assert abs(bf16 / got["turboquant_k8v4"] - 2.6) < 0.05
    assert kv_cache_spec("fp8_per_token_head").bytes_per_token_per_head(128) == 264


@pytest.mark.parametrize("bits,want", [(2, 0.1175), (3, 0.0346), (4, 0.0095)])
def test_lloyd_max_distortion(bits, want):
    assert abs(lloyd_max.unit_distortion(bits) - want) / want < 0.05
    # Monte Carlo through the real key path (no norm correction), d=128, fixed seed.
    if bits in (3, 4):
        x = jax.random.normal(jax.random.PRNGKey(bits), (4096, 128))
        x = x / jnp.linalg.norm(x, axis=-1, keepdims=True)
        pk, n = turboquant.quantize_keys(x, bits)
        xh = turboquant.dequantize_keys(pk, n, bits, 128, False)
        mse = float(jnp.mean(jnp.sum((x - xh) ** 2, -1)))
        assert abs(mse - want) / want < 0.05


def test_lloyd_max_centroids_3bit():
    c = np.asarray(lloyd_max.unit_centroids(3))
    np.testing.assert_allclose(c[4:], [0.2451, 0.7560, 1.3439, 2.1519], atol=1e-4)
    np.testing.assert_allclose(c[:4], -c[4:][::-1], atol=1e-9)


def test_packing_bit_layout():
    q = jnp.arange(16) % 16
    p4 = np.asarray(turboquant.pack(q[None], 4))[0]
    assert p4[0] == 0x10 and p4[1] == 0x32  # low nibble first
    q3 = jnp.asarray([1, 2, 3, 4, 5, 6, 7, 0])
    w = sum(int(v) << (3 * j) for j, v in enumerate(q3))
    assert list(np.asarray(turboquant.pack(q3[None], 3))[0]) == [w & 255, (w >> 8) & 255, w >> 16]
    r = jax.random.randint(jax.random.PRNGKey(0), (5, 64), 0, 8)
    for b in (3, 4):
        np.testing.assert_array_equal(turboquant.unpack(turboquant.pack(r, b), b), r)


def test_hadamard_head_dim():
    with pytest.raises(ValueError, match="power-of-two"):
        allocate("turboquant_3bit_nc", 4, 16, 2, 96)
    r = turboquant.rotation(64)
    np.testing.assert_allclose(r @ r, np.eye(64), atol=1e-5)


@pytest.mark.parametrize("fmt,dt", [("fp8_e4m3", ml_dtypes.float8_e4m3fn),
                                    ("fp8_e5m2", ml_dtypes.float8_e5m2)])
def test_fp8_rounding_exact(fmt, dt):
    x = np.concatenate([np.random.default_rng(1).normal(size=4096).astype(np.float32) * 30,
                        [0.0, -0.0, 1e-9, 2.0**-9, 448.0, 1e6, -1e6, np.inf]]).astype(np.float32)
    got = np.asarray(scalar.encode(jnp.asarray(x), 1.0, fmt)).view(np.uint8)
    m = scalar.fmt_max(fmt)
    want = np.clip(x, -m, m).astype(dt).view(np.uint8)
    np.testing.assert_array_equal(got, want)


def test_calibration_vllm_constants():
    k = jnp.asarray([[1.0, -400.0]])
    v = jnp.asarray([[50.0, 0.0]])
    ks, vs = calibrate_kv_scales(k, v)
    assert float(ks) == 2.0 and float(vs) == 0.5
    assert float(calibrate_kv_scales(jnp.zeros(3), jnp.zeros(3))[0]) == 1.0
    # A NaN anywhere gives 1.0 too, in a tensor large enough that XLA's CPU max drops NaN.
    poisoned = jnp.ones((4, 8192)).at[2, 5000].set(jnp.nan)
    assert float(calibrate_kv_scales(poisoned, poisoned)[0]) == 1.0


def _fill(name, page_size, lengths, kv_heads=2, d=64, seed=0):
    rng = np.random.default_rng(seed)
    b = len(lengths)
    max_pages = max(1, -(-max(lengths) // page_size))
    num_pages = b * max_pages + 3
    bt = rng.permutation(num_pages)[: b * max_pages].reshape(b, max_pages).astype(np.int32)
    L = max_pages * page_size
    k = rng.normal(size=(b, L, kv_heads, d)).astype(np.float32)
    v = rng.normal(size=(b, L, kv_heads, d)).astype(np.float32)
    cache = allocate(name, num_pages, page_size, kv_heads, d, k_scale=0.02, v_scale=0.04)
    ln = np.zeros(b, np.int32)
    for t in range(max(lengths)):
        live = ln < np.asarray(lengths)
        kk = np.where(live[:, None, None], k[:, t], 0)
        cache2, ln2 = append_reference(cache, jnp.asarray(kk), jnp.asarray(v[:, t]), bt, ln)
        # only live sequences advance: re-insert with padding slots for the finished ones
        from jquant.kv.paged import slots_for
        slots = np.where(live, np.asarray(slots_for(jnp.asarray(bt), jnp.arange(b), jnp.asarray(ln),
                                                    page_size)), -1)
        cache = insert_reference(cache, jnp.asarray(k[:, t]), jnp.asarray(v[:, t]), slots)
        ln = ln + live
    return cache, bt, ln, k, v


def _dense(q, k, v, lengths, hk):
    b, hq, d = q.shape
    out = np.zeros((b, hq, d))
    for i in range(b):
        n = lengths[i]
        if n == 0:
            continue
        for h in range(hq):
            kk, vv = k[i, :n, h // (hq // hk)], v[i, :n, h // (hq // hk)]
            s = kk @ q[i, h] / np.sqrt(d)
            w = np.exp(s - s.max())
            out[i, h] = (w / w.sum()) @ vv
    return out


TOL = {"bf16": 0.02, "fp8_e4m3": 0.08, "fp8_e5m2": 0.15, "int8_per_token_head": 0.02,
       "fp8_per_token_head": 0.08, "turboquant_k8v4": 0.15, "turboquant_4bit_nc": 0.2,
       "turboquant_k3v4_nc": 0.3, "turboquant_3bit_nc": 0.4}


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("page_size", [8, 16])
def test_attention_vs_dense(name, page_size):
    lengths = [0, 1, page_size, 2 * page_size + 3, 3 * page_size]
    cache, bt, ln, k, v = _fill(name, page_size, lengths)
    q = np.random.default_rng(5).normal(size=(len(lengths), 4, 64)).astype(np.float32)
    got = np.asarray(attention_reference(jnp.asarray(q), cache, bt, ln))
    want = _dense(q, k, v, lengths, 2)
    assert not np.isnan(got).any()
    np.testing.assert_array_equal(got[0], 0.0)
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err < TOL[name], err


def test_bad_tables_raise_before_write():
    with pytest.raises(ValueError, match="past its"):
        validate_append(np.zeros((1, 2), np.int32), np.asarray([32]), 1, 4, 16)
    with pytest.raises(ValueError, match="outside the pool"):
        validate_append(np.asarray([[0, 9]]), np.asarray([20]), 1, 4, 16)
    with pytest.raises(ValueError, match="owned by"):
        validate_append(np.asarray([[0], [0]]), np.asarray([1, 1]), 1, 4, 16)
    cache = allocate("int8_per_token_head", 2, 4, 1, 8)
    with pytest.raises(ValueError):
        append_reference(cache, jnp.ones((1, 1, 8)), jnp.ones((1, 1, 8)), np.asarray([[5]]), [0])
    # Three tokens for two sequences: the message was XLA's broadcasting error.
    with pytest.raises(ValueError, match="must agree on B"):
        append_reference(cache, jnp.ones((3, 1, 8)), jnp.ones((3, 1, 8)), np.asarray([[0], [1]]), [0, 0])


def test_jit_append_at_a_full_or_negative_length_writes_nothing():
    """Under jit nothing can raise: a full sequence's next slot (clamped) and a negative length's (wrapped)
    are its own stored tokens, so neither is written."""
    cache = allocate("int8_per_token_head", 2, 4, 1, 8)
    full = jnp.arange(4 * 8, dtype=jnp.float32).reshape(4, 1, 8) + 1.0
    cache = insert_reference(cache, full, full, jnp.arange(4))   # sequence 0 owns page 0, now full
    append = jax.jit(functools.partial(append_reference, validate=False))
    for length in (4, -1):
        new = jnp.full((1, 1, 8), -7.0)
        out, _ = append(cache, new, new, jnp.asarray([[0]], jnp.int32), jnp.asarray([length], jnp.int32))
        chex.assert_trees_all_equal(out, cache)


def test_head_dims_the_decode_kernel_cannot_tile_are_refused_at_allocation():
    from jquant.kv import PagedCache

    for name in ("bf16", "fp8", "int8_per_token_head"):
        with pytest.raises(ValueError, match="head_dim must be a multiple of 16 for a model's paged cache, got 24"):
            PagedCache.allocate(name, num_layers=1, batch=1, max_len=8, kv_heads=1, head_dim=24)


def test_per_tensor_scales_must_be_positive_and_finite():
    for bad in (0.0, float("nan"), float("inf"), -1.0):
        with pytest.raises(ValueError, match="k_scale must be one positive finite float"):
            allocate("fp8", 2, 4, 1, 16, k_scale=bad)
    with pytest.raises(ValueError, match="v_scale must be one positive finite float"):
        allocate("fp8_e5m2", 2, 4, 1, 16, v_scale=0.0)


def test_jit_out_of_range_slot_dropped_and_nan_is_loud():
    cache = allocate("fp8_per_token_head", 2, 4, 1, 8)
    new = jnp.ones((2, 1, 8))
    out = jax.jit(insert_reference)(cache, new, new, jnp.asarray([100, -1]))
    np.testing.assert_array_equal(np.asarray(out.k_pages.astype(jnp.float32)), 0.0)
    for name in ("int8_per_token_head", "turboquant_3bit_nc", "fp8_e4m3"):
        cache = allocate(name, 4, 4, 1, 8)
        bad = jnp.ones((2, 1, 8)).at[0, 0, 3].set(jnp.nan)
        cache = insert_reference(cache, bad, bad, jnp.asarray([0, 4]))
        o = np.asarray(attention_reference(jnp.ones((2, 1, 8)), cache, np.asarray([[0], [1]]),
                                           np.asarray([1, 1])))
        assert np.isnan(o[0]).any() and np.isfinite(o[1]).all(), name


@pytest.mark.parametrize("name", ["turboquant_3bit_nc", "turboquant_4bit_nc", "fp8_per_token_head"])
def test_the_insert_has_no_while_loop(name):
    """The decode step inserts every layer's new token: a while loop there (the default
    ``jnp.searchsorted`` over the Lloyd-Max boundaries is one) costs GPU launches per layer."""
    layer = allocate(name, 4, 16, 2, 64)
    kv = jnp.ones((3, 2, 64), jnp.float32)
    text = jax.jit(insert_reference).lower(layer, kv, kv, jnp.arange(3, dtype=jnp.int32)).as_text()
    assert "stablehlo.while" not in text
