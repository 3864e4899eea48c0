"""The Mosaic GPU W4A16 kernel: interpret mode (CPU) against its pure-JAX twin and an independent numpy
dequantization, its lowering for sm_90 (no GPU needed), the NK layout, dispatch and bad input."""

import dataclasses

import chex
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given

from w4_inputs import random_w4_weight
from jquant.formats.bnb import _FP4 as FP4_BNB, _NF4 as NF4   # bnb's own tables (goldens-checked)
from jquant.kernels.w4a16 import (MGPU_MAX_M, MgpuConfig, PackedW4NK, default_mgpu_config,
                                   dequantize_nk, prepack_nk, reference_nk, resolve_impl,
                                   w4a16_matmul)
from jquant.kernels.w4a16 import api as dispatch
from jquant.kernels.w4a16.mosaic_gpu import w4a16_mgpu, w4a16_mgpu_matmul, x_rows


E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])


def _numpy_weight(q, s, z, group, g_idx=None, lut="int4", gs=None):
    """``(q − z)·s`` (int4; z = 8 for uint4b8), ``E2M1[q]·s·gs`` or ``TABLE[q]·s`` (NF4, bnb FP4)
    in float64, rows in the checkpoint's order."""
    k = q.shape[0]
    rows = np.asarray(g_idx) if g_idx is not None else np.arange(k) // (k if group == -1 else group)
    if lut != "int4":
        values = {"e2m1": E2M1, "nf4": NF4, "fp4_bnb": FP4_BNB}[lut].astype(np.float64)[q]
    else:
        values = q.astype(np.float64) - (8.0 if z is None else np.asarray(z, np.float64)[rows])
    return values * np.asarray(s, np.float64)[rows] * (1.0 if gs is None else gs)


def _primitives(jaxpr) -> set[str]:
    """Every primitive in a (closed) jaxpr, nested jits included."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    names = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        for v in eqn.params.values():
            if hasattr(v, "eqns") or hasattr(getattr(v, "jaxpr", None), "eqns"):
                names |= _primitives(v)
    return names


def _rel_err(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return np.linalg.norm(out - ref) / np.linalg.norm(ref)


def _weight(rng, k, n, group, zeros=None, scale="bf16", act=False):
    q, s, z = random_w4_weight(rng, k, n, group, zeros=zeros, scale_dtype=scale)
    g_idx = rng.permutation(np.arange(k) // group).astype(np.int32) if act else None
    return q, s, z, g_idx


# ---- layout and reference ------------------------------------------------------------------------
@given(k=st.integers(1, 300), n=st.integers(1, 150), group=st.sampled_from([16, 32, 64, 128, -1]),
       kind=st.sampled_from(["int4", "int4_zeros", "e2m1", "nf4", "fp4_bnb"]),
       seed=st.integers(0, 2**16))
def test_nk_layout_dequantizes_exactly_any_shape(k, n, group, kind, seed):
    rng = np.random.default_rng(seed)
    zeros = "int" if kind == "int4_zeros" else None
    lut = "int4" if kind.startswith("int4") else kind
    q, s, z, _ = _weight(rng, k, n, group, zeros, scale="f32")
    packed = prepack_nk(q, s, z, group_size=group, lut=lut)
    assert packed.k_pad % 64 == 0 and packed.n_pad % 128 == 0 and packed.data.dtype == jnp.int4
    w = np.asarray(dequantize_nk(packed))
    np.testing.assert_allclose(w[:k, :n], _numpy_weight(q, s, z, group, lut=lut), rtol=1e-6,
                               atol=1e-7)
    assert not w[:, n:].any()                              # padded columns: scale 0
    assert not w[k:].any()                                 # padded rows: code 8 or the zero point


@pytest.mark.parametrize("top,k", [(448.0, 8), (2.0, 0), (0.01, 0), (0.0, 0)])
def test_e2m1_scales_carry_the_decode_unscale(top, k):
    """E2M1 scales are stored times 2^(126 − k), inside bf16, the global scale times 2^k, so
    the weight is unchanged; under jit too (k from traced scales)."""
    rng = np.random.default_rng(2)
    q = rng.integers(0, 16, (64, 128))
    s = (rng.uniform(0.25, 1.0, (4, 128)) * top).astype(ml_dtypes.float8_e4m3fn)
    s[0, 0] = np.float32(top)
    for packed in (prepack_nk(q, s, group_size=16, lut="e2m1", global_scale=0.5),
                   jax.jit(lambda s: prepack_nk(q, s, group_size=16, lut="e2m1",
                                                global_scale=0.5))(s)):
        assert packed.scale.dtype == jnp.bfloat16 and np.isfinite(np.asarray(packed.scale,
                                                                              np.float32)).all()
        np.testing.assert_array_equal(np.asarray(packed.global_scale), [0.5 * 2.0 ** k])
        np.testing.assert_array_equal(np.asarray(packed.scale[:4, :128], np.float32),
                                      np.ldexp(s.astype(np.float32), 126 - k))
        w = np.asarray(dequantize_nk(packed))[:64, :128]
        np.testing.assert_array_equal(w, _numpy_weight(q, s.astype(np.float32), None, 16,
                                                       lut="e2m1", gs=0.5).astype(np.float32))


def test_reference_matches_numpy_with_act_order_and_fp16_scales():
    rng = np.random.default_rng(1)
    q, s, z, g_idx = _weight(rng, 256, 72, 64, zeros="int", scale="f16", act=True)
    packed = prepack_nk(q, s, z, group_size=64, g_idx=g_idx)
    x = rng.standard_normal((3, 256)).astype(np.float32)
    want = x @ _numpy_weight(q, s, z, 64, g_idx)
    assert _rel_err(reference_nk(jnp.asarray(x), packed), want) < 1e-6


# ---- the kernel in interpret mode ----------------------------------------------------------------
CASES = [  # k, n, group, zeros (or a code book: "e2m1", "nf4", "fp4_bnb"), scale, act-order, m,
           # x dtype, bias, launch
    (512, 256, 128, None, "bf16", False, 1, jnp.bfloat16, False, None),
    (576, 200, 64, "int", "f16", False, 5, jnp.float16, True, None),      # N, K off the tiles
    (1000, 130, -1, None, "f32", False, 20,  jnp.bfloat16, False,          # per-channel, 3 M tiles
     MgpuConfig(block_n=64, block_k=64, block_m=8, split_k=1, max_concurrent_steps=3)),
    (512, 128, 128, None, "bf16", True, 16, jnp.bfloat16, True,           # act-order, split-K 2
     MgpuConfig(block_n=128, block_k=128, block_m=16, split_k=2, max_concurrent_steps=2)),
    (1024, 64, 256, "int", "bf16", False, 3, jnp.float16, False,          # groups span 2 steps
     MgpuConfig(block_n=64, block_k=128, block_m=8, split_k=2, max_concurrent_steps=2)),
    (512, 192, 32, "e2m1", "e8m0", False, 2, jnp.bfloat16, False, None),   # MXFP4
    (320, 130, 16, "e2m1", "e4m3", False, 9, jnp.float16, True,            # NVFP4, global scale
     MgpuConfig(block_n=64, block_k=64, block_m=16, split_k=1, max_concurrent_steps=2)),
    (512, 256, 128, "int", "bf16", False, 20, jnp.bfloat16, True,         # warp-specialized
     MgpuConfig(block_n=128, block_k=128, block_m=8, split_k=2, max_concurrent_steps=2,
                compute_wgs=2)),
    (512, 200, 32, "e2m1", "e8m0", False, 3, jnp.bfloat16, False,         # WS, MXFP4, 256 rows
     MgpuConfig(block_n=256, block_k=128, block_m=8, split_k=1, max_concurrent_steps=3,
                compute_wgs=2)),
    (768, 130, 64, "int", "f16", True, 11, jnp.float16, True,             # fp32 group scaling,
     MgpuConfig(block_n=64, block_k=128, block_m=16, split_k=2, max_concurrent_steps=2,  # 2 per
                group_acc=True)),                                          # step, zeros, act
    (512, 256, 128, None, "bf16", False, 1, jnp.bfloat16, False,          # bf16 weight scaling
     MgpuConfig(block_n=64, block_k=256, block_m=8, split_k=2, max_concurrent_steps=2)),
    (1024, 200, 128, "int", "bf16", False, 3, jnp.bfloat16, True,         # 128-byte rows, two
     MgpuConfig(block_n=64, block_k=512, block_m=8, split_k=1, max_concurrent_steps=2,  # spans
                group_acc=True, wide_rows=True)),                          # a step, zeros
    (512, 192, 32, "e2m1", "e8m0", False, 4, jnp.bfloat16, False,         # 64-byte rows, MXFP4
     MgpuConfig(block_n=64, block_k=128, block_m=8, split_k=2, max_concurrent_steps=2,
                wide_rows=True)),
    (512, 130, 64, "nf4", "f32", False, 1, jnp.bfloat16, True, None),      # NF4, default launch
    (320, 200, 64, "nf4", "f32", True, 24, jnp.float16, False, None),      # NF4, fp16, act-order
    (384, 100, 64, "fp4_bnb", "f32", False, 2, jnp.float16, False, None),  # bnb FP4, fp16
    (512, 130, 64, "e2m1", "e8m0", False, 2, jnp.bfloat16, False,         # FP4 on a per-group
     MgpuConfig(block_n=64, block_k=128, block_m=8, split_k=2, max_concurrent_steps=2,  # fp32
                group_acc=True)),                                          # accumulator
    (512, 256, 64, "nf4", "f32", False, 5, jnp.bfloat16, False,           # WS, NF4
     MgpuConfig(block_n=256, block_k=128, block_m=8, split_k=1, max_concurrent_steps=2,
                compute_wgs=2)),
    # The kernel's own final output: split-K summed inside a cluster, bias and global scale
    # applied in the kernel, the [M, N] tile stored transposed.
    (512, 256, 128, None, "bf16", False, 1, jnp.bfloat16, True,           # cluster of 4
     MgpuConfig(block_n=64, block_k=128, block_m=8, split_k=4, max_concurrent_steps=2,
                group_acc=True, wide_rows=True, final_output=True)),
    (320, 130, 16, "e2m1", "e4m3", False, 9, jnp.float16, True,            # NVFP4, cluster of
     MgpuConfig(block_n=64, block_k=64, block_m=16, split_k=5, max_concurrent_steps=2,  # 5,
                final_output=True)),                                       # N_pad columns
    (576, 200, 64, "int", "f16", True, 20, jnp.float16, False,            # 3 M tiles, act,
     MgpuConfig(block_n=64, block_k=64, block_m=8, split_k=3, max_concurrent_steps=2,  # zeros,
                wide_rows=True, final_output=True)),                       # N = 200 columns
    (512, 130, 64, "nf4", "f32", False, 3, jnp.bfloat16, True,            # NF4, no split
     MgpuConfig(block_n=64, block_k=128, block_m=8, split_k=1, max_concurrent_steps=2,
                final_output=True)),
    (512, 256, 128, "int", "bf16", True, 20, jnp.bfloat16, True,          # warp-specialized,
     MgpuConfig(block_n=256, block_k=128, block_m=8, split_k=1, max_concurrent_steps=2,  # each
                compute_wgs=2, final_output=True)),                        # WG its columns
    (320, 200, 16, "e2m1", "e4m3", False, 9, jnp.float16, True,            # WS, NVFP4, N_pad
     MgpuConfig(block_n=256, block_k=64, block_m=16, split_k=1, max_concurrent_steps=2,  # cols,
                compute_wgs=2, final_output=True)),                        # 2 M tiles
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_kernel_matches_numpy_and_reference(case):
    _check_case(case, word_order=True)


# zeros and fp16, MXFP4, MXFP4 with 64-byte rows, NF4, FP4 with group_acc, WS with NF4
@pytest.mark.parametrize("case", [1, 5, 12, 13, 16, 17])
def test_kernel_reads_weights_in_k_order(case):
    """Weights stored in K order (a byte load per pair of codes) give the same results."""
    _check_case(case, word_order=False)


def _check_case(case, word_order):
    k, n, group, zeros, scale, act, m, x_dtype, bias, cfg = CASES[case]
    rng = np.random.default_rng(10 + case)
    lut = zeros if zeros in ("e2m1", "nf4", "fp4_bnb") else "int4"
    q, s, z, g_idx = _weight(rng, k, n, group, None if lut != "int4" else zeros, scale, act)
    gs = 0.03 if scale == "e4m3" else None
    packed = prepack_nk(q, s, z, group_size=group, g_idx=g_idx, lut=lut, global_scale=gs,
                        word_order=word_order)
    assert packed.word_order == word_order
    x = jnp.asarray(rng.standard_normal((m, k)), x_dtype)
    b = jnp.asarray(rng.standard_normal(n), jnp.float32) if bias else None
    # Interpret mode starts every output buffer as NaN, so a tile the kernel never wrote shows.
    out = w4a16_matmul(x, packed, bias=b, impl="mgpu", config=cfg, interpret=True)
    assert out.shape == (m, n) and out.dtype == x_dtype
    assert np.isfinite(np.asarray(out, np.float32)).all()
    want = np.asarray(x, np.float64) @ _numpy_weight(q, s, z, group, g_idx, lut, gs)
    if bias:
        want = want + np.asarray(b, np.float64)
    assert _rel_err(out, want) <= 1e-2
    assert _rel_err(out, reference_nk(x, packed, b)) <= 1e-2


def test_final_output_is_the_whole_call():
    """With ``final_output`` the kernel's result is the answer: no XLA op sums, transposes,
    scales or casts after it (where x needs no padding and N's rows meet the TMA stride)."""
    rng = np.random.default_rng(7)
    q, s, _, _ = _weight(rng, 512, 256, 32, zeros=None, scale="e8m0")
    packed = prepack_nk(q, s, group_size=32, lut="e2m1", global_scale=0.5)
    cfg = MgpuConfig(block_n=64, block_k=128, block_m=8, split_k=2, max_concurrent_steps=2,
                     final_output=True)
    x = jnp.asarray(rng.standard_normal((1, 512)), jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal(256), jnp.bfloat16)
    def top_level_ops(cfg):   # traced as for the GPU: the kernel is one op, whatever wraps it
        return [e.primitive.name for e in jax.make_jaxpr(
            lambda x, p, b: w4a16_mgpu_matmul(x, p, b, config=cfg))(x, packed, b).eqns]
    assert len(top_level_ops(cfg)) == 1
    assert "reduce_sum" in top_level_ops(dataclasses.replace(cfg, final_output=False))
    out = w4a16_matmul(x, packed, bias=b, impl="mgpu", config=cfg, interpret=True)
    want = (np.asarray(x, np.float64) @ _numpy_weight(q, s, None, 32, lut="e2m1", gs=0.5)
            + np.asarray(b, np.float64))
    assert out.dtype == jnp.bfloat16 and _rel_err(out, want) <= 1e-2


@pytest.mark.parametrize("final_output", [False, True])
def test_x_goes_to_the_kernel_unpadded(final_output):
    """K = 576 with groups of 128 pads the weight to K_pad = 640, but x stays [1, 576]: the copy
    fills columns past K with zeros (the padded rows are made nonzero here, so anything else shows),
    and no XLA op runs before the kernel."""
    rng = np.random.default_rng(8)
    q, s, z, _ = _weight(rng, 576, 128, 128, zeros="int")
    packed = prepack_nk(q, s, z, group_size=128)
    assert packed.k_pad == 640
    # Stored columns 576-639 are whole 32-code word blocks, so they are the padded rows in word order too.
    packed = dataclasses.replace(packed, data=packed.data.at[:, 576:].set(jnp.int4(-5)))
    assert np.abs(np.asarray(dequantize_nk(packed))[576:]).max() > 0
    cfg = MgpuConfig(block_n=64, block_k=128, block_m=8, split_k=1, max_concurrent_steps=2,
                     final_output=final_output)
    x = jnp.asarray(rng.standard_normal((1, 576)), jnp.bfloat16)
    jaxpr = jax.make_jaxpr(lambda x, p: w4a16_mgpu_matmul(x, p, config=cfg))(x, packed)
    assert "pad" not in _primitives(jaxpr)
    assert len(jaxpr.eqns) == 1 if final_output else len(jaxpr.eqns) > 1
    out = w4a16_matmul(x, packed, impl="mgpu", config=cfg, interpret=True)
    want = np.asarray(x, np.float64) @ _numpy_weight(q, s, z, 128)
    assert _rel_err(out, want) <= 1e-2


def test_kernel_writes_every_partial():
    """The raw split-K partials (before XLA sums them) are all finite: no CTA skipped a tile."""
    rng = np.random.default_rng(3)
    q, s, _, _ = _weight(rng, 512, 256, 128)
    packed = prepack_nk(q, s, group_size=128)
    cfg = MgpuConfig(block_n=64, block_k=128, block_m=8, split_k=2, max_concurrent_steps=2)
    xs = jnp.asarray(rng.standard_normal((16, 512)), jnp.bfloat16)
    parts = w4a16_mgpu(xs, packed, config=cfg, interpret=True)
    assert parts.shape == (2, 256, 16) and np.isfinite(np.asarray(parts)).all()
    want = np.asarray(xs, np.float64) @ _numpy_weight(q, s, None, 128)
    assert _rel_err(np.asarray(parts).sum(0).T, want) <= 1e-2


@pytest.mark.parametrize("group_acc", [False, True])
def test_x_rows_past_m_read_as_zeros(group_acc):
    """x is not padded along M: the copy fills the last tile's rows past M with zeros (TMA's
    out-of-bounds fill; interpret mode, whose fresh buffers are NaN, does the same)."""
    rng = np.random.default_rng(6)
    q, s, _, _ = _weight(rng, 512, 128, 128)
    packed = prepack_nk(q, s, group_size=128)
    cfg = MgpuConfig(block_n=64, block_k=256, block_m=16, split_k=1, max_concurrent_steps=2,
                     group_acc=group_acc)
    xs = jnp.asarray(rng.standard_normal((3, 512)), jnp.bfloat16)
    parts = np.asarray(w4a16_mgpu(xs, packed, config=cfg, interpret=True))
    assert parts.shape == (1, 128, 16)
    np.testing.assert_array_equal(parts[:, :, 3:], 0.0)
    want = np.asarray(xs, np.float64) @ _numpy_weight(q, s, None, 128)
    assert _rel_err(parts[0, :, :3].T, want) <= 1e-2


class TestUnderJit(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_batch_dims(self):
        rng = np.random.default_rng(4)
        q, s, z, _ = _weight(rng, 256, 128, 128, zeros="int")
        packed = prepack_nk(q, s, z, group_size=128)
        x = jnp.asarray(rng.standard_normal((2, 3, 256)), jnp.bfloat16)
        fn = self.variant(lambda x, p: w4a16_matmul(x, p, impl="mgpu", interpret=True))
        out = fn(x, packed)
        assert out.shape == (2, 3, 128)
        chex.assert_trees_all_close(out.astype(jnp.float32),
                                    reference_nk(x.reshape(6, 256), packed).reshape(2, 3, 128)
                                    .astype(jnp.float32), rtol=2e-2, atol=2e-2)


# ---- lowering for the GPU (what interpret mode cannot check) --------------------------------------
@pytest.mark.parametrize("m,cfg,lut,group", [
    (1, None, "int4", 128), (16, None, "int4", 128), (100, None, "int4", 128),
    (8, MgpuConfig(block_n=128, block_k=64, block_m=8, split_k=1, max_concurrent_steps=4),
     "int4", 128),
    (1, None, "e2m1", 32), (16, None, "e2m1", 16), (1, None, "nf4", 64), (64, None, "nf4", 64),
    (128, MgpuConfig(block_n=256, block_k=128, block_m=128, split_k=1, max_concurrent_steps=3,
                     compute_wgs=2), "int4", 128),
    (1, MgpuConfig(block_n=64, block_k=512, block_m=8, split_k=1, max_concurrent_steps=2,
                   group_acc=True, wide_rows=True), "int4", 128),
    (4, MgpuConfig(block_n=64, block_k=128, block_m=8, split_k=2, max_concurrent_steps=4,
                   wide_rows=True), "e2m1", 32),
    (128, MgpuConfig(block_n=256, block_k=128, block_m=128, split_k=1, max_concurrent_steps=3,
                     compute_wgs=2, wide_rows=True), "int4", 128),
    (1, MgpuConfig(block_n=64, block_k=256, block_m=8, split_k=4, max_concurrent_steps=3,
                   group_acc=True, wide_rows=True, final_output=True), "int4", 128),
    (16, MgpuConfig(block_n=64, block_k=64, block_m=16, split_k=8, max_concurrent_steps=2,
                    wide_rows=True, final_output=True), "e2m1", 16),
    (33, MgpuConfig(block_n=128, block_k=128, block_m=16, split_k=2, max_concurrent_steps=3,
                    wide_rows=True, final_output=True), "nf4", 64),
    (100, MgpuConfig(block_n=256, block_k=64, block_m=104, split_k=1, max_concurrent_steps=4,
                     compute_wgs=2, final_output=True), "int4", 128)])
def test_kernel_lowers_for_sm90(m, cfg, lut, group):
    """Exporting for CUDA runs Mosaic GPU's own lowering (layout inference, the register-operand
    wgmma that interpret mode replaces by a shared-memory one, TMA descriptors) on this CPU."""
    rng = np.random.default_rng(5)
    q, s, z, _ = _weight(rng, 1024, 256, group, zeros="int" if m == 16 and lut == "int4" else None)
    packed = prepack_nk(q, s, z, group_size=group, lut=lut)
    cfg = cfg or default_mgpu_config(m, packed)
    xs = jnp.zeros((x_rows(m), packed.k_pad), jnp.bfloat16)
    exported = jax.export.export(jax.jit(lambda x, p: w4a16_mgpu(x, p, config=cfg)),
                                 platforms=["cuda"])(xs, packed)
    module = exported.mlir_module()
    assert "mosaic_gpu" in module
    # Split-K partials meet through distributed shared memory behind cluster barriers.
    assert ("barrier.cluster.arrive" in module) == (cfg.final_output and cfg.split_k > 1)
    if cfg.final_output:
        assert exported.out_avals[0].shape == (xs.shape[0], packed.n)


@pytest.mark.parametrize("k,group", [(576, 128), (1000, -1)])
def test_unpadded_x_lowers_for_sm90(k, group):
    """x stops at K (576: K_pad 640) where the swizzle tiling allows it; K = 1000 is padded by
    the wrapper (unpadded, Mosaic GPU refuses its TMA descriptor: found on the H200)."""
    rng = np.random.default_rng(5)
    q, s, _, _ = _weight(rng, k, 256, group)
    packed = prepack_nk(q, s, group_size=group)
    fn = jax.jit(lambda x, p: w4a16_mgpu_matmul(x, p))
    exported = jax.export.export(fn, platforms=["cuda"])(jnp.zeros((1, k), jnp.bfloat16), packed)
    assert "mosaic_gpu" in exported.mlir_module()
    jaxpr = jax.make_jaxpr(fn)(jnp.zeros((1, k), jnp.bfloat16), packed)
    assert ("pad" in _primitives(jaxpr)) == (k % 64 != 0)


@pytest.mark.parametrize("lut,x_dtype,compute_wgs,word_order", [
    ("e2m1", jnp.bfloat16, 1, True), ("e2m1", jnp.float16, 1, True),
    ("e2m1", jnp.float16, 2, True), ("nf4", jnp.bfloat16, 1, True), ("nf4", jnp.float16, 2, True),
    ("int4", jnp.bfloat16, 1, True), ("int4", jnp.float16, 2, True),
    ("e2m1", jnp.bfloat16, 1, False), ("nf4", jnp.float16, 2, False),
    ("e2m1", jnp.bfloat16, 0, True), ("e2m1", jnp.float16, 0, False)])   # 0: 1 WG, group_acc
def test_decodes_lower_with_their_inline_ptx(lut, x_dtype, compute_wgs, word_order):
    """The inline-PTX decodes (which interpret mode replaces by XLA twins) are in the lowered
    kernels, both kernels, both activation dtypes, both weight orders; int4 in K order is Mosaic
    GPU's own conversion. E2M1 leaves its unscale to the scale multiply, except where the
    scales go on a per-group accumulator."""
    rng = np.random.default_rng(6)
    q, s, _, _ = _weight(rng, 512, 256, 64, zeros=None)
    packed = prepack_nk(q, s, group_size=64, lut=lut, word_order=word_order)
    group_acc = compute_wgs == 0
    compute_wgs = max(compute_wgs, 1)
    cfg = MgpuConfig(block_n=64 * compute_wgs, block_k=256, block_m=8, split_k=2,
                     max_concurrent_steps=2, compute_wgs=compute_wgs, wide_rows=True,
                     group_acc=group_acc)
    xs = jnp.zeros((1, packed.k_pad), x_dtype)
    module = jax.export.export(jax.jit(lambda x, p: w4a16_mgpu(x, p, config=cfg)),
                               platforms=["cuda"])(xs, packed).mlir_module()
    if lut == "nf4":
        assert "prmt.b32 $0, l, h, 0x5140" in module
        assert ("prmt.b32 $3, l, h, 0x7362" in module) == word_order   # 4 registers a call
    elif lut == "int4":
        assert "lop3.b32 t, $4, 0x000f000f, m, 0x6a" in module
    else:
        unscale = "mul.rn.bf16x2" if x_dtype == jnp.bfloat16 else "mul.rn.f16x2"
        assert "mul.lo.u32" in module and (unscale in module) == group_acc


# ---- defaults, dispatch, bad input ---------------------------------------------------------------
@pytest.mark.parametrize("n,k,group", [(28672, 8192, 128), (8192, 28672, 128), (1536, 576, 64),
                                       (4096, 4096, -1), (512, 1000, 256)])
@pytest.mark.parametrize("m", [1, 4, 16, 33, 64, 128, 1024])
def test_default_configs_are_valid_launches(n, k, group, m):
    groups = 1 if group == -1 else -(-k // group)
    packed = prepack_nk(np.zeros((k, n), np.uint8), np.ones((groups, n), np.float32),
                        group_size=group)
    cfg = default_mgpu_config(m, packed)
    xs = jax.ShapeDtypeStruct((x_rows(m), packed.k_pad), jnp.bfloat16)
    out = jax.eval_shape(lambda x, p: w4a16_mgpu(x, p, config=cfg), xs, packed)  # runs the checks
    # Every default launch writes the answer itself, split-K ≤ 2 in one cluster.
    assert cfg.final_output and cfg.split_k <= (2 if cfg.compute_wgs == 1 else 1)
    assert out.shape == (x_rows(m), packed.n)
    # Scales go on a per-group fp32 accumulator for small M wherever the launch allows it.
    g = packed.group_size
    assert cfg.group_acc == (cfg.compute_wgs == 1 and cfg.block_m <= 16 and g % 64 == 0
                             and cfg.block_k % g == 0)
    # One-warpgroup launches stage the weight in 128-byte rows (the warp-specialized ones step
    # 64 codes at a time, where there is one row width only).
    assert cfg.wide_rows == (cfg.compute_wgs == 1)


@pytest.mark.parametrize("n,k,m,split,final", [
    (28672, 8192, 1, 2, True), (8192, 8192, 16, 2, True),     # decode: split 2, a cluster
    (1536, 576, 1, 1, True),                                   # K too short to split
    (28672, 8192, 32, 1, True),                                # 224 tiles of 128 × 32
    (8192, 8192, 32, 2, True),                                 # 128 tiles of 64 × 32
    (8192, 28672, 64, 2, True), (8192, 8192, 128, 2, True),    # 64 tiles
    (8192, 8192, 256, 1, True), (8192, 28672, 256, 1, True),   # 128 tiles of 128 × 128
    (28672, 8192, 128, 1, True)])                              # warp-specialized
def test_default_split_and_output(n, k, m, split, final):
    """The measured rule (docs/design/w4a16.md, "Launch heuristic"): split-K 1 from ~1.5 tiles
    per SM (or one 128 × 128 tile per SM), else 2, and always the kernel's own output."""
    packed = prepack_nk(np.zeros((k, n), np.uint8), np.ones((k // 64, n), np.float32),
                        group_size=64)
    cfg = default_mgpu_config(m, packed)
    assert (cfg.split_k, cfg.final_output) == (split, final)


def test_dispatch_by_device_and_m(monkeypatch):
    assert resolve_impl("auto", 1) == "reference"                        # this CPU
    assert resolve_impl("auto", 1, interpret=True) == "mgpu"
    monkeypatch.setattr(dispatch, "compute_capability", lambda: 90)
    assert resolve_impl("auto", 1) == "mgpu"
    assert resolve_impl("auto", MGPU_MAX_M) == "mgpu"
    assert resolve_impl("auto", MGPU_MAX_M + 1) == "xla"
    small = dict(weight_elems=4096 * 4096)                               # launch-bound past M=128
    assert resolve_impl("auto", 128, **small) == "mgpu"
    assert resolve_impl("auto", 129, **small) == "xla"
    monkeypatch.setattr(dispatch, "compute_capability", lambda: 100)     # no wgmma on Blackwell
    assert resolve_impl("auto", 1) == "xla"
    dispatch._warned.discard("w4a16:100")
    with pytest.warns(RuntimeWarning, match="cannot run on compute capability 100"):
        assert resolve_impl("mgpu", 1) == "xla"
    with pytest.raises(ValueError, match="needs a Hopper GPU"):
        resolve_impl("pallas", 1)


def test_fp32_x_and_config_mismatches_are_errors():
    rng = np.random.default_rng(6)
    q, s, _, _ = _weight(rng, 256, 64, 128)
    nk = prepack_nk(q, s, group_size=128)
    x = jnp.ones((1, 256), jnp.bfloat16)
    with pytest.raises(TypeError, match="takes bf16 or fp16 x; got float32 x of shape"):
        w4a16_matmul(x.astype(jnp.float32), nk, impl="mgpu", interpret=True)
    out = w4a16_matmul(x.astype(jnp.float32), nk)                        # auto keeps fp32 exact
    assert out.dtype == jnp.float32
    with pytest.raises(TypeError, match="must be an MgpuConfig"):
        w4a16_matmul(x, nk, impl="mgpu", interpret=True, config=dataclasses.asdict(MgpuConfig()))


@pytest.mark.parametrize("cfg,match", [
    (MgpuConfig(block_n=96), "block_n=96 must be a multiple of 64"),
    (MgpuConfig(block_m=12), "block_m=12 must be a multiple of 8"),
    (MgpuConfig(block_k=96), "block_k=96"),
    (MgpuConfig(block_k=256, split_k=4), "split_k=4 must tile K_pad=512"),
    (MgpuConfig(block_k=512, max_concurrent_steps=1), "max_concurrent_steps=1 must be ≥ 2"),
    (MgpuConfig(compute_wgs=3), "compute_wgs=3 must be 1 or 2"),
    (MgpuConfig(block_n=64, compute_wgs=2), "block_n=64 must be a multiple of 64·compute_wgs"),
    (MgpuConfig(block_k=64, group_acc=True), "group_acc needs .* dividing block_k=64"),
    (MgpuConfig(block_n=128, compute_wgs=2, group_acc=True), "group_acc needs one compute warpgroup"),
    (MgpuConfig(block_n=128, block_k=128, split_k=2, compute_wgs=2, final_output=True),
     "final_output needs split_k ≤ 8 .* split_k = 1 with two; got compute_wgs=2, split_k=2"),
    (MgpuConfig(block_k=64, split_k=16, block_n=64, final_output=True),
     "final_output needs .* split_k=16"),
])
def test_bad_launches_name_the_parameter(cfg, match):
    rng = np.random.default_rng(7)
    q, s, _, _ = _weight(rng, 512, 128, 128)
    packed = prepack_nk(q, s, group_size=128)
    with pytest.raises(ValueError, match=match):
        w4a16_mgpu(jnp.ones((8, 512), jnp.bfloat16), packed, config=cfg, interpret=True)


def test_group_that_does_not_fit_the_step_is_refused():
    rng = np.random.default_rng(8)
    q, s, _, _ = _weight(rng, 384, 128, 192)
    packed = prepack_nk(q, s, group_size=192)
    cfg = MgpuConfig(block_k=128, block_m=8)
    with pytest.raises(ValueError, match="group_size=192 must be 16, 32 or a multiple of 64 that divides"):
        w4a16_mgpu(jnp.ones((8, packed.k_pad), jnp.bfloat16), packed, config=cfg, interpret=True)
    with pytest.raises(ValueError, match=r"xs has shape \(12, 384\); expected .* M a multiple of 8"):
        w4a16_mgpu(jnp.ones((12, packed.k_pad), jnp.bfloat16), packed,
                   config=dataclasses.replace(cfg, block_k=64), interpret=True)
    with pytest.raises(ValueError, match=r"xs has shape \(8, 320\); expected \[M, K_pad=384\] or "
                       r"\[M, K=384\]"):
        w4a16_mgpu(jnp.ones((8, 320), jnp.bfloat16), packed,
                   config=dataclasses.replace(cfg, block_k=64), interpret=True)
    q, s, _, _ = _weight(rng, 1000, 128, -1)
    odd = prepack_nk(q, s, group_size=-1)   # K = 1000 breaks the x tile's 64-column tiling
    with pytest.raises(ValueError, match=r"xs has shape \(8, 1000\).*K=1000\] \(a multiple of 64\)"):
        w4a16_mgpu(jnp.ones((8, 1000), jnp.bfloat16), odd,
                   config=dataclasses.replace(cfg, block_k=64), interpret=True)
    out = w4a16_matmul(jnp.ones((2, 1000), jnp.bfloat16), odd, impl="mgpu", interpret=True)
    assert np.isfinite(np.asarray(out, np.float32)).all()   # the wrapper pads x for it
    with pytest.raises(TypeError, match="xs must be bf16 or fp16"):
        w4a16_mgpu(jnp.ones((8, packed.k_pad), jnp.float32), packed,
                   config=dataclasses.replace(cfg, block_k=64), interpret=True)


def test_bias_in_the_kernel_is_checked():
    rng = np.random.default_rng(9)
    q, s, _, _ = _weight(rng, 256, 128, 128)
    packed = prepack_nk(q, s, group_size=128)
    xs = jnp.ones((1, 256), jnp.bfloat16)
    cfg = MgpuConfig(block_n=64, block_k=64, block_m=8, split_k=2, max_concurrent_steps=2)
    with pytest.raises(ValueError, match="bias goes to the kernel only with .*final_output"):
        w4a16_mgpu(xs, packed, config=cfg, bias=jnp.ones(128), interpret=True)
    final = dataclasses.replace(cfg, final_output=True)
    with pytest.raises(ValueError, match=r"bias has shape \(100,\); expected \(128,\)"):
        w4a16_mgpu(xs, packed, config=final, bias=jnp.ones(100), interpret=True)
    with pytest.raises(TypeError, match="bias must be a float array, got int32"):
        w4a16_mgpu(xs, packed, config=final, bias=jnp.ones(128, jnp.int32), interpret=True)


def test_prepack_nk_rejects_what_the_kernel_cannot_run():
    q = np.zeros((256, 64), np.uint8)
    s = np.ones((2, 64), np.float32)
    with pytest.raises(ValueError, match="group_size 16, 32, a multiple of 64.*Scheme.apply"):
        prepack_nk(q, np.ones((6, 64), np.float32), lut="nf4", group_size=48)
    with pytest.raises(ValueError, match="lut must be one of"):
        prepack_nk(q, s, lut="nf5", group_size=128)
    with pytest.raises(ValueError, match="zero points apply to lut='int4' only"):
        prepack_nk(q, s, np.zeros((2, 64), np.uint8), lut="e2m1", group_size=128)
    with pytest.raises(ValueError, match="zero points apply to lut='int4' only, got lut='nf4'"):
        prepack_nk(q, s, np.zeros((2, 64), np.uint8), lut="nf4", group_size=128)
    with pytest.raises(ValueError, match=r"scale has shape \(3, 64\); expected \(2, 64\)"):
        prepack_nk(q, np.ones((3, 64), np.float32), group_size=128)
    with pytest.raises(ValueError, match="integer codes"):
        prepack_nk(q.astype(np.float32), s, group_size=128)


def test_config_fields_are_positive_ints():
    with pytest.raises(ValueError, match="MgpuConfig.split_k must be a positive int"):
        MgpuConfig(split_k=0)


def test_packed_nk_is_a_pytree():
    rng = np.random.default_rng(9)
    q, s, z, g_idx = _weight(rng, 256, 64, 64, zeros="int", act=True)
    packed = prepack_nk(q, s, z, group_size=64, g_idx=g_idx)
    leaves, treedef = jax.tree_util.tree_flatten(packed)
    assert len(leaves) == 4 and isinstance(jax.tree_util.tree_unflatten(treedef, leaves), PackedW4NK)
    assert packed.nbytes == packed.data.size // 2 + sum(a.nbytes for a in leaves[1:])
