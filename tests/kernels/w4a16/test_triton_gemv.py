"""The 4-bit GEMV (Triton-backend Pallas, ``w4a16_matmul(impl="triton")``) on the Mosaic GPU kernel's
layout: interpret mode against float64 from the packed bytes at every M it takes, word order against
K order, adversarial values, its lowering to Triton IR for sm_90 on CPU at every swept launch, the
dispatch, bad input. JQUANT_TEST_GPU=1 runs the same tests on the GPU."""

import jax.numpy as jnp
import numpy as np
import pytest

import jquant
from cuda_lowering import triton_modules
from w4_inputs import random_w4_weight
from jquant.kernels.gemv8 import GemvConfig
from jquant.kernels.gemv8.config import MAX_ROWS
from jquant.kernels.w4a16 import MgpuConfig, dequantize_nk, prepack_nk, resolve_impl, w4a16_matmul
from jquant.kernels.w4a16 import api as w4a16_api
from jquant.kernels.w4a16.bench import GEMV_SWEEP
from jquant.kernels.w4a16.triton_gemv import DEFAULT_CONFIG, w4a16_gemv
from jquant.schemes import dispatch


def _float64(packed, x, magnitude=False):
    """``x @ W`` in float64 from the packed weight's fp32 dequantization (exact: one rounding a code); with
    ``magnitude`` also ``|x| @ |W|``, the scale of the fp32 sums' rounding."""
    w = np.asarray(dequantize_nk(packed), np.float64)[:packed.k, :packed.n]
    xs = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
    if packed.perm is not None:
        xs = xs[:, np.asarray(packed.perm)]
    return (xs @ w, np.abs(xs) @ np.abs(w)) if magnitude else xs @ w


def _assert_close(y, packed, x, bias=None):
    """Within fp32 summation error (64 ulp of ``|x| @ |W|``) and the output dtype's rounding."""
    ref, mag = _float64(packed, x, magnitude=True)
    if bias is not None:
        ref = ref + np.asarray(bias, np.float64)
    y64 = np.asarray(jnp.asarray(y, jnp.float32), np.float64)
    rounding = {jnp.float32: 0.0, jnp.float16: 2.0 ** -11, jnp.bfloat16: 2.0 ** -8}[jnp.dtype(y.dtype).type]
    bound = 64 * 2.0 ** -24 * mag + rounding * np.abs(ref) + 1e-30
    assert (np.abs(y64 - ref) <= bound).all(), float(np.max(np.abs(y64 - ref) / bound))


@pytest.mark.parametrize("m", range(1, MAX_ROWS + 1))
@pytest.mark.parametrize("group,zeros,scale_dtype", [(32, None, "f32"), (128, "int", "bf16"), (-1, None, "f16"),
                                                     (192, "float", "f32"), (64, "int", "f16")])
def test_gemv_matches_float64(m, group, zeros, scale_dtype, interpret):
    rng = np.random.default_rng()
    k, n = 768, 256
    q, s, z = random_w4_weight(rng, k, n, group, zeros=zeros, scale_dtype=scale_dtype)
    packed = prepack_nk(q, s, z, group_size=group)
    for dtype in (jnp.float32, jnp.bfloat16):
        x = jnp.asarray(rng.standard_normal((m, k)), dtype)
        y = w4a16_matmul(x, packed, impl="triton", interpret=interpret)
        assert y.shape == (m, n) and y.dtype == dtype
        _assert_close(y, packed, x)


@pytest.mark.parametrize("cfg", (DEFAULT_CONFIG,) + GEMV_SWEEP, ids=str)
def test_every_swept_launch_matches_float64(cfg, interpret):
    """Each launch's tiling (rows a program, codes a step; steps that hold several groups or lie in one)."""
    rng = np.random.default_rng()
    q, s, z = random_w4_weight(rng, 2048, 256, 128, zeros="int")
    packed = prepack_nk(q, s, z, group_size=128)
    x = jnp.asarray(rng.standard_normal((2, 2048)), jnp.float32)
    _assert_close(w4a16_matmul(x, packed, impl="triton", config=cfg, interpret=interpret), packed, x)


@pytest.mark.parametrize("n,k,m,dtype", [(200, 300, 3, jnp.float16), (130, 100, 1, jnp.float32),
                                         (384, 576, 2, jnp.bfloat16)])
def test_ragged_shapes_act_order_and_bias(n, k, m, dtype, interpret):
    """N and K off the tiles (K = 300 padded to 320; K = 576 takes 64-code steps), GPTQ act order (x's
    columns gathered), a bias, fp16 / fp32 / bf16 x; word order and K order give the same result."""
    rng = np.random.default_rng()
    group = 32 if k % 32 == 0 else -1
    q, s, z = random_w4_weight(rng, k, n, group, zeros="int")
    g_idx = rng.permutation(np.arange(k) // (group if group > 0 else k)) if group > 0 else None
    bias = jnp.asarray(rng.standard_normal(n), jnp.float32)
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    outs = []
    for word_order in (True, False):
        packed = prepack_nk(q, s, z, group_size=group, g_idx=g_idx, word_order=word_order)
        y = w4a16_matmul(x, packed, bias=bias, impl="triton", interpret=interpret)
        assert y.shape == (m, n) and y.dtype == dtype
        _assert_close(y, packed, x, bias)
        outs.append(np.asarray(jnp.asarray(y, jnp.float32)))
    np.testing.assert_allclose(outs[0], outs[1], rtol=2e-6 if dtype == jnp.float32 else 8e-3,
                               atol=1e-3 if dtype != jnp.float32 else 1e-4)


def test_adversarial_values(interpret):
    """A zero scale column gives exact zeros, a zero row of x exact zeros; a NaN in x poisons its row only;
    every code decodes (each column holds all 16); sums past fp32's range overflow to -Inf."""
    rng = np.random.default_rng()
    k, n = 512, 128
    q = (np.arange(k)[:, None] + np.arange(n)[None, :]) % 16
    s = rng.uniform(0.5, 1, (k // 128, n)).astype(np.float32)
    s[:, [0, 77]] = 0
    packed = prepack_nk(q, s, group_size=128)
    x = jnp.asarray(rng.standard_normal((4, k)), jnp.float32).at[3].set(0).at[1, 17].set(jnp.nan)
    y = np.asarray(w4a16_matmul(x, packed, impl="triton", interpret=interpret))
    assert not y[[0, 2, 3]][:, [0, 77]].any() and not y[3].any()
    assert np.isnan(y[1]).all() and np.isfinite(y[[0, 2]]).all()
    _assert_close(jnp.asarray(y[np.array([0, 2])]), packed, x[np.array([0, 2])])
    # Code 0 (value −8) everywhere at scale 2^122: each weight −2^125 is finite, 512 of them sum past 2^128.
    packed = prepack_nk(np.zeros((k, n), np.uint8), np.full((1, n), 2.0 ** 122, np.float32), group_size=-1)
    y = np.asarray(w4a16_matmul(jnp.ones((1, k), jnp.float32), packed, impl="triton", interpret=interpret))
    assert np.isneginf(y).all()


def test_global_scale_multiplies_the_sums_before_the_bias(interpret):
    """``prepack_nk``'s global scale on int4 codes with zero points, and a bias added after it."""
    rng = np.random.default_rng()
    k, n, m = 320, 192, 2
    q, s, z = random_w4_weight(rng, k, n, 64, zeros="int")
    packed = prepack_nk(q, s, z, group_size=64, global_scale=np.float32(rng.uniform(2, 8)))
    bias = jnp.asarray(rng.standard_normal(n) * 4, jnp.float32)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    _assert_close(w4a16_matmul(x, packed, bias=bias, impl="triton", interpret=interpret), packed, x, bias)


def test_padded_rows_of_a_zero_point_group_are_zero(interpret):
    """K = 80 in groups of 32 pads the last group with 16 rows; with zero points they decode to 0, so a
    huge scale there cannot turn x's zero padding into 0 · Inf = NaN."""
    rng = np.random.default_rng()
    k, n = 80, 128
    q = rng.integers(0, 16, (k, n)).astype(np.uint8)
    z = rng.integers(0, 15, (3, n)).astype(np.uint8)
    q[64:] = z[2] + 1             # weights of the last group: 1e38, finite; (8 - z) · 1e38 often is not
    s = np.full((3, n), 0.01, np.float32)
    s[2] = 1e38
    packed = prepack_nk(q, s, z, group_size=32)
    assert not np.asarray(dequantize_nk(packed))[k:].any()
    x = jnp.asarray(rng.standard_normal((1, k)) * 1e-30, jnp.float32)
    y = np.asarray(w4a16_matmul(x, packed, impl="triton", interpret=interpret))
    assert np.isfinite(y).all()
    _assert_close(jnp.asarray(y), packed, x)


@pytest.mark.parametrize("scheme", ["int4_g128", "int4_g128_asym", "int4_g32"])
def test_schemes_weights_run_it(scheme, interpret):
    """A scheme's quantized [N, K] weight runs the GEMV, equal to its own dequantization."""
    rng = np.random.default_rng()
    sch = jquant.get_scheme(scheme)
    w = jnp.asarray(rng.standard_normal((384, 1024)) * 0.05, jnp.float32)
    qw = sch.quantize_weight(w)
    x = jnp.asarray(rng.standard_normal((1, 1024)), jnp.float32)
    y = np.asarray(w4a16_matmul(x, qw, impl="triton", interpret=interpret), np.float64)
    w64 = np.asarray(qw.dequantize(), np.float64)
    xs = np.asarray(x, np.float64)
    assert (np.abs(y - xs @ w64.T) <= 64 * 2.0 ** -24 * (np.abs(xs) @ np.abs(w64).T) + 1e-30).all()


def test_gemv_lowers_to_triton_for_every_launch():
    """Every swept launch and the default lower to Triton IR at 1 and MAX_ROWS rows, with zero points and
    a bias: an unsupported op, cast or block shape fails here, without a GPU."""
    rng = np.random.default_rng(0)
    q, s, z = random_w4_weight(rng, 4096, 512, 128, zeros="int", scale_dtype="bf16")
    packed = prepack_nk(q, s, z, group_size=128)
    bias = jnp.zeros((512,), jnp.float32)
    for cfg in (DEFAULT_CONFIG,) + GEMV_SWEEP:
        for m in (1, MAX_ROWS):
            texts = triton_modules(lambda x, p, b, cfg=cfg: w4a16_gemv(x, p, b, config=cfg),
                                   jnp.ones((m, 4096), jnp.bfloat16), packed, bias)
            assert len(texts) == 1 and "tt.load" in texts[0], (cfg, m)
            assert texts[0].count("tt.store") == m, (cfg, m)   # one store a row of x


def test_dispatch_takes_it_at_one_row_for_small_weights(monkeypatch):
    monkeypatch.setattr(dispatch, "W4A16_GEMV_MAX_WEIGHT", 4096 * 4096)
    assert dispatch.w4a16_impl(1, 90, 4096 * 4096) == "triton"
    assert dispatch.w4a16_impl(1, 90, 4096 * 4096, gemv=False) == "mgpu"
    assert dispatch.w4a16_impl(2, 90, 4096 * 4096) == "mgpu"            # one row only
    assert dispatch.w4a16_impl(1, 90, 4096 * 4097) == "mgpu"            # past the size
    assert dispatch.w4a16_impl(1, 80, 4096 * 4096) == "xla"             # Hopper only
    assert dispatch.w4a16_impl(1, 0, 4096 * 4096) == "reference"        # CPU
    monkeypatch.setattr(w4a16_api, "compute_capability", lambda: 90)
    assert resolve_impl("auto", 1, weight_elems=4096 * 4096) == "triton"
    assert resolve_impl("auto", 1, weight_elems=4096 * 4096, gemv=False) == "mgpu"   # a weight it cannot take


def test_auto_with_a_gemv_launch_falls_back_where_the_gemv_cannot(interpret):
    """``impl="auto"`` with a GemvConfig runs the GEMV; for a weight it cannot take (groups of 16, NF4) the
    Mosaic GPU kernel runs instead, with the same result as asking for it."""
    rng = np.random.default_rng()
    x = jnp.asarray(rng.standard_normal((1, 256)), jnp.bfloat16)
    q, s, _ = random_w4_weight(rng, 256, 128, 16)
    packed = prepack_nk(q, s, group_size=16)
    y = w4a16_matmul(x, packed, impl="auto", config=GemvConfig(block_n=8, block_k=256), interpret=interpret)
    ref = w4a16_matmul(x, packed, impl="mgpu", interpret=interpret)
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(ref, np.float32))


def test_bad_input_names_the_problem():
    q, s, _ = random_w4_weight(np.random.default_rng(0), 256, 128, 32)
    packed = prepack_nk(q, s, group_size=32)
    with pytest.raises(ValueError, match="1 to 4 rows"):
        w4a16_matmul(jnp.ones((5, 256), jnp.bfloat16), packed, impl="triton", interpret=True)
    with pytest.raises(TypeError, match="GemvConfig"):
        w4a16_matmul(jnp.ones((1, 256), jnp.bfloat16), packed, impl="triton", interpret=True, config=MgpuConfig())
    with pytest.raises(ValueError, match="block_n=256 must divide"):
        w4a16_matmul(jnp.ones((1, 256), jnp.bfloat16), packed, impl="triton", interpret=True,
                     config=GemvConfig(block_n=256))
    q16, s16, _ = random_w4_weight(np.random.default_rng(0), 256, 128, 16)
    with pytest.raises(ValueError, match="groups of a multiple of 32.*group_size=16"):
        w4a16_matmul(jnp.ones((1, 256), jnp.bfloat16), prepack_nk(q16, s16, group_size=16), impl="triton",
                     interpret=True)
    nf4 = prepack_nk(q, s, group_size=32, lut="nf4")
    with pytest.raises(ValueError, match="lut='nf4'"):
        w4a16_matmul(jnp.ones((1, 256), jnp.bfloat16), nf4, impl="triton", interpret=True)
    with pytest.raises(ValueError, match=r"x must be \[M, K_pad=256\]"):
        w4a16_gemv(jnp.ones((1, 128), jnp.bfloat16), packed, interpret=True)


def test_word_order_in_closed_form_is_the_layouts():
    """The kernel computes word order's permutation with bit operations (a Triton kernel cannot capture
    an index array); it must be the layout's own, block after block."""
    from jquant.kernels.w4a16.mosaic_gpu_decode import word_order_sources
    from jquant.kernels.w4a16.triton_gemv import _word_sources

    src = word_order_sources("int4")
    np.testing.assert_array_equal(_word_sources(np.arange(96)), np.concatenate([src, src + 32, src + 64]))
