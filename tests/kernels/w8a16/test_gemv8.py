"""The 8-bit GEMV (Triton-backend Pallas, ``impl="triton"``) on W8A16 weights: interpret mode against
an independent float64 dequantization at every M it takes, its lowering to Triton IR for sm_90 on CPU
at every swept launch, adversarial values, bad input. JQUANT_TEST_GPU=1 runs the same tests on the GPU."""

import hypothesis.strategies as st
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings

import jquant
from conftest import ON_GPU
from cuda_lowering import triton_modules
from jquant.kernels.gemv8 import GemvConfig
from jquant.kernels.gemv8.config import MAX_ROWS
from jquant.kernels.gemv8.triton import gemv8
from jquant.kernels.w4a16.config import MgpuConfig
from jquant.kernels.w8a16 import pack_w8_qtensor, prepack_w8, reference_w8, w8a16_matmul
from jquant.kernels.w8a16.api import gemv_w8
from jquant.kernels.w8a16.bench import GEMV_SWEEP
from test_w8a16 import IDS, LAYOUTS, WEIGHTS, _check, _float64_weight, _x, random_layout


def _gemv(x, w, interpret, **kw):
    return w8a16_matmul(x, w, impl="triton", interpret=interpret, **kw)


@pytest.mark.parametrize("fmt,options", WEIGHTS, ids=IDS)
@pytest.mark.parametrize("m", range(1, MAX_ROWS + 1))
def test_gemv_matches_float64(fmt, options, m, interpret):
    rng = np.random.default_rng()
    w = rng.standard_normal((256, 512)).astype(np.float32) * rng.uniform(0.01, 3, (256, 1)).astype(np.float32)
    qt = jquant.quantize(w, fmt, **options)
    x = _x(rng, m, 512)
    y = _gemv(x, qt, interpret)
    assert y.shape == (m, 256) and y.dtype == jnp.bfloat16
    # Codes, zero points and scales stay in fp32: only the output's bf16 rounding is left.
    assert _check(y, x, _float64_weight(qt)) < 8e-3


@pytest.mark.parametrize("n,k,m,fmt,dtype", [(200, 300, 3, "int8", jnp.float16), (130, 100, 1, "uint8", jnp.float32),
                                             (384, 576, 2, "fp8_e4m3", jnp.bfloat16)])
def test_gemv_ragged_shapes_and_bias(n, k, m, fmt, dtype, interpret):
    """N, K not multiples of the tiles (padded; K = 576 takes 64-code steps), fp16 and fp32 x, a bias."""
    rng = np.random.default_rng()
    qt = jquant.quantize(rng.standard_normal((n, k)).astype(np.float32), fmt)
    x, bias = _x(rng, m, k, dtype), jnp.asarray(rng.standard_normal(n), jnp.float32)
    y = _gemv(x, qt, interpret, bias=bias)
    assert y.shape == (m, n) and y.dtype == dtype
    _check(y, x, _float64_weight(qt), bias)


@pytest.mark.parametrize("kind", ["int8", "uint8", "e4m3"])   # each kind drawn for sure
@settings(max_examples=8)
@given(m=st.integers(1, MAX_ROWS), **{name: v for name, v in LAYOUTS.items() if name != "kind"})
def test_gemv_random_layouts_match_float64(kind, m, k, n, group, seed):
    """Random K, N (1-300, 1-150: padded), codes, groups (16 to per channel) and zero points: fp32 x
    against the hand-built float64 weight, within fp32 summation error."""
    packed, w = random_layout(k, n, kind, group, seed)
    x = np.random.default_rng(seed).standard_normal((m, k)).astype(np.float32)
    y = np.asarray(w8a16_matmul(jnp.asarray(x), packed, impl="triton", interpret=not ON_GPU), np.float64)
    ref = x.astype(np.float64) @ w
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5 * max(np.abs(ref).max(), 1.0))


def test_gemv_adversarial_values(interpret):
    """A zero channel scale gives exact zeros; a zero row of x exact zeros; a NaN in one row of x poisons
    that row only; a NaN code its column only; ±448 codes × 2^115 overflow to ±Inf as the reference."""
    rng = np.random.default_rng()
    q = rng.integers(-127, 128, (128, 256)).astype(np.int8)
    cs = rng.uniform(0.5, 1, 256).astype(np.float32)
    cs[[0, 77]] = 0
    x = _x(rng, 4, 128).at[3].set(0).at[1, 17].set(jnp.nan)
    y = np.asarray(_gemv(x, prepack_w8(q, channel_scale=cs), interpret), np.float32)
    assert not y[[0, 2, 3]][:, [0, 77]].any() and not y[3].any()
    assert np.isnan(y[1]).all() and np.isfinite(y[[0, 2, 3]]).all()
    f8 = np.ones((128, 128), ml_dtypes.float8_e4m3fn)
    f8[5, 9] = np.nan
    y = np.asarray(_gemv(jnp.ones((1, 128), jnp.bfloat16), prepack_w8(f8, channel_scale=np.ones(128, np.float32)),
                         interpret), np.float32)
    assert np.isnan(y[0, 9]) and np.isfinite(np.delete(y[0], 9)).all()
    f8 = np.full((128, 128), 448, ml_dtypes.float8_e4m3fn)
    f8[:, 1::2] = -448
    big = prepack_w8(f8, global_scale=2.0 ** 115)
    ones = jnp.ones((2, 128), jnp.bfloat16)
    y, ref = (np.asarray(f, np.float32) for f in (_gemv(ones, big, interpret), reference_w8(ones, big)))
    assert np.isinf(y).all() and (np.sign(y) == np.sign(ref)).all() and np.isinf(ref).all()


def test_gemv_matches_the_mosaic_kernel_layout_for_every_swept_launch(interpret):
    """Every swept launch (and the default) gives the same sums on one weight: the launch changes the
    order of fp32 additions only."""
    rng = np.random.default_rng()
    qt = jquant.quantize(rng.standard_normal((256, 2048)).astype(np.float32), "int8", group_size=128)
    x = _x(rng, 2, 2048)
    w64 = _float64_weight(qt)
    for cfg in (None,) + GEMV_SWEEP:
        _check(_gemv(x, qt, interpret, config=cfg), x, w64)


@pytest.mark.skipif(ON_GPU, reason="the GPU run compiles for real")
@pytest.mark.parametrize("fmt,options", [WEIGHTS[0], WEIGHTS[2], WEIGHTS[3], WEIGHTS[7]],
                         ids=[IDS[0], IDS[2], IDS[3], IDS[7]])
def test_gemv_lowers_to_triton_for_every_launch(fmt, options):
    """Every swept launch and the defaults lower to Triton IR at 1 and MAX_ROWS rows: an unsupported
    op, cast or block shape fails here, without a GPU."""
    rng = np.random.default_rng(0)
    packed = pack_w8_qtensor(jquant.quantize(rng.standard_normal((512, 1024)).astype(np.float32), fmt, **options))
    for cfg in GEMV_SWEEP:
        for m in (1, MAX_ROWS):
            texts = triton_modules(lambda x, p, cfg=cfg: gemv_w8(x, p, config=cfg),
                                   jnp.ones((m, 1024), jnp.bfloat16), packed)
            assert len(texts) == 1 and "tt.load" in texts[0], (cfg, m)
            assert texts[0].count("tt.store") == m, (cfg, m)   # one store a row of x


def test_gemv_bad_input_names_the_problem():
    packed = prepack_w8(np.ones((64, 128), np.int8), channel_scale=np.ones(128, np.float32))
    with pytest.raises(ValueError, match="1 to 4 rows"):
        _gemv(jnp.ones((5, 64), jnp.bfloat16), packed, True)
    with pytest.raises(TypeError, match="GemvConfig"):
        _gemv(jnp.ones((1, 64), jnp.bfloat16), packed, True, config=MgpuConfig())
    with pytest.raises(TypeError, match="MgpuConfig"):
        w8a16_matmul(jnp.ones((1, 64), jnp.bfloat16), packed, impl="mgpu", interpret=True, config=GemvConfig())
    with pytest.raises(ValueError, match="block_n=256 must divide"):
        _gemv(jnp.ones((1, 64), jnp.bfloat16), packed, True, config=GemvConfig(block_n=256))
    with pytest.raises(ValueError, match="power of 2"):
        GemvConfig(block_k=96)
    with pytest.raises(ValueError, match=r"x must be \[M, K_pad\], got shape \(64,\)"):
        gemv8(jnp.ones((64,), jnp.bfloat16), jnp.ones((128, 64), jnp.int8), interpret=True)
    with pytest.raises(ValueError, match="int8 or float8_e4m3fn"):
        gemv8(jnp.ones((1, 64), jnp.bfloat16), jnp.ones((128, 64), jnp.uint8), interpret=True)


def test_gemv_widens_every_int8_code_exactly(interpret):
    """Each weight row holds one int8 code 64 times (all 256 codes over 256 rows) and x is 1 and -2 by
    turns: every partial sum is an integer below 2^24, so the output is exactly -32 times the code."""
    codes = np.repeat(np.arange(-128, 128, dtype=np.int32)[:, None], 64, axis=1).astype(np.int8)  # [N, K]
    x = jnp.asarray(np.tile([1.0, -2.0], 32), jnp.float32)[None]
    y = gemv8(x, jnp.asarray(codes), interpret=interpret)
    np.testing.assert_array_equal(np.asarray(y[0]), -32.0 * np.arange(-128, 128))
