"""W4A16 kernels in Pallas interpret mode (CPU) against the pure-JAX reference, and the reference
against an independent numpy dequantization."""

import dataclasses
import json
import warnings

import chex
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given

from jquant.pallas_kernels import (PackedW4, TuningConfig, dequantize_packed, lut_values, prepack,
                                   reference, resolve_impl, w4a16_matmul)
from jquant.bench.w4a16 import random_w4_weight
from jquant.pallas_kernels import w4a16 as dispatch
from jquant.formats.bnb import _FP4 as FP4_BNB_VALUES, _NF4 as NF4_VALUES   # goldens-checked
from jquant.pallas_kernels.w4a16_layout import unpack_codes

E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def _numpy_matmul(x, q, s, z, lut, group, gs=None, zero_point=None):
    """Independent dequant in the checkpoint's own row order: w = (LUT[q] - z)·s·gs, then x @ w."""
    k = q.shape[0]
    table = {"int4": np.arange(16, dtype=np.float64), "e2m1": E2M1.astype(np.float64),
             "nf4": np.asarray(NF4_VALUES, np.float64),
             "fp4_bnb": np.asarray(FP4_BNB_VALUES, np.float64)}[lut]
    g = k if group == -1 else group
    rows = np.arange(k) // g
    scale = np.asarray(s, np.float64)[rows]
    zero = (np.asarray(z, np.float64)[rows] if z is not None
            else (8.0 if lut == "int4" else 0.0) if zero_point is None else zero_point)
    w = (table[q] - zero) * scale * (1.0 if gs is None else gs)
    return np.asarray(x, np.float64) @ w


def _rel_err(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return np.linalg.norm(out - ref) / np.linalg.norm(ref)


# ---- the reference against numpy ---------------------------------------------------------------
@pytest.mark.parametrize("lut,group,asym,scale_kind,gs", [
    ("int4", 128, False, "f16", None), ("int4", 64, True, "bf16", None),
    ("int4", -1, False, "f32", None), ("e2m1", 32, False, "e8m0", None),
    ("e2m1", 16, False, "e4m3", 0.25), ("nf4", 64, False, "f32", None),
    ("fp4_bnb", 64, False, "f32", None)])
def test_reference_matches_numpy(lut, group, asym, scale_kind, gs):
    rng = np.random.default_rng(1)
    k, n = 256, 96
    q, s, z = random_w4_weight(rng, k, n, group, zeros="int" if asym else None, scale_dtype=scale_kind)
    packed = prepack(q, s, z, lut=lut, group_size=group, global_scale=gs)
    x = rng.standard_normal((3, k)).astype(np.float32)
    out = reference(jnp.asarray(x), packed)
    np.testing.assert_allclose(out, _numpy_matmul(x, q, s, z, lut, group, gs), rtol=1e-5, atol=1e-5)


def test_reference_act_order_matches_numpy_in_original_row_order():
    rng = np.random.default_rng(2)
    k, n, g = 256, 64, 64
    q, s, _ = random_w4_weight(rng, k, n, g, scale_dtype="f16")
    g_idx = rng.permutation(np.arange(k) // g).astype(np.int32)
    packed = prepack(q, s, lut="int4", group_size=g, g_idx=g_idx)
    x = rng.standard_normal((2, k)).astype(np.float32)
    w = (q.astype(np.float64) - 8) * np.asarray(s, np.float64)[g_idx]    # GPTQ: scales[g_idx[k]]
    np.testing.assert_allclose(reference(jnp.asarray(x), packed), x @ w, rtol=1e-5, atol=1e-5)


def test_lut_values_and_code_round_trip():
    np.testing.assert_array_equal(lut_values("mxfp4"), E2M1)
    np.testing.assert_array_equal(lut_values("nf4"), np.asarray(NF4_VALUES, np.float32))
    rng = np.random.default_rng(3)
    q = rng.integers(0, 16, (300, 70)).astype(np.uint8)
    packed = prepack(q, np.ones((3, 70), np.float32), lut="int4", group_size=128)
    codes = np.asarray(unpack_codes(packed))
    np.testing.assert_array_equal(codes[:300, :70], q)
    assert not codes[300:].any() and not codes[:, 70:].any()


@given(k_tiles=st.integers(1, 3), n=st.integers(1, 40), group=st.sampled_from([16, 32, 128, -1]),
       seed=st.integers(0, 2**16))
def test_packing_round_trip_any_shape(k_tiles, n, group, seed):
    rng = np.random.default_rng(seed)
    k = 64 * k_tiles + int(rng.integers(0, 64))
    q = rng.integers(0, 16, (k, n)).astype(np.uint8)
    groups = 1 if group == -1 else -(-k // group)
    s = rng.random((groups, n)).astype(np.float32) + 0.5
    packed = prepack(q, s, lut="int4", group_size=group)
    np.testing.assert_array_equal(np.asarray(unpack_codes(packed))[:k, :n], q)
    w = np.asarray(dequantize_packed(packed))[:k, :n]
    rows = np.arange(k) // (k if group == -1 else group)
    np.testing.assert_allclose(w, (q - 8.0) * s[rows], rtol=1e-6)


# ---- kernels (interpret mode) against the reference --------------------------------------------
KERNEL_CASES = [
    # (lut, group, asym, scale kind, act-order, global scale, k, n)
    ("int4", 128, False, "f16", False, None, 384, 200),
    ("int4", 128, True, "bf16", False, None, 256, 128),
    ("int4", 64, True, "f16", False, None, 320, 136),
    ("int4", 32, False, "bf16", False, None, 256, 64),
    ("int4", -1, False, "f32", False, None, 200, 72),
    ("int4", 128, False, "f16", True, None, 256, 96),
    ("e2m1", 32, False, "e8m0", False, None, 256, 130),
    ("e2m1", 16, False, "e4m3", False, 0.02, 192, 64),
    ("nf4", 64, False, "f32", False, None, 256, 80),
    ("fp4_bnb", 64, False, "f32", False, None, 256, 80),
]


@pytest.fixture(scope="module")
def packed_cases():
    rng = np.random.default_rng(4)
    out = []
    for lut, group, asym, kind, act, gs, k, n in KERNEL_CASES:
        q, s, z = random_w4_weight(rng, k, n, group, zeros="int" if asym else None, scale_dtype=kind)
        g_idx = rng.permutation(np.arange(k) // group).astype(np.int32) if act else None
        out.append(prepack(q, s, z, lut=lut, group_size=group, global_scale=gs, g_idx=g_idx))
    return out


@pytest.mark.parametrize("case", range(len(KERNEL_CASES)))
@pytest.mark.parametrize("impl,m,x_dtype,bias,variant", [
    ("gemv", 1, jnp.bfloat16, False, "base"), ("gemv", 3, jnp.float16, True, "base"),
    ("mma", 17, jnp.bfloat16, True, "base"), ("gemv", 1, jnp.bfloat16, True, "grouped"),
    ("gemv", 2, jnp.float16, False, "grouped_prefetch"), ("mma", 17, jnp.float16, True, "grouped")])
def test_kernel_matches_reference(packed_cases, case, impl, m, x_dtype, bias, variant):
    packed = packed_cases[case]
    rng = np.random.default_rng(case)
    x = jnp.asarray(rng.standard_normal((m, packed.k)), x_dtype)
    b = jnp.asarray(rng.standard_normal(packed.n), jnp.float32) if bias else None
    cfg = dispatch.default_config(impl, m, packed, variant)
    # poison: the kernel output starts as NaN, so an unwritten tile would show.
    out = w4a16_matmul(x, packed, bias=b, impl=impl, config=cfg, interpret=True, poison=True)
    ref = reference(x, packed, b)
    assert out.shape == (m, packed.n) and out.dtype == x_dtype
    assert not np.isnan(np.asarray(out, np.float32)).any()
    assert _rel_err(out, ref) <= 1e-2


@pytest.mark.parametrize("use_jit", [True, False])
def test_kernel_under_jit_split_k_and_batch_dims(use_jit):
    rng = np.random.default_rng(5)
    q, s, z = random_w4_weight(rng, 384, 200, 128, zeros="int", scale_dtype="bf16")
    tiles = dict(block_n=64, block_k=128)        # N=200 is not a tile multiple; 3 K tiles
    packed = prepack(q, s, z, lut="int4", group_size=128, config=TuningConfig(**tiles))
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 1, packed.k), jnp.bfloat16)
    ref = reference(x, packed).astype(jnp.float32)
    for cfg in (TuningConfig(**tiles, split_k=1, block_m=1), TuningConfig(**tiles, split_k=3)):
        def fn(x, p, cfg=cfg):
            return w4a16_matmul(x, p, impl="gemv", config=cfg, interpret=True, poison=True)
        out = (jax.jit(fn) if use_jit else fn)(x, packed)
        assert out.shape == (2, 1, packed.n)
        chex.assert_trees_all_close(out.astype(jnp.float32), ref, rtol=2e-2, atol=2e-2)


def test_auto_and_xla_paths_on_cpu(packed_cases):
    packed = packed_cases[1]
    x = jax.random.normal(jax.random.PRNGKey(1), (5, packed.k), jnp.bfloat16)
    ref = reference(x, packed)
    assert resolve_impl("auto", 5) == "reference"
    np.testing.assert_array_equal(np.asarray(w4a16_matmul(x, packed), np.float32),
                                  np.asarray(ref, np.float32))
    assert _rel_err(w4a16_matmul(x, packed, impl="xla"), ref) <= 1e-2
    assert resolve_impl("auto", 1, interpret=True) == "gemv"
    assert resolve_impl("auto", 64, interpret=True) == "mma"


# ---- bad inputs ------------------------------------------------------------------------------------
def test_prepack_rejects_bad_inputs():
    q = np.zeros((256, 64), np.uint8)
    s = np.ones((2, 64), np.float32)
    with pytest.raises(TypeError, match="integer codes"):
        prepack(q.astype(np.float32), s, lut="int4", group_size=128)
    with pytest.raises(ValueError, match=r"scale has shape \(3, 64\)"):
        prepack(q, np.ones((3, 64), np.float32), lut="int4", group_size=128)
    with pytest.raises(ValueError, match="lut must be one of"):
        prepack(q, s, lut="fp8", group_size=128)
    with pytest.raises(ValueError, match="zero points apply to lut='int4'"):
        prepack(q, s, np.zeros((2, 64), np.uint8), lut="nf4", group_size=128)
    with pytest.raises(ValueError, match="power of two"):
        prepack(q, np.ones((3, 64), np.float32), lut="int4", group_size=96)
    with pytest.raises(ValueError, match="non-empty"):
        prepack(np.zeros((0, 64), np.uint8), s, lut="int4", group_size=128)
    bad_g_idx = np.zeros(256, np.int32)          # all rows in group 0: not GPTQ act-order
    with pytest.raises(ValueError, match="g_idx must put exactly"):
        prepack(q, s, lut="int4", group_size=128, g_idx=bad_g_idx)


def test_matmul_rejects_bad_inputs(packed_cases):
    packed = packed_cases[1]
    with pytest.raises(TypeError, match="bf16, fp16 or fp32"):
        w4a16_matmul(jnp.ones((1, packed.k), jnp.int32), packed)
    with pytest.raises(ValueError, match=r"expected \[..., K=256\]"):
        w4a16_matmul(jnp.ones((1, 100), jnp.bfloat16), packed)
    with pytest.raises(ValueError, match="bias has shape"):
        w4a16_matmul(jnp.ones((1, packed.k), jnp.bfloat16), packed, bias=jnp.ones(3))
    with pytest.raises(ValueError, match="impl must be one of"):
        w4a16_matmul(jnp.ones((1, packed.k), jnp.bfloat16), packed, impl="cuda")
    with pytest.raises(TypeError, match="PackedW4"):
        w4a16_matmul(jnp.ones((1, packed.k), jnp.bfloat16), "weights")
    with pytest.raises(ValueError, match="differ from the packed layout"):
        w4a16_matmul(jnp.ones((1, packed.k), jnp.bfloat16), packed, impl="gemv", interpret=True,
                     config=TuningConfig(block_n=128))
    with pytest.raises(ValueError, match="at most 8 rows"):
        w4a16_matmul(jnp.ones((9, packed.k), jnp.bfloat16), packed, impl="gemv", interpret=True)
    with pytest.raises(ValueError, match="positive int"):
        TuningConfig(split_k=0)
    with pytest.raises(ValueError, match="variant must be one of"):
        TuningConfig(variant="fast")
    with pytest.raises(ValueError, match="not a mma kernel"):
        w4a16_matmul(jnp.ones((16, packed.k), jnp.bfloat16), packed, impl="mma", interpret=True,
                     config=TuningConfig(block_n=64, block_k=512, variant="grouped_prefetch"))


def test_grouped_variants_split_k_and_fractional_zeros():
    """The grouped kernels across K-tile boundaries and split-K, with fp32 (fractional) zero
    points, which they subtract per group instead of folding into the decode."""
    rng = np.random.default_rng(6)
    k, n, g = 512, 96, 64
    q = rng.integers(0, 16, (k, n)).astype(np.uint8)
    s = (rng.random((k // g, n)) * 0.02 + 0.005).astype(np.float32)
    z = (rng.random((k // g, n)) * 15).astype(np.float32)
    packed = prepack(q, s, z, lut="int4", group_size=g, config=TuningConfig(64, 128))
    for mode, m, variant in (("gemv", 1, "grouped_prefetch"), ("mma", 16, "grouped")):
        x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
        cfg = dataclasses.replace(dispatch.default_config(mode, m, packed, variant),
                                           split_k=2)
        out = w4a16_matmul(x, packed, impl=mode, config=cfg, interpret=True, poison=True)
        tol = 1e-5 if mode == "gemv" else 5e-3      # mma: fp32 x meets a tf32 dot
        assert _rel_err(out, _numpy_matmul(x, q, s, z, "int4", g)) <= tol


def test_auto_dispatch_table(tmp_path):
    assert dispatch.load_auto_rules() == dispatch.AUTO_RULES
    assert dispatch.auto_rule(1).mode == "gemv" and dispatch.auto_rule(10_000) is None
    bad = {"rules": [{"max_m": 32, "mode": "mma", "variant": "base"},
                     {"max_m": 16, "mode": "mma", "variant": "grouped"}]}
    (tmp_path / "t.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="max_m must increase"):
        dispatch.load_auto_rules(tmp_path / "t.json")
    bad["rules"] = [{"max_m": 1, "mode": "gemv", "variant": "grouped_pairs"}]
    (tmp_path / "t.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="unknown kernel"):
        dispatch.load_auto_rules(tmp_path / "t.json")


def test_forced_kernels_on_cpu_warn_once_or_raise(packed_cases):
    packed = packed_cases[1]
    x = jnp.ones((1, packed.k), jnp.bfloat16)
    with pytest.raises(ValueError, match="interpret=True"):
        w4a16_matmul(x, packed, impl="pallas")
    dispatch._warned.discard("gemv")
    with pytest.warns(RuntimeWarning, match="cannot run on cpu"):
        out = w4a16_matmul(x, packed, impl="gemv")
    np.testing.assert_array_equal(np.asarray(out, np.float32),
                                  np.asarray(reference(x, packed), np.float32))
    with warnings.catch_warnings():
        warnings.simplefilter("error")           # the second time is silent
        w4a16_matmul(x, packed, impl="gemv")


def test_packed_is_a_pytree(packed_cases):
    packed = packed_cases[5]                     # act-order: perm is a leaf
    leaves, treedef = jax.tree_util.tree_flatten(packed)
    assert len(leaves) == 3 and isinstance(jax.tree_util.tree_unflatten(treedef, leaves), PackedW4)
    assert packed.nbytes == sum(a.nbytes for a in leaves)


# ---- the kernels lower to Triton IR (no GPU needed) -------------------------------------------------
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_kernels_lower_to_triton(packed_cases, monkeypatch):
    """Interpret mode does not check Triton's rules (power-of-two tensors, supported ops); lowering
    for CUDA with a stand-in H200 description does. Skipped if JAX's private hooks move."""
    try:
        from jax._src.pallas.triton import gpu_info, pallas_call_registration
        h200 = gpu_info._get_gpu_info_impl(gpu_info.GpuVersion.H200)
        monkeypatch.setattr(pallas_call_registration.gpu_info_lib, "get_gpu_info", lambda: h200)
    except (ImportError, AttributeError) as e:
        pytest.skip(f"JAX's Triton lowering hooks moved: {e}")
    from jquant.pallas_kernels.w4a16_triton import w4a16_pallas
    checks = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    for case, mode, m, variant in (
            (1, "gemv", 1, "base"), (6, "gemv", 4, "base"), (8, "gemv", 2, "base"),
            (7, "mma", 16, "base"), (0, "gemv", 1, "grouped"), (1, "gemv", 1, "grouped_prefetch"),
            (6, "gemv", 1, "grouped_prefetch"), (8, "gemv", 1, "grouped_prefetch"),
            (1, "mma", 16, "grouped"), (7, "mma", 16, "grouped"), (0, "mma", 64, "grouped")):
        packed = packed_cases[case]
        cfg = dispatch.default_config(mode, m, packed, variant)
        x = jnp.zeros((m, packed.k_pad), jnp.bfloat16)
        fn = jax.jit(lambda x, p: w4a16_pallas(x, p, mode=mode, config=cfg))
        exported = jax.export.export(fn, platforms=["cuda"], disabled_checks=checks)(x, packed)
        assert "xla.gpu.triton" in exported.mlir_module()
