"""The FP8 W8A8 GEMM (Mosaic GPU): interpret mode against its twin and against the W8A8 schemes'
own XLA numerics, lowering for sm_90 on CPU, the scheme path, and bad input.
JQUANT_TEST_GPU=1 runs the same tests on the GPU."""

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jquant
from bf16_sums import assert_equal_but_one_sum_order_flip
from conftest import ON_GPU
from cuda_lowering import lower_for_cuda
from jquant.kernels.fp8_gemm import (Fp8GemmConfig, default_fp8_config, fp8_gemm, prepack_fp8, reference_fp8,
                                     resolve_fp8_impl)
from jquant.kernels.fp8_gemm.api import run_kernel
from jquant.kernels.fp8_gemm.from_qtensor import fp8_scheme_gemm, pack_fp8_qtensor
from jquant.schemes import dispatch
from jquant.schemes.scheme import candidate_impls
from jquant.schemes.xla import quantize_activation, xla_apply

SCHEMES = ("fp8_e4m3_channel", "fp8_e4m3_tensor", "fp8_e4m3_block128x128", "fp8_e4m3_block128x128_ue8m0")


def _impl(interpret):
    return "auto" if interpret else "pallas"


def _scheme_atol(ref) -> float:
    """Kernel against a W8A8 scheme's XLA path: on a GPU both sides sum FP8 products in the tensor
    cores' reduced-precision accumulator (the kernel's wgmma, XLA's cuBLASLt), so they agree to that
    accumulator's precision, not to fp32's; on CPU both are fp32 sums."""
    return 2e-3 * float(jnp.abs(ref).max()) if ON_GPU else 1e-3


def _float64(xq, xs, w, ws, blocks):
    """``Σ_b sx·sw·Σ_k xq·wq`` in float64 from the raw codes (block scales expanded by hand)."""
    xq, w = np.asarray(xq, np.float64), np.asarray(w, np.float64)
    m, k = xq.shape
    n = w.shape[0]
    if not blocks:
        return (xq @ w.T) * np.asarray(xs, np.float64).reshape(-1, 1) * np.asarray(ws, np.float64).reshape(1, -1)
    xs_k = np.repeat(np.asarray(xs, np.float64), 128, axis=1)[:, :k]
    ws_nk = np.repeat(np.repeat(np.asarray(ws, np.float64), 128, 0), 128, 1)[:n, :k]
    out = np.zeros((m, n))
    for b in range(-(-k // 128)):
        sl = slice(b * 128, (b + 1) * 128)
        out += (xq[:, sl] @ w[:, sl].T) * xs_k[:, b * 128][:, None] * ws_nk[:, b * 128][None, :]
    return out


@pytest.mark.parametrize("blocks", [False, True], ids=["token-channel", "block128"])
@pytest.mark.parametrize("m,n,k", [(1, 256, 256), (9, 200, 300), (70, 256, 384), (130, 384, 128), (300, 256, 384)])
def test_kernel_matches_float64(blocks, m, n, k, interpret):
    rng = np.random.default_rng()
    w = (rng.standard_normal((n, k)) * 8).astype(ml_dtypes.float8_e4m3fn)
    kb = -(-k // 128)
    ws = rng.uniform(1e-3, 1e-2, (-(-n // 128), kb) if blocks else n).astype(np.float32)
    xq = jnp.asarray(rng.standard_normal((m, k)) * 8, jnp.float8_e4m3fn)
    xs = jnp.asarray(rng.uniform(1e-3, 1e-2, (m, kb) if blocks else (m, 1)), jnp.float32)
    bias = jnp.asarray(rng.standard_normal(n) * 0.1, jnp.float32)
    y = fp8_gemm(xq, xs, prepack_fp8(w, ws), bias=bias, impl=_impl(interpret), interpret=interpret)
    assert y.shape == (m, n) and y.dtype == jnp.bfloat16
    ref = _float64(xq, xs, w, ws, blocks) + np.asarray(bias, np.float64)
    np.testing.assert_allclose(np.asarray(y, np.float64), ref, rtol=1e-2, atol=1e-2 * np.abs(ref).max())
    # and the twin, to within the output's rounding
    chex.assert_trees_all_close(y.astype(jnp.float32),
                                reference_fp8(xq, xs, prepack_fp8(w, ws), bias).astype(jnp.float32),
                                rtol=8e-3, atol=1e-3 * np.abs(ref).max())


@pytest.mark.parametrize("width,ctas", [(2, 0), (2, 5), (0, 5)], ids=["snake", "snake-persistent", "persistent"])
@pytest.mark.parametrize("blocks", [False, True], ids=["token-channel", "block128"])
def test_snake_and_persistent_grids_cover_every_tile_once(blocks, width, ctas, interpret):
    """Two-warpgroup launches over 3 x tiles and 4 weight tiles walking the grid in strips of 2 x tiles
    (the last strip narrower), and/or 5 persistent CTAs looping over the 12 tiles (unevenly): every
    output tile written once, as in grid order."""
    rng = np.random.default_rng()
    m, n, k = 300, 512, 256
    w = (rng.standard_normal((n, k)) * 8).astype(ml_dtypes.float8_e4m3fn)
    ws = rng.uniform(1e-3, 1e-2, (n // 128, k // 128) if blocks else n).astype(np.float32)
    xq = jnp.asarray(rng.standard_normal((m, k)) * 8, jnp.float8_e4m3fn)
    xs = jnp.asarray(rng.uniform(1e-3, 1e-2, (m, k // 128) if blocks else (m, 1)), jnp.float32)
    cfg = Fp8GemmConfig(swap_ab=False, block_a=64, block_b=128, compute_wgs=2, grid_tile_width=width,
                        persistent_ctas=ctas)
    p = prepack_fp8(w, ws)
    y = fp8_gemm(xq, xs, p, impl=_impl(interpret), config=cfg, interpret=interpret)
    ref = _float64(xq, xs, w, ws, blocks)
    np.testing.assert_allclose(np.asarray(y, np.float64), ref, rtol=1e-2, atol=1e-2 * np.abs(ref).max())
    if not ON_GPU:
        text = lower_for_cuda(lambda a, s, w: run_kernel(a, s, w, None, jnp.bfloat16, cfg, False), xq, xs, p)
        assert "mosaic_gpu" in text


@pytest.mark.parametrize("name", SCHEMES)
@pytest.mark.parametrize("m,gemv", [(3, False), (96, False), (1, True), (4, True)],
                         ids=["kernel-3", "kernel-96", "gemv-1", "gemv-4"])
def test_kernel_keeps_the_scheme_numerics(name, m, gemv, interpret):
    """Activations quantized as the W8A8 scheme says, then the kernel (or the 8-bit GEMV,
    ``impl="triton"``): the scheme's XLA result."""
    scheme = jquant.get_scheme(name)
    rng = np.random.default_rng()
    w = rng.standard_normal((256, 512)).astype(np.float32)
    qw = scheme.quantize_weight(w)
    x = jnp.asarray(rng.standard_normal((m, 512)), jnp.float32)
    xq = quantize_activation(scheme, x)
    xs = xq.scale.astype(jnp.float32)
    y = fp8_gemm(xq.data, xs, pack_fp8_qtensor(qw), out_dtype=jnp.float32,
                 impl="triton" if gemv else _impl(interpret), interpret=interpret)
    ref = xla_apply(scheme, x, qw, None)
    chex.assert_trees_all_close(y, ref, rtol=1e-4, atol=_scheme_atol(ref))


@pytest.mark.parametrize("m,blocks,impl", [(8, False, "kernel"), (256, False, "kernel"), (256, True, "kernel"),
                                           (4, False, "triton"), (4, True, "triton")],
                         ids=["swap-ab", "two-warpgroups", "block-two-warpgroups-snake", "gemv", "gemv-block"])
def test_nan_and_zero_rows(m, blocks, impl, interpret):
    """A NaN code poisons its row only; an all-zero row of x (scale 0) gives exact zeros; at 256 rows
    on the two-warpgroup launches (block scales: the promoted sum, on the snake grid), at 4 on the
    8-bit GEMV."""
    rng = np.random.default_rng()
    k = 256 if blocks else 128
    w = rng.standard_normal((256, k)).astype(ml_dtypes.float8_e4m3fn)
    xq = np.asarray(rng.standard_normal((m, k)), ml_dtypes.float8_e4m3fn)
    xq[2, 5] = np.nan
    xq[1] = 0
    xs = np.ones((m, k // 128 if blocks else 1), np.float32)
    xs[1] = 0
    ws = np.ones((2, k // 128) if blocks else 256, np.float32)
    assert default_fp8_config(m, 256, blocks).compute_wgs == (2 if m == 256 else 1)
    y = np.asarray(fp8_gemm(jnp.asarray(xq), xs, prepack_fp8(w, ws), interpret=interpret,
                            impl="triton" if impl == "triton" else _impl(interpret)), np.float32)
    assert np.isnan(y[2]).all() and not y[1].any() and np.isfinite(np.delete(y, 2, axis=0)).all()


@pytest.mark.skipif(ON_GPU, reason="the GPU run compiles for real")
@pytest.mark.parametrize("blocks", [False, True], ids=["token-channel", "block128"])
def test_lowers_for_sm90_every_default_launch(blocks):
    n, k = 2048, 1024
    p = prepack_fp8(jnp.ones((n, k), jnp.float8_e4m3fn), jnp.ones((n // 128, k // 128)) if blocks else jnp.ones(n))
    # fp32 outputs too: a swap-AB fp32 store failed layout inference and a two-warpgroup fp32 launch
    # overflowed shared memory (seen first on the H200; both lower on CPU as well).
    for m, out in [(1, jnp.bfloat16), (64, jnp.bfloat16), (256, jnp.bfloat16), (3, jnp.float32),
                   (96, jnp.float32), (300, jnp.float32)]:
        cfg = default_fp8_config(m, p.n_pad, blocks, jnp.dtype(out).itemsize)
        xs = jnp.ones((m, k // 128) if blocks else (m, 1))
        text = lower_for_cuda(lambda a, s, w, b, cfg=cfg, out=out: run_kernel(a, s, w, b, out, cfg, False),
                              jnp.ones((m, k), jnp.float8_e4m3fn), xs, p, jnp.ones(n))
        assert "mosaic_gpu" in text, (m, cfg)


def test_launches_the_kernel_cannot_run_are_refused():
    p = prepack_fp8(jnp.ones((256, 256), jnp.float8_e4m3fn), jnp.ones((2, 2)))
    xq, xs = jnp.ones((1, 256), jnp.float8_e4m3fn), jnp.ones((1, 2))
    with pytest.raises(ValueError, match="block scales need tiles of at least 32 rows"):
        run_kernel(xq, xs, p, None, jnp.bfloat16, Fp8GemmConfig(swap_ab=True, block_a=64, block_b=8), True)
    with pytest.raises(ValueError, match="float32 output needs x as A"):
        run_kernel(xq, xs, p, None, jnp.float32, Fp8GemmConfig(swap_ab=True, block_a=64, block_b=32), True)
    assert default_fp8_config(9, 256, blocked=True).block_b == 32


def test_scheme_lays_its_weight_out_for_the_fp8_gemm_on_hopper_only():
    hopper = type("Dev", (), {"platform": "gpu", "device_kind": "H200", "compute_capability": "9.0"})()
    ada = type("Dev", (), {"platform": "gpu", "device_kind": "L40S", "compute_capability": "8.9"})()
    scheme = jquant.get_scheme("fp8_e4m3_channel")
    assert candidate_impls(scheme, ada)[0].name == "xla"
    assert candidate_impls(scheme, hopper)[0].name == "pallas_fp8"
    assert candidate_impls(jquant.get_scheme("int8_ch"), hopper)[0].name != "pallas_fp8"
    rng = np.random.default_rng()
    qw = scheme.quantize_weight(rng.standard_normal((128, 256)).astype(np.float32))
    impl = candidate_impls(scheme, hopper)[0]
    x = jnp.asarray(rng.standard_normal((2, 3, 256)), jnp.float32)
    y = impl.run(scheme, x, impl.prepare(scheme, qw), None)
    ref = xla_apply(scheme, x, qw, None)
    chex.assert_trees_all_close(y, ref, rtol=1e-4, atol=_scheme_atol(ref))


def test_block_scheme_adds_the_bias_to_the_rounded_output():
    # Block FP8 adds its bias in x's dtype after the GEMM, as XLA's path and vLLM's block-FP8 linear do;
    # per-channel schemes add it in fp32 inside the epilogue (CUTLASS's ScaledEpilogueBias).
    hopper = type("Dev", (), {"platform": "gpu", "device_kind": "H200", "compute_capability": "9.0"})()
    rng = np.random.default_rng()
    x = jnp.asarray(rng.standard_normal((5, 256)), jnp.bfloat16)
    bias = jnp.asarray(rng.standard_normal(256) * 3, jnp.float32)
    for name, late in [("fp8_e4m3_block128x128", True), ("fp8_e4m3_channel", False)]:
        scheme = jquant.get_scheme(name)
        impl = candidate_impls(scheme, hopper)[0]
        packed = impl.prepare(scheme, scheme.quantize_weight(rng.standard_normal((256, 256)).astype(np.float32)))
        with_bias = np.asarray(impl.run(scheme, x, packed, bias, interpret=True), np.float32)
        late_bias = np.asarray(impl.run(scheme, x, packed, None, interpret=True) + bias.astype(jnp.bfloat16),
                               np.float32)
        assert (with_bias == late_bias).all() == late, name


def test_dispatch_and_config():
    assert resolve_fp8_impl("auto", 1, interpret=True) == "mgpu"
    most, gemv = dispatch.FP8_GEMM_MGPU_MAX_M, dispatch.GEMV_MAX_M
    assert dispatch.fp8_gemm_impl(gemv, 90) == "triton" and dispatch.fp8_gemm_impl(gemv, 90, blocked=True) == "xla"
    assert dispatch.fp8_gemm_impl(gemv + 1, 90) == dispatch.fp8_gemm_impl(most, 90) == "mgpu"
    assert dispatch.fp8_gemm_impl(most + 1, 90) == dispatch.fp8_gemm_impl(1, 89) == "xla"
    large = dispatch.FP8_GEMM_MGPU_MIN_LARGE_M
    assert dispatch.fp8_gemm_impl(large - 1, 90) == "xla" and dispatch.fp8_gemm_impl(large, 90) == "mgpu"
    assert dispatch.fp8_gemm_impl(large, 89) == "xla"
    # per-token activation scales: the kernel at every M past the GEMV's
    assert [dispatch.fp8_gemm_impl(m, 90, per_token=True) for m in (gemv, gemv + 1, most + 1, large - 1)] == [
        "triton", "mgpu", "mgpu", "mgpu"]
    assert dispatch.fp8_gemm_impl(most + 1, 90, blocked=True, per_token=True) == "mgpu"
    assert resolve_fp8_impl("auto", most + 1) == "xla"   # no wgmma on this host
    assert default_fp8_config(64, 256).swap_ab and not default_fp8_config(65, 256).swap_ab
    assert default_fp8_config(256, 256).compute_wgs == 2 and default_fp8_config(255, 256, blocked=True).compute_wgs == 1
    assert default_fp8_config(256, 256, blocked=True) == Fp8GemmConfig(swap_ab=False, block_a=64, block_b=128,
                                                                        compute_wgs=2, grid_tile_width=8)
    with pytest.raises(ValueError, match="compute_wgs must be 1, or 2"):
        Fp8GemmConfig(swap_ab=True, block_a=64, block_b=8, compute_wgs=2)
    with pytest.raises(ValueError, match="grid_tile_width must be 0, or ≥ 1 with two compute warpgroups"):
        Fp8GemmConfig(swap_ab=False, block_a=64, block_b=128, grid_tile_width=4)
    with pytest.raises(ValueError, match="persistent_ctas must be 0, or ≥ 1 with two compute warpgroups"):
        Fp8GemmConfig(swap_ab=False, block_a=64, block_b=128, persistent_ctas=132)
    with pytest.raises(ValueError, match="block_b must be a multiple of 8"):
        Fp8GemmConfig(swap_ab=True, block_a=64, block_b=4)


def test_bad_input_names_the_problem():
    with pytest.raises(TypeError, match="float8_e4m3fn codes"):
        prepack_fp8(np.ones((8, 64), np.float32), 1.0)
    w = np.ones((256, 256), ml_dtypes.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"scale has shape \(3,\)"):
        prepack_fp8(w, np.ones(3))
    p = prepack_fp8(w, np.ones(256, np.float32))
    with pytest.raises(ValueError, match=r"x_scale has shape \(2, 2\)"):
        fp8_gemm(jnp.ones((2, 256), jnp.float8_e4m3fn), jnp.ones((2, 2)), p)   # groups, weight per channel
    with pytest.raises(ValueError, match="K=256"):
        fp8_gemm(jnp.ones((2, 128), jnp.float8_e4m3fn), jnp.ones((2, 1)), p)
    with pytest.raises(ValueError, match=r"bias has shape \(3,\)"):
        fp8_gemm(jnp.ones((2, 256), jnp.float8_e4m3fn), jnp.ones((2, 1)), p, bias=jnp.ones(3))
    with pytest.raises(TypeError, match="PackedFp8"):
        fp8_gemm(jnp.ones((2, 256), jnp.float8_e4m3fn), jnp.ones((2, 1)), w)


def test_xla_path_uses_the_fp8_dot_where_there_is_one(monkeypatch):
    """On a GPU, one K block: XLA's FP8 dot of the codes (as the W8A8 schemes run it), equal to the twin."""
    rng = np.random.default_rng()
    w = rng.standard_normal((200, 300)).astype(ml_dtypes.float8_e4m3fn)
    xq = jnp.asarray(rng.standard_normal((5, 300)), jnp.float8_e4m3fn)
    xs = jnp.asarray(rng.uniform(0.5, 2, (5, 1)), jnp.float32)
    packed, bias = prepack_fp8(w, rng.uniform(0.5, 2, 200).astype(np.float32)), jnp.ones(200)
    monkeypatch.setattr(dispatch, "native_fp8_dot", lambda device=None: True)
    def dot_operands(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                yield tuple(v.aval.dtype for v in eqn.invars)
            for v in eqn.params.values():
                yield from dot_operands(getattr(v, "jaxpr", v)) if hasattr(getattr(v, "jaxpr", v), "eqns") else ()

    jaxpr = jax.make_jaxpr(lambda a, s: fp8_gemm(a, s, packed, bias=bias, impl="xla"))(xq, xs).jaxpr
    assert list(dot_operands(jaxpr)) == [(jnp.dtype(jnp.float8_e4m3fn),) * 2]
    y = fp8_gemm(xq, xs, packed, bias=bias, impl="xla", out_dtype=jnp.float32)
    chex.assert_trees_all_close(y, reference_fp8(xq, xs, packed, bias, jnp.float32), rtol=1e-5, atol=1e-4)


def test_fp8_schemes_run_xla_on_the_kernel_layout_where_the_kernel_does_not(monkeypatch):
    """W8A8 FP8 schemes lay their weights out for the FP8 GEMM on Hopper; where fp8_gemm_impl picks XLA
    (block scales below FP8_BLOCK_MGPU_MIN_M rows, one K block between FP8_GEMM_MGPU_MAX_M and
    FP8_GEMM_MGPU_MIN_LARGE_M rows) XLA's
    FP8 dot runs on that layout, the scheme's own XLA path bit for bit."""
    hopper = type("Dev", (), {"platform": "gpu", "device_kind": "H100", "compute_capability": "9.0"})()
    block, channel = jquant.get_scheme("fp8_e4m3_block128x128"), jquant.get_scheme("fp8_e4m3_channel")
    assert candidate_impls(block, hopper)[0].name == candidate_impls(channel, hopper)[0].name == "pallas_fp8"
    least = dispatch.FP8_BLOCK_MGPU_MIN_M
    assert dispatch.fp8_gemm_impl(least, 90, blocked=True) == "mgpu"
    assert dispatch.fp8_gemm_impl(least - 1, 90, blocked=True) == "xla"
    assert dispatch.fp8_gemm_impl(4096, 89, blocked=True) == "xla"
    assert dispatch.fp8_gemm_impl(dispatch.FP8_GEMM_MGPU_MIN_LARGE_M - 1, 90) == "xla"
    rng = np.random.default_rng()
    monkeypatch.setattr(dispatch, "native_fp8_dot", lambda device=None: True)
    bias = jnp.asarray(rng.standard_normal(384), jnp.float32)
    for scheme, rows in [(block, least - 1), (channel, dispatch.FP8_GEMM_MGPU_MAX_M + 3)]:
        qw = scheme.quantize_weight(rng.standard_normal((384, 256)).astype(np.float32))
        x = jnp.asarray(rng.standard_normal((rows, 256)), jnp.bfloat16)
        y = fp8_scheme_gemm(scheme, x, pack_fp8_qtensor(qw), bias)   # auto: XLA at these rows
        late = bias.astype(jnp.bfloat16) if scheme is block else None
        assert_equal_but_one_sum_order_flip(y, xla_apply(scheme, x, qw, bias), late)
        assert float(jnp.abs(y.astype(jnp.float32)).max()) > 0
