"""The grouped FP8 W8A8 GEMM (the FP8 Mosaic GPU GEMM over expert slots): interpret mode against the
experts' own XLA path (same W8A8 numerics), the MoE layer on it, sm_90 lowering on CPU, bad input."""

import dataclasses

import chex
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import ON_GPU
from cuda_lowering import lower_for_cuda
from jquant.kernels.fp8_gemm import Fp8GemmConfig
from jquant.kernels.moe import QExperts, quantize_expert_weights
from jquant.kernels.moe.grouped_fp8 import Fp8Experts, grouped_fp8, grouped_fp8_config, prepack_fp8_experts
from jquant.models.moe import MoE, quantize_experts
from jquant.schemes.scheme import get_scheme


@pytest.mark.parametrize("name,sizes", [("fp8_e4m3_block128x128", [5, 0, 70, 1]),
                                        ("fp8_e4m3_block128x128_ue8m0", [0, 76, 0, 0]),
                                        ("fp8_e4m3_block128x128", [0, 0, 0, 0])])
def test_kernel_matches_the_experts_xla_path(name, sizes, interpret):
    """Groups past one 64-row slot, empty experts, rows past the groups; experts 100× apart in scale."""
    scheme = get_scheme(name)
    rng = np.random.default_rng()
    w = rng.standard_normal((4, 256, 384)) * np.array([1e-2, 1.0, 3.0, 0.1])[:, None, None]
    q = QExperts(quantize_expert_weights(w.astype(np.float32), scheme), scheme)
    x = jnp.asarray(rng.standard_normal((80, 384)), jnp.bfloat16)
    sizes = jnp.asarray(sizes, jnp.int32)
    y = grouped_fp8(x, prepack_fp8_experts(q.weight), sizes, scheme, interpret=interpret)
    ref = np.asarray(q.apply(x, sizes), np.float32)
    y = np.asarray(y, np.float32)
    n = int(sizes.sum())
    for r in range(n):
        np.testing.assert_allclose(y[r], ref[r], atol=1e-2 * np.abs(ref[r]).max() + 1e-6, err_msg=f"row {r}")
    assert not y[n:].any()


@pytest.mark.parametrize("ctas", [0, 3], ids=["grid", "persistent"])
@pytest.mark.parametrize("name", ["fp8_e4m3_block128x128", "fp8_e4m3_channel"])
def test_two_warpgroup_slots_match_the_experts_xla_path(name, ctas, interpret):
    """128-row slots on two warpgroups (prefill's launch), in grid order and on 3 persistent CTAs: a
    group over two slots, an empty expert, a group of one partial slot, rows past the groups."""
    scheme = get_scheme(name)
    rng = np.random.default_rng()
    w = rng.standard_normal((4, 256, 256)) * np.array([1e-2, 1.0, 3.0, 0.1])[:, None, None]
    q = QExperts(quantize_expert_weights(w.astype(np.float32), scheme), scheme)
    x = jnp.asarray(rng.standard_normal((310, 256)), jnp.bfloat16)
    sizes = jnp.asarray([140, 0, 130, 30], jnp.int32)
    cfg = grouped_fp8_config(64 * 128, 64)
    assert cfg.compute_wgs == 2 and grouped_fp8_config(127 * 64, 64).compute_wgs == 1
    cfg = dataclasses.replace(cfg, persistent_ctas=ctas)
    y = np.asarray(grouped_fp8(x, prepack_fp8_experts(q.weight), sizes, scheme, config=cfg, interpret=interpret),
                   np.float32)
    ref = np.asarray(q.apply(x, sizes), np.float32)
    for r in range(300):
        np.testing.assert_allclose(y[r], ref[r], atol=1e-2 * np.abs(ref[r]).max() + 1e-6, err_msg=f"row {r}")
    assert not y[300:].any()


def test_moe_layer_on_the_kernel(interpret):
    model = MoE(num_experts=8, top_k=3, hidden=128, intermediate=128, scoring="sigmoid", n_group=4,
                topk_group=2, routed_scaling_factor=2.5)
    rng = np.random.default_rng()
    params = {"router_weight": jnp.asarray(rng.standard_normal((8, 128)) * 0.1, jnp.float32),
              "e_score_correction_bias": jnp.asarray(rng.standard_normal(8) * 0.1, jnp.float32),
              "gate_up_proj": jnp.asarray(rng.standard_normal((8, 256, 128)) * 0.1, jnp.float32),
              "down_proj": jnp.asarray(rng.standard_normal((8, 128, 128)) * 0.1, jnp.float32)}
    qparams, _ = quantize_experts(params, "fp8_e4m3_block128x128")
    fast = {k: Fp8Experts.from_qexperts(v, interpret=interpret) if isinstance(v, QExperts) else v
            for k, v in qparams.items()}
    x = jnp.asarray(rng.standard_normal((10, 128)), jnp.bfloat16)
    ref = model.apply({"params": qparams}, x).astype(jnp.float32)
    chex.assert_trees_all_close(model.apply({"params": fast}, x).astype(jnp.float32), ref,
                                atol=2e-2 * float(jnp.abs(ref).max()))


@pytest.mark.parametrize("name", ["fp8_e4m3_channel", "fp8_e4m3_tensor"])
def test_gptoss_layer_on_the_kernel_with_one_k_block(name, interpret):
    """Per-channel and per-tensor FP8 experts (what ``prepare_experts`` lays out on Hopper) in a gpt-oss
    layer: router and expert biases, the clamped SwiGLU, K = 2880 / 2 · 90 not a multiple of the tiles."""
    model = MoE(num_experts=4, top_k=2, hidden=180, intermediate=180, router_bias=True, expert_bias=True,
                activation="gptoss_swiglu")
    rng = np.random.default_rng()
    params = {"router_weight": jnp.asarray(rng.standard_normal((4, 180)) * 0.1, jnp.float32),
              "router_bias": jnp.asarray(rng.standard_normal(4) * 0.1, jnp.float32),
              "gate_up_proj": jnp.asarray(rng.standard_normal((4, 360, 180)) * 0.1, jnp.float32),
              "gate_up_bias": jnp.asarray(rng.standard_normal((4, 360)) * 0.1, jnp.float32),
              "down_proj": jnp.asarray(rng.standard_normal((4, 180, 180)) * 0.1, jnp.float32),
              "down_bias": jnp.asarray(rng.standard_normal((4, 180)) * 0.1, jnp.float32)}
    qparams, _ = quantize_experts(params, name)
    fast = {k: Fp8Experts.from_qexperts(v, interpret=interpret) if isinstance(v, QExperts) else v
            for k, v in qparams.items()}
    x = jnp.asarray(rng.standard_normal((9, 180)) * 2, jnp.bfloat16)
    ref = model.apply({"params": qparams}, x).astype(jnp.float32)
    y = model.apply({"params": fast}, x).astype(jnp.float32)
    if ON_GPU:   # wgmma's accumulator differs slightly from XLA's
        chex.assert_trees_all_close(y, ref, atol=2e-2 * float(jnp.abs(ref).max()))
    else:
        # Interpreted, the kernel's fp32 sums follow another order than XLA's CPU dots (machine-dependent:
        # on an AVX-512 Xeon 4 of 1620 outputs came out one bf16 step apart), so a bf16 output may round
        # the other way: beyond 1e-3 of the range only rare single bf16 steps.
        err = jnp.abs(y - ref)
        off = err > 1e-3 * float(jnp.abs(ref).max())
        step = 2.0 ** (jnp.floor(jnp.log2(jnp.maximum(jnp.abs(ref), 1e-30))) - 7)   # bf16 spacing at |ref|
        assert bool(jnp.all(jnp.where(off, err <= step, True))) and float(off.mean()) < 0.01, float(err.max())
    assert bool(jnp.isfinite(y).all()) and float(jnp.abs(ref).max()) > 0


@pytest.mark.skipif(ON_GPU, reason="the GPU run compiles for real")
def test_lowers_for_sm90():
    scheme = get_scheme("fp8_e4m3_block128x128")
    rng = np.random.default_rng(0)
    packed = prepack_fp8_experts(quantize_expert_weights(rng.standard_normal((4, 1024, 512)).astype(np.float32),
                                                         scheme))
    for rows in (100, 600):   # 64-row slots on one warpgroup, 128-row slots on two
        text = lower_for_cuda(lambda x, p, s: grouped_fp8(x, p, s, scheme), jnp.ones((rows, 512), jnp.bfloat16),
                              packed, jnp.array([30, 0, rows - 40, 10], jnp.int32))
        assert "mosaic_gpu" in text


def test_bad_input_names_the_problem():
    scheme = get_scheme("fp8_e4m3_block128x128")
    packed = prepack_fp8_experts(quantize_expert_weights(np.ones((2, 128, 128), np.float32), scheme))
    with pytest.raises(ValueError, match="runs W8A8 FP8 schemes"):
        grouped_fp8(jnp.ones((2, 128), jnp.bfloat16), packed, jnp.array([1, 1]), get_scheme("int4_g32"))
    with pytest.raises(ValueError, match=r"K=128"):
        grouped_fp8(jnp.ones((2, 64), jnp.bfloat16), packed, jnp.array([1, 1]), scheme)
    with pytest.raises(ValueError, match="expert slots take x as A"):
        grouped_fp8(jnp.ones((2, 128), jnp.bfloat16), packed, jnp.array([1, 1]), scheme,
                    config=Fp8GemmConfig(swap_ab=True, block_a=64, block_b=32), interpret=True)
    with pytest.raises(ValueError, match="no FP8 GEMM layout"):
        prepack_fp8_experts(quantize_expert_weights(np.ones((2, 64, 64), np.float32), "int4_g32"))


def test_bench_lays_out_each_format_for_its_kernel():
    from jquant.kernels.moe import bench
    from jquant.kernels.moe.grouped_w4a16 import W4A16Experts
    rng = np.random.default_rng()
    params = {"router_weight": jnp.ones((2, 128)), "gate_up_proj": jnp.asarray(rng.standard_normal((2, 256, 128))),
              "down_proj": jnp.asarray(rng.standard_normal((2, 128, 128)))}
    for fmt, kind in (("fp8_e4m3_block128x128", Fp8Experts), ("mxfp4", W4A16Experts)):
        out = bench.kernel_params(quantize_experts(params, fmt)[0], interpret=True)
        assert isinstance(out["gate_up_proj"], kind) and isinstance(out["down_proj"], kind)
    with pytest.raises(ValueError, match="no grouped kernel"):
        bench.kernel_params(quantize_experts(params, "int8_ch")[0])
