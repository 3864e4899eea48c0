"""The W4A16 kernels behind the scheme registry: QTensor → kernel layout is exact, and the kernel
(interpret mode on CPU) computes what the scheme's XLA reference computes."""

import chex
import jax
import jax.numpy as jnp
import pytest

import jquant
from jquant.kernels.w4a16 import PackedW4NK, dequantize_nk, w4a16_matmul
from jquant.kernels.w4a16.from_qtensor import _prepare, _supports, prepack_for_kernels, unified_w4
from jquant.schemes.scheme import candidate_impls


def _weight(n=96, k=256):
    return jax.random.normal(jax.random.key(0), (n, k), jnp.float32)


def _unpacked(packed):
    """The kernel layout's weight as [K, N] in the original row order (padding and act-order undone)."""
    w = dequantize_nk(packed, jnp.float32)[: packed.k, : packed.n]
    return w if packed.perm is None else jnp.zeros_like(w).at[packed.perm].set(w)


SCHEMES = ["int4_g128", "int4_g128_asym", "int4_g32", "mxfp4", "nvfp4", "nf4", "nf4_dq", "fp4_bnb"]


@pytest.mark.parametrize("name", SCHEMES)
def test_kernel_layout_dequantizes_to_the_qtensor(name):
    scheme = jquant.get_scheme(name)
    qt = scheme.quantize_weight(_weight())
    packed = _prepare(scheme, qt)
    # Every one of these groups (16 … 128 along K) fits the Mosaic GPU kernel's layout.
    assert isinstance(packed, PackedW4NK) and packed.lut == unified_w4(qt)["lut"]
    chex.assert_trees_all_close(_unpacked(packed), qt.dequantize(jnp.float32).T, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["int4_g128_asym", "int4_g32", "nvfp4", "nf4_dq", "fp4_bnb"])
def test_kernel_matches_the_xla_reference(name):
    scheme = jquant.get_scheme(name)
    qt = scheme.quantize_weight(_weight())
    x = jax.random.normal(jax.random.key(1), (3, 256), jnp.bfloat16)
    want = scheme.apply(x, qt).astype(jnp.float32)
    got = w4a16_matmul(x, _prepare(scheme, qt), impl="pallas", interpret=True).astype(jnp.float32)
    # The XLA path dequantizes to bf16 before its dot, the kernel multiplies in fp32: compare norms.
    assert float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want)) < 1e-2


def test_groups_the_mosaic_kernel_cannot_step_fall_back_to_xla():
    qt = jquant.get_scheme("nf4").quantize_weight(_weight())
    args = dict(unified_w4(qt))
    args["q"], args["scale"], args["group_size"] = args["q"][:192], args["scale"][:4], 48
    assert prepack_for_kernels(args) is None


def test_act_order_group_index_carries_over():
    w = _weight()
    perm = jax.random.permutation(jax.random.key(3), 256)
    g_idx = (jnp.argsort(perm) // 64).astype(jnp.int32)  # every group still holds 64 rows
    scale = jnp.max(jnp.abs(w.reshape(96, 4, 64)), axis=-1) / 7
    from jquant.formats.integer import quantize_int_with_params

    group_scale = jnp.take(scale, jnp.arange(4), axis=1)
    qt = quantize_int_with_params(w, 4, group_scale, group_index=g_idx, axis=1)
    args = unified_w4(qt)
    assert args is not None and args["g_idx"] is qt.group_index
    packed = _prepare(jquant.get_scheme("int4_g64"), qt)
    assert packed.perm is not None
    chex.assert_trees_all_close(_unpacked(packed), qt.dequantize(jnp.float32).T, rtol=1e-6, atol=1e-6)


def test_dispatch_only_on_hopper_and_falls_back_for_straddling_blocks():
    scheme = jquant.get_scheme("nf4")
    assert _supports(scheme, 90, "gpu") and not _supports(scheme, 89, "gpu") and not _supports(scheme, 0, "cpu")
    assert not _supports(jquant.get_scheme("fp8_e4m3_channel"), 90, "gpu")
    # Blackwell has no wgmma: the scheme must not prepack for a kernel that resolve_impl then refuses.
    assert not _supports(scheme, 100, "gpu") and not _supports(scheme, 120, "gpu")
    assert [i.name for i in candidate_impls(scheme)] == ["xla"]  # this CPU
    odd = scheme.quantize_weight(jax.random.normal(jax.random.key(0), (4, 96)))  # 64-blocks straddle rows
    assert _prepare(scheme, odd) is None


@pytest.mark.parametrize("capability, want", [(90, "mgpu"), (89, "xla"), (100, "xla"), (120, "xla"), (0, "reference")])
def test_scheme_impl_and_kernel_dispatch_agree_per_architecture(monkeypatch, capability, want):
    import jquant.kernels.w4a16.api as w4a16_mod

    monkeypatch.setattr(w4a16_mod, "compute_capability", lambda device=None: capability)
    assert w4a16_mod.resolve_impl("auto", 1) == want
    assert _supports(jquant.get_scheme("int4_g128"), capability, "gpu" if capability else "cpu") == (want == "mgpu")
