"""The W8A16 kernel (the W4A16 kernel's Mosaic GPU pipeline reading 8-bit tiles): interpret mode
(CPU) against an independent float64 dequantization, its lowering for sm_90 on CPU, the layout,
dispatch, the scheme path and bad input. JQUANT_TEST_GPU=1 runs the same tests on the GPU."""

import chex
import hypothesis.strategies as st
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings

import jquant
from conftest import ON_GPU
from cuda_lowering import lower_for_cuda
from jquant.kernels.w4a16.mosaic_gpu import w4a16_mgpu_matmul
from jquant.kernels.w8a16 import (PackedW8NK, default_w8_config, dequantize_w8, pack_w8_qtensor,
                                  prepack_w8, reference_w8, resolve_w8_impl, w8a16_matmul)
from jquant.schemes import dispatch
from jquant.schemes.scheme import candidate_impls

# (format, quantize options): every 8-bit weight the kernel lays out.
WEIGHTS = [("int8", {}), ("int8", dict(group_size=64)), ("int8", dict(group_size=32)),
           ("uint8", dict(group_size=128)), ("uint8", {}),
           ("fp8_e4m3", {}), ("fp8_e4m3", dict(granularity="channel")),
           ("fp8_e4m3", dict(granularity="block", block_size=(128, 128))), ("mxfp8_e4m3", {})]
IDS = [f"{f}-{'-'.join(f'{v}' for v in o.values()) or 'default'}" for f, o in WEIGHTS]


def _float64_weight(qt) -> np.ndarray:
    """The QTensor's ``[N, K]`` weight in float64 from its stored bytes, independently of jquant's
    dequantize: int8 ``(u − 128)·s``, uint8 ``(u − z)·s``, e4m3 ``v·s`` (an E8M0 ``s`` for MXFP8) with
    blocks expanded."""
    n, k = qt.shape
    if qt.fmt in ("fp8_e4m3", "mxfp8_e4m3"):
        v = np.asarray(qt.data).astype(np.float64)
    elif qt.fmt == "int8":
        v = np.asarray(qt.data, np.float64) - 128
    else:
        v = np.asarray(qt.data, np.float64) - np.repeat(np.repeat(np.asarray(qt.zero, np.float64),
                                                                  qt.block[0], 0), qt.block[1], 1)[:n, :k]
    s = np.repeat(np.repeat(np.asarray(qt.scale, np.float64), qt.block[0], 0), qt.block[1], 1)[:n, :k]
    return v * s


def _x(rng, m, k, dtype=jnp.bfloat16):
    return jnp.asarray(rng.standard_normal((m, k)), dtype)


def _check(y, x, w64, bias=None):
    """Within the kernel's rounding: codes × scales rounded once to x's dtype (as XLA's path) and the
    output rounded to x's dtype; relative to the output's scale."""
    ref = np.asarray(x, np.float64) @ w64.T + (0 if bias is None else np.asarray(bias, np.float64))
    err = np.abs(np.asarray(y, np.float64) - ref).max() / max(np.abs(ref).max(), 1e-30)
    assert err < 2e-2, err
    return err


# ---- the kernel, interpret mode (the GPU under JQUANT_TEST_GPU=1) --------------------------------
@pytest.mark.parametrize("fmt,options", WEIGHTS, ids=IDS)
@pytest.mark.parametrize("m", [1, 24])
def test_kernel_matches_float64(fmt, options, m, interpret):
    rng = np.random.default_rng()
    w = rng.standard_normal((256, 512)).astype(np.float32) * rng.uniform(0.01, 3, (256, 1)).astype(np.float32)
    qt = jquant.quantize(w, fmt, **options)
    x = _x(rng, m, 512)
    y = w8a16_matmul(x, qt, impl="pallas" if not interpret else "auto", interpret=interpret)
    assert y.shape == (m, 256) and y.dtype == jnp.bfloat16
    _check(y, x, _float64_weight(qt))


@pytest.mark.parametrize("n,k,m,fmt", [(200, 320, 3, "int8"), (130, 100, 9, "uint8"), (128, 64, 300, "int8")])
def test_kernel_ragged_shapes_and_bias(n, k, m, fmt, interpret):
    """N, K not multiples of the tiles (padded), M past the tile, fp16 x, a bias."""
    rng = np.random.default_rng()
    qt = jquant.quantize(rng.standard_normal((n, k)).astype(np.float32), fmt)
    x, bias = _x(rng, m, k, jnp.float16), jnp.asarray(rng.standard_normal(n), jnp.float32)
    y = w8a16_matmul(x, qt, bias=bias, impl="auto" if interpret else "pallas", interpret=interpret)
    assert y.shape == (m, n) and y.dtype == jnp.float16
    _check(y, x, _float64_weight(qt), bias)


@pytest.mark.parametrize("impl", ["kernel", "triton"])
def test_kernel_act_order_uint8(impl, interpret):
    """GPTQ act order with zero points, on the kernel and on the 8-bit GEMV (``impl="triton"``)."""
    rng = np.random.default_rng()
    k, n, g = 256, 128, 64
    q = rng.integers(0, 256, (k, n)).astype(np.uint8)
    s = rng.uniform(0.001, 0.01, (k // g, n)).astype(np.float32)
    z = rng.integers(100, 156, (k // g, n)).astype(np.uint8)
    g_idx = rng.permutation(np.arange(k) // g).astype(np.int32)
    packed = prepack_w8(q, s, z, group_size=g, g_idx=g_idx)
    x = _x(rng, 4, k)
    w64 = (q.astype(np.float64) - z[g_idx]) * s[g_idx]                # [K, N], checkpoint row order
    kernel = "auto" if interpret else "pallas"
    y = w8a16_matmul(x, packed, impl="triton" if impl == "triton" else kernel, interpret=interpret)
    _check(y, x, w64.T)


def test_kernel_zero_and_huge_scales(interpret):
    """A channel of zero scale is exactly 0; e4m3 codes at ±448 with a 2^115 tensor scale overflow
    bf16 to ±Inf as the reference does; zero rows of x give exact zeros."""
    rng = np.random.default_rng()
    q = rng.integers(-127, 128, (128, 128)).astype(np.int8)
    cs = rng.uniform(0.5, 1, 128).astype(np.float32)
    cs[[0, 77]] = 0
    x = _x(rng, 8, 128).at[3].set(0)
    y = np.asarray(w8a16_matmul(x, prepack_w8(q, channel_scale=cs), interpret=interpret,
                                impl="auto" if interpret else "pallas"), np.float32)
    assert not y[:, [0, 77]].any() and not y[3].any()
    f8 = np.full((128, 128), 448, ml_dtypes.float8_e4m3fn)
    f8[:, 1::2] = -448
    big = prepack_w8(f8, global_scale=2.0 ** 115)   # 448 · 128 · 2^115 > bf16 max
    y = np.asarray(w8a16_matmul(jnp.ones((2, 128), jnp.bfloat16), big, interpret=interpret,
                                impl="auto" if interpret else "pallas"), np.float32)
    ref = np.asarray(reference_w8(jnp.ones((2, 128), jnp.bfloat16), big), np.float32)
    np.testing.assert_array_equal(np.isinf(y), np.isinf(ref))
    assert np.isinf(y).all() and (np.sign(y) == np.sign(ref)).all()


def test_kernel_nan_weight_propagates(interpret):
    """A NaN e4m3 code (0x7F) poisons its output column, as in the reference; others stay finite."""
    f8 = np.ones((128, 128), ml_dtypes.float8_e4m3fn)
    f8[5, 9] = np.nan
    packed = prepack_w8(f8, channel_scale=np.ones(128, np.float32))
    y = np.asarray(w8a16_matmul(jnp.ones((1, 128), jnp.bfloat16), packed, interpret=interpret,
                                impl="auto" if interpret else "pallas"), np.float32)
    assert np.isnan(y[0, 9]) and np.isfinite(np.delete(y[0], 9)).all()


# ---- lowering for sm_90 (Mosaic GPU's Python lowering: layouts, casts, shared memory) -------------
@pytest.mark.skipif(ON_GPU, reason="the GPU run compiles for real")
@pytest.mark.parametrize("fmt,options", [WEIGHTS[i] for i in (0, 3, 5, 6, 7, 8)],
                         ids=[IDS[i] for i in (0, 3, 5, 6, 7, 8)])
def test_lowers_for_sm90_every_default_launch(fmt, options):
    """Every default launch (M ≤ 16, 64, the two-warpgroup kernel, 128-row tiles) lowers: a shared
    memory overflow or an unsupported 8-bit cast fails here, without a GPU."""
    rng = np.random.default_rng(0)
    for n, k, ms in [(512, 1024, (1, 16, 128)), (25600, 256, (64, 256))]:
        packed = pack_w8_qtensor(jquant.quantize(rng.standard_normal((n, k)).astype(np.float32), fmt, **options))
        for m in ms:
            cfg = default_w8_config(m, packed)
            assert (cfg.compute_wgs == 2) == (n == 25600)
            text = lower_for_cuda(lambda x, p, cfg=cfg: w4a16_mgpu_matmul(x, p, config=cfg),
                                  jnp.ones((m, k), jnp.bfloat16), packed)
            assert "mosaic_gpu" in text, (n, k, m, cfg)


@pytest.mark.parametrize("n", [200, 130, 320])
def test_lowers_for_sm90_with_ragged_n(n):
    """N not a multiple of the tiles: the output's TMA store must lower (seen failing on the H200
    for N = 200, whose bf16 rows meet the 16-byte rule but not the 64-column copy tiling)."""
    rng = np.random.default_rng(0)
    packed = pack_w8_qtensor(jquant.quantize(rng.standard_normal((n, 320)).astype(np.float32), "int8"))
    cfg = default_w8_config(3, packed)
    text = lower_for_cuda(lambda x, p: w4a16_mgpu_matmul(x, p, config=cfg), jnp.ones((3, 320), jnp.float16),
                          packed)
    assert "mosaic_gpu" in text


# ---- layout, reference, dispatch ------------------------------------------------------------------
LAYOUTS = dict(k=st.integers(1, 300), n=st.integers(1, 150), kind=st.sampled_from(["int8", "uint8", "e4m3"]),
               group=st.sampled_from([16, 32, 64, 128, -1]), seed=st.integers(0, 2**16))


def random_layout(k, n, kind, group, seed):
    """A random 8-bit ``[K, N]`` weight of ``kind`` in groups of ``group`` rows (-1: one group), laid out
    by ``prepack_w8``, and its float64 value from the codes, scales and zero points by hand."""
    rng = np.random.default_rng(seed)
    g = k if group == -1 else group
    groups = -(-k // g)
    s = rng.uniform(0.5, 2, (groups, n)).astype(np.float32)
    rows = np.arange(k) // g
    if kind == "e4m3":
        q = rng.standard_normal((k, n)).astype(ml_dtypes.float8_e4m3fn)
        return prepack_w8(q, s, group_size=group), q.astype(np.float64) * s[rows]
    if kind == "int8":
        q = rng.integers(-128, 128, (k, n)).astype(np.int8)
        return prepack_w8(q, s, group_size=group), q.astype(np.float64) * s[rows]
    q = rng.integers(0, 256, (k, n)).astype(np.uint8)
    z = rng.integers(0, 256, (groups, n)).astype(np.uint8)
    return prepack_w8(q, s, z, group_size=group), (q.astype(np.float64) - z[rows]) * s[rows]


@settings(max_examples=8)
@given(**LAYOUTS)
def test_layout_dequantizes_exactly(k, n, kind, group, seed):
    packed, w = random_layout(k, n, kind, group, seed)
    out = np.asarray(dequantize_w8(packed))
    assert packed.k_pad % 64 == 0 and packed.n_pad % 128 == 0
    np.testing.assert_allclose(out[:k, :n], w, rtol=1e-6)
    assert not out[:, n:].any()
    assert kind == "uint8" or not out[k:].any()   # padded rows with zero points meet x's zero columns


@pytest.mark.parametrize("fmt,options", WEIGHTS, ids=IDS)
def test_reference_equals_qtensor_dequantize(fmt, options):
    rng = np.random.default_rng()
    qt = jquant.quantize(rng.standard_normal((256, 256)).astype(np.float32), fmt, **options)
    x = jnp.asarray(rng.standard_normal((3, 256)), jnp.float32)
    chex.assert_trees_all_close(w8a16_matmul(x, qt, impl="reference"), x @ qt.dequantize().T, rtol=1e-5,
                                atol=1e-4)


def test_dispatch_policy():
    assert dispatch.w8a16_impl(1, 0) == "reference"
    assert dispatch.w8a16_impl(1, 80) == dispatch.w8a16_impl(1, 100) == "xla"
    assert dispatch.w8a16_impl(dispatch.W8A16_MGPU_MAX_M + 1, 90) == "xla"
    gemv = dispatch.GEMV_MAX_M
    assert dispatch.w8a16_impl(gemv, 90) == "triton" and dispatch.w8a16_impl(gemv + 1, 90) == "mgpu"
    # The GEMV takes no small groups (MXFP8's 32 ran 4.5x slower on it than on the W8A16 kernel).
    assert dispatch.w8a16_impl(1, 90, group_size=32) == "mgpu"
    assert dispatch.w8a16_impl(1, 90, group_size=dispatch.GEMV_MIN_GROUP) == "triton"
    assert resolve_w8_impl("auto", 1, interpret=True) == "mgpu"
    with pytest.raises(ValueError, match="impl must be one of"):
        resolve_w8_impl("cuda", 1)


def test_launch_config_keeps_bytes_per_step():
    packed = prepack_w8(np.ones((4096, 4096), np.int8), channel_scale=np.ones(4096, np.float32))
    small, wide = default_w8_config(1, packed), default_w8_config(128, packed)
    assert small.block_k == 128 and not small.group_acc and small.final_output   # 128 bytes a row
    assert wide.block_k == 64 and wide.block_m == 128                            # shared memory
    grouped = prepack_w8(np.ones((4096, 4096), np.int8), np.ones((32, 4096), np.float32), group_size=128)
    assert default_w8_config(1, grouped).group_acc   # fp32 group scales at M ≤ 16


def test_scheme_lays_out_weight_only_8bit_for_hopper_only():
    """On a (fake) Hopper GPU a weight-only 8-bit scheme lays its weight out for the kernel; W8A8
    schemes keep their own path; CPU keeps the QTensor."""
    hopper = type("Dev", (), {"platform": "gpu", "device_kind": "H200", "compute_capability": "9.0"})()
    rng = np.random.default_rng()
    w = rng.standard_normal((128, 256)).astype(np.float32)
    weight_only = jquant.get_scheme("int8_ch")
    impls = [i.name for i in candidate_impls(weight_only, hopper)]
    assert impls[0] == "pallas_w8a16"
    w8a8 = jquant.get_scheme("fp8_e4m3_channel")
    assert candidate_impls(w8a8, hopper)[0].name != "pallas_w8a16"
    qw = weight_only.quantize_weight(w)
    packed = pack_w8_qtensor(qw)
    x = jnp.asarray(rng.standard_normal((4, 256)), jnp.float32)
    chex.assert_trees_all_close(w8a16_matmul(x, packed), weight_only.apply(x, qw), rtol=1e-5, atol=1e-4)


# ---- bad input ------------------------------------------------------------------------------------
def test_bad_input_names_the_problem():
    rng = np.random.default_rng()
    with pytest.raises(TypeError, match="float32 codes of shape"):
        prepack_w8(np.ones((64, 8), np.float32), np.ones((1, 8), np.float32))
    with pytest.raises(TypeError, match="int8 codes with zero points"):
        prepack_w8(np.ones((64, 8), np.int8), np.ones((1, 8)), np.ones((1, 8)))
    with pytest.raises(ValueError, match="needs scale"):
        prepack_w8(np.ones((64, 8), np.int8))
    with pytest.raises(ValueError, match="group_size 16, 32"):
        prepack_w8(np.ones((96, 8), np.int8), np.ones((2, 8), np.float32), group_size=48)
    with pytest.raises(ValueError, match=r"scale has shape \(3, 8\); expected \(2, 8\)"):
        prepack_w8(np.ones((64, 8), np.int8), np.ones((3, 8), np.float32), group_size=32)
    with pytest.raises(ValueError, match=r"channel_scale has shape"):
        prepack_w8(np.ones((64, 8), np.int8), channel_scale=np.ones(9, np.float32))
    int4 = jquant.quantize(rng.standard_normal((8, 64)).astype(np.float32), "int4", group_size=32)
    with pytest.raises(ValueError, match="no 8-bit kernel layout"):
        w8a16_matmul(jnp.ones((1, 64)), int4)
    packed = prepack_w8(np.ones((64, 8), np.int8), channel_scale=np.ones(8, np.float32))
    with pytest.raises(ValueError, match=r"expected \[..., K=64\]"):
        w8a16_matmul(jnp.ones((1, 63)), packed)
    with pytest.raises(TypeError, match="x must be bf16"):
        w8a16_matmul(jnp.ones((1, 64), jnp.int32), packed)
    assert isinstance(packed, PackedW8NK)


def test_wide_weight_default_launch_from_256_rows(interpret):
    """A weight of ≥ 25600 rows from M = 256 takes 256 x rows a CTA on two warpgroups, 3 deep with zero
    points (4 without: the W8_SWEEP bench test runs that launch): the result is float64's."""
    rng = np.random.default_rng()
    m, (fmt, options) = 256, WEIGHTS[3]
    qt = jquant.quantize(rng.standard_normal((25600, 128)).astype(np.float32), fmt, **options)
    packed = pack_w8_qtensor(qt)
    cfg = default_w8_config(m, packed)
    assert (cfg.block_m, cfg.compute_wgs, cfg.max_concurrent_steps) == (256, 2, 3)
    assert default_w8_config(m, pack_w8_qtensor(jquant.quantize(np.ones((25600, 128), np.float32), "int8"))
                             ).max_concurrent_steps == 4
    x = _x(rng, m, 128)
    _check(w8a16_matmul(x, packed, impl="pallas" if not interpret else "auto", interpret=interpret), x,
           _float64_weight(qt))
