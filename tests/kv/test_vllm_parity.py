"""Parity with vLLM's KV cache numerics: numpy / pure-Python transcriptions of what vLLM computes
(turboquant/centroids.py solve_lloyd_max, config.py get_boundary_skip_layers, the Triton stores
_reshape_cache_per_token_head and _store_quantized_value) against jquant's references."""

import math

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jquant.kv import allocate, default_skip_layers, insert_reference, lloyd_max, turboquant


def _vllm_lloyd_max(d, bits):
    """solve_lloyd_max(d, bits): trapezoid (200 intervals) Lloyd iterations on N(0, 1/d), float32."""
    n, var = 2**bits, 1.0 / d
    sigma = math.sqrt(var)

    def pdf(x):
        return (1.0 / math.sqrt(2 * math.pi * var)) * math.exp(-x * x / (2 * var))

    def trapz(f, a, b, m=200):
        h = (b - a) / m
        total = 0.5 * (f(a) + f(b))
        for i in range(1, m):
            total += f(a + i * h)
        return total * h

    lo, hi = -3.5 * sigma, 3.5 * sigma
    c = [lo + (hi - lo) * (i + 0.5) / n for i in range(n)]
    for _ in range(200):
        edges = [lo * 3] + [(c[i] + c[i + 1]) / 2.0 for i in range(n - 1)] + [hi * 3]
        new = []
        for i in range(n):
            num = trapz(lambda x: x * pdf(x), edges[i], edges[i + 1])
            den = trapz(pdf, edges[i], edges[i + 1])
            new.append(num / den if den > 1e-15 else c[i])
        if max(abs(a - b) for a, b in zip(new, c)) < 1e-10:
            break
        c = new
    return np.asarray(c, np.float32)


@pytest.mark.parametrize("d,bits", [(64, 3), (128, 4)])
def test_centroids_are_vllms_table_bit_for_bit(d, bits):
    want = _vllm_lloyd_max(d, bits)
    got = lloyd_max.centroids(d, bits)
    np.testing.assert_array_equal(got.view(np.int32), want.view(np.int32))
    # vLLM's 4-bit table is not the exact optimum (200 iterations do not converge): ~1e-4 off.
    exact = np.asarray(lloyd_max.unit_centroids(bits)) / math.sqrt(d)
    assert np.abs(want / exact - 1).max() > 1e-4


def test_key_indices_use_vllms_midpoints():
    """A coordinate between vLLM's and the exact 4-bit boundary lands in vLLM's cell."""
    d, bits = 128, 4
    c = _vllm_lloyd_max(d, bits)
    mid = (c[:-1] + c[1:]) / np.float32(2)
    exact = np.asarray(lloyd_max.unit_centroids(bits)) / math.sqrt(d)
    j = int(np.argmax(np.abs(mid - (exact[:-1] + exact[1:]) / 2)))
    y = np.zeros(d, np.float32)
    y[0] = np.float32((mid[j] + (exact[j] + exact[j + 1]) / 2) / 2)   # between the two boundaries
    y[1] = np.sqrt(1 - y[0] ** 2)
    k = (y @ turboquant.rotation(d)).astype(np.float32)   # rotates back to y (H is its own inverse)
    packed, _ = turboquant.quantize_keys(jnp.asarray(k[None]), bits)
    idx = np.asarray(turboquant.unpack(packed, bits))[0, 0]
    assert idx == int(np.sum(y[0] >= mid))


def _vllm_boundary_skip_layers(num_layers, n=2):
    if n <= 0 or num_layers <= 0:
        return ()
    n = min(n, num_layers // 2)
    return tuple(sorted(set(range(n)) | set(range(num_layers - n, num_layers))))


@pytest.mark.parametrize("num_layers", range(1, 9))
def test_boundary_skip_layers(num_layers):
    got = default_skip_layers("turboquant_k3v4_nc", num_layers)
    assert got == _vllm_boundary_skip_layers(num_layers)


def _vllm_scale(x, fmt):
    qmax = 127.0 if fmt == "int8" else 448.0
    return np.maximum(np.abs(x).max(-1) / np.float32(qmax), np.float32(1e-6)).astype(np.float32)


def _vllm_codes(x, s, fmt):
    """_reshape_cache_per_token_head's codes of [..., D] rows x at their scales s [...]."""
    qmax, qmin = (127.0, -128.0) if fmt == "int8" else (448.0, -448.0)
    y = x.astype(np.float32) / s[..., None]
    if fmt == "int8":   # +-0.5, clamp, then the int8 store truncates toward zero
        y = np.clip(np.where(y >= 0, y + np.float32(0.5), y - np.float32(0.5)), qmin, qmax)
        return np.trunc(y).astype(np.int8)
    return np.clip(y, qmin, qmax).astype(ml_dtypes.float8_e4m3fn)


@pytest.mark.parametrize("name,fmt", [("int8_per_token_head", "int8"), ("fp8_per_token_head", "fp8")])
def test_per_token_head_codes_and_scales(name, fmt):
    d = 16
    rows = [np.arange(-7.5, 8.5, 1.0),                      # halves: int8 ties round away from zero
            np.r_[127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5, np.zeros(8)],
            np.zeros(d),                                     # no signal: scale 1e-6, codes 0
            np.r_[1e-3, np.linspace(-9e-4, 9e-4, d - 1)],    # tiny amax: vLLM's floor is 1e-6
            np.r_[2e-7, np.zeros(d - 1)]]
    rng = np.random.default_rng(0)
    x = np.concatenate([np.asarray(rows, np.float32), rng.normal(size=(11, d)).astype(np.float32) * 3])
    x = x.reshape(8, 2, d)   # [tokens, kv heads, D]
    cache = allocate(name, num_pages=2, page_size=4, kv_heads=2, head_dim=d)
    cache = insert_reference(cache, jnp.asarray(x), jnp.asarray(x), jnp.arange(8))
    got_s = np.asarray(cache.k_scale).reshape(8, 2)
    want_s = _vllm_scale(x, fmt)
    # vLLM's Triton `/` is div.full.f32 (within 2 ulp), jquant's amax / c is amax * (1 / c): the
    # scales agree to an ulp or two, exactly at the 1e-6 floor (rows 2 and 4).
    np.testing.assert_allclose(got_s, want_s, rtol=2.5e-7, atol=0)
    np.testing.assert_array_equal(got_s.ravel()[[2, 4]], np.float32(1e-6))
    got_codes = np.asarray(cache.k_pages).reshape(8, 2, d)
    np.testing.assert_array_equal(got_codes.view(np.uint8), _vllm_codes(x, got_s, fmt).view(np.uint8))


def _vllm_uniform_values(v, bits):
    """_store_quantized_value: packed bytes, fp16 scale, fp16 min of each [D] row."""
    v = v.astype(np.float32)
    levels = np.float32(2**bits - 1)
    lo, hi = v.min(-1), v.max(-1)
    s = (hi - lo) / levels
    s = np.where(s > np.float32(1e-8), s, np.float32(1e-8)).astype(np.float32)
    q = np.clip(np.trunc((v - lo[..., None]) / s[..., None] + np.float32(0.5)), 0, levels).astype(np.uint32)
    if bits == 4:   # low nibble first
        packed = q[..., 0::2] | (q[..., 1::2] << 4)
    else:           # 8 codes per 24 bits, code j at bit 3j, little-endian bytes
        w = np.sum(q.reshape(*q.shape[:-1], -1, 8) << (3 * np.arange(8, dtype=np.uint32)), axis=-1)
        packed = np.stack([(w >> sh) & 0xFF for sh in (0, 8, 16)], -1).reshape(*q.shape[:-1], -1)
    return packed.astype(np.uint8), s.astype(np.float16), lo.astype(np.float16)


@pytest.mark.parametrize("bits", [3, 4])
def test_turboquant_values(bits):
    rng = np.random.default_rng(bits)
    v = np.concatenate([rng.normal(size=(6, 64)), np.full((1, 64), 0.25), np.zeros((1, 64))]).astype(np.float32)
    got = turboquant.quantize_values(jnp.asarray(v), bits)
    for g, w in zip(got, _vllm_uniform_values(v, bits)):
        np.testing.assert_array_equal(np.asarray(g).view(np.uint8), w.view(np.uint8))
