"""Expert checkpoints: gpt-oss MXFP4 (interleaved gate/up, against the transformers golden) and
DeepSeek-V3 block FP8, loaded into stacks and exported back bit for bit."""

import functools
import pathlib

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jquant
from jquant.checkpoint.experts import (ExpertWeights, deepseek_experts_to_tensors, deepseek_num_experts,
                                       gpt_oss_experts_to_tensors, load_deepseek_experts, load_gpt_oss_experts,
                                       load_gpt_oss_gate_up)
from moe_reference import MODULE, gpt_oss_tensors

GOLDENS = pathlib.Path(__file__).parents[1] / "goldens"


def deepseek_tensors():
    return dict(_deepseek_tensors())


@functools.cache
def _deepseek_tensors(e=2, h=256, i=128):
    rng = np.random.default_rng(1)
    out = {}
    for expert in range(e):
        for proj, shape in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
            w = rng.standard_normal(shape).astype(np.float32)
            qt = jquant.get_scheme("fp8_e4m3_block128x128").quantize_weight(w)
            for key, array in jquant.to_checkpoint(qt, "fp8-block").items():
                out[f"{MODULE}.{expert}.{proj}.{key}"] = array
    return out


def assert_same_tensors(a, b):
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        np.testing.assert_array_equal(np.ascontiguousarray(a[name]).view(np.uint8),
                                      np.ascontiguousarray(b[name]).view(np.uint8), err_msg=name)


def test_gpt_oss_deinterleave_matches_transformers_golden():
    # The golden's blocks [E, 2I=24, H/32, 16] as a gate_up_proj: transformers dequantizes them to
    # [E, H, 2I] and its GptOssExperts takes gate = [..., ::2], up = [..., 1::2].
    g = np.load(GOLDENS / "transformers_gptoss.npz")
    expected = g["dequantized_bf16"].view(ml_dtypes.bfloat16)
    tensors = {"mlp.experts.gate_up_proj_blocks": g["blocks"], "mlp.experts.gate_up_proj_scales": g["scales"]}
    gate, up, gate_bias, _ = load_gpt_oss_gate_up(tensors, dtype=jnp.bfloat16)
    assert gate.shape == up.shape == (2, 12, 128) and gate_bias is None
    for got, want in ((gate, expected[..., 0::2]), (up, expected[..., 1::2])):
        np.testing.assert_array_equal(np.asarray(got.dequantize(jnp.bfloat16)).view(np.uint16),
                                      np.ascontiguousarray(want.transpose(0, 2, 1)).view(np.uint16))


def test_gpt_oss_load_then_export_is_bit_exact():
    tensors = gpt_oss_tensors()
    weights = load_gpt_oss_experts(tensors, MODULE, dtype=jnp.bfloat16)
    assert weights.gate.shape == weights.up.shape == (3, 32, 64) and weights.down.shape == (3, 64, 32)
    assert weights.gate.fmt == "mxfp4" and weights.gate.k_axis == 2 and weights.gate.dtype == jnp.bfloat16
    # even rows are gate, odd rows up: the loaded stacks are the interleaved matrix's rows
    full = jquant.from_checkpoint({"blocks": tensors[f"{MODULE}.gate_up_proj_blocks"],
                                   "scales": tensors[f"{MODULE}.gate_up_proj_scales"]}, "gpt-oss").dequantize()
    np.testing.assert_array_equal(np.asarray(weights.gate.dequantize()), np.asarray(full[:, 0::2]))
    np.testing.assert_array_equal(np.asarray(weights.up.dequantize()), np.asarray(full[:, 1::2]))
    bias = tensors[f"{MODULE}.gate_up_proj_bias"]
    np.testing.assert_array_equal(weights.gate_bias.view(np.uint16), bias[:, 0::2].view(np.uint16))
    assert_same_tensors(gpt_oss_experts_to_tensors(weights, MODULE), tensors)


def test_gpt_oss_without_biases():
    tensors = {k: v for k, v in gpt_oss_tensors().items() if not k.endswith("_bias")}
    weights = load_gpt_oss_experts(tensors, MODULE)
    assert weights.gate_bias is None and weights.down_bias is None
    assert_same_tensors(gpt_oss_experts_to_tensors(weights, MODULE), tensors)


@pytest.mark.parametrize("change, match", [
    (lambda t: t.pop(f"{MODULE}.down_proj_scales"), r"missing tensor 'model.layers.0.mlp.experts.down_proj_scales'"),
    (lambda t: t.update({f"{MODULE}.gate_up_proj_blocks": t[f"{MODULE}.gate_up_proj_blocks"][:, :63],
                         f"{MODULE}.gate_up_proj_scales": t[f"{MODULE}.gate_up_proj_scales"][:, :63]}),
     r"'model.layers.0.mlp.experts.gate_up_proj_blocks' .* odd number of rows 63"),
    (lambda t: t.update({f"{MODULE}.down_proj_blocks": t[f"{MODULE}.down_proj_blocks"][:2],
                         f"{MODULE}.down_proj_scales": t[f"{MODULE}.down_proj_scales"][:2]}),
     r"down_proj_blocks' holds experts \(2, 64, 32\) .* expected \[E, H, I\] = \(3, 64, 32\)"),
    (lambda t: t.update({f"{MODULE}.gate_up_proj_bias": t[f"{MODULE}.gate_up_proj_bias"][:, :10]}),
     r"gate_up_proj_bias' has shape \(3, 10\), expected \(3, 64\)"),
    (lambda t: t.update({f"{MODULE}.gate_up_proj_blocks": t[f"{MODULE}.gate_up_proj_blocks"][0]}),
     r"'model.layers.0.mlp.experts.gate_up_proj_blocks' must be stacked experts \[E, N, K/32, 16\]"),
])
def test_gpt_oss_errors_name_the_tensor(change, match):
    tensors = gpt_oss_tensors()
    change(tensors)
    with pytest.raises(ValueError, match=match):
        load_gpt_oss_experts(tensors, MODULE)


def test_deepseek_load_then_export_is_bit_exact():
    tensors = deepseek_tensors()
    assert deepseek_num_experts(tensors, MODULE) == 2
    weights = load_deepseek_experts(tensors, MODULE)
    assert weights.gate.shape == (2, 128, 256) and weights.down.shape == (2, 256, 128)
    assert weights.gate.fmt == "fp8_e4m3" and weights.gate.block == (1, 128, 128) and weights.gate.k_axis == 2
    single = jquant.from_checkpoint({"weight": tensors[f"{MODULE}.1.down_proj.weight"],
                                     "weight_scale_inv": tensors[f"{MODULE}.1.down_proj.weight_scale_inv"]},
                                    "fp8-block")
    np.testing.assert_array_equal(np.asarray(weights.down.dequantize()[1]), np.asarray(single.dequantize()))
    assert_same_tensors(deepseek_experts_to_tensors(weights, MODULE), tensors)


def test_deepseek_errors_name_the_tensor():
    tensors = deepseek_tensors()
    del tensors[f"{MODULE}.1.up_proj.weight_scale_inv"]
    with pytest.raises(ValueError, match=r"missing tensor 'model.layers.0.mlp.experts.1.up_proj.weight_scale_inv'"):
        load_deepseek_experts(tensors, MODULE)
    with pytest.raises(ValueError, match=r"missing tensor 'model.layers.0.mlp.experts.2.gate_proj.weight'"):
        load_deepseek_experts(deepseek_tensors(), MODULE, num_experts=3)
    tensors = deepseek_tensors()
    tensors[f"{MODULE}.0.gate_proj.weight_scale_inv"] = tensors[f"{MODULE}.0.gate_proj.weight_scale_inv"][:, :1]
    with pytest.raises(ValueError, match=r"expert tensors \['model.layers.0.mlp.experts.0.gate_proj.weight'"):
        load_deepseek_experts(tensors, MODULE)
    with pytest.raises(ValueError, match="no expert tensors named"):
        deepseek_num_experts({"foo.weight": np.zeros(1)}, MODULE)


def test_expert_weights_check_their_shapes():
    w = load_gpt_oss_experts(gpt_oss_tensors(), MODULE)
    with pytest.raises(ValueError, match=r"gate \(3, 32, 64\), up \(3, 32, 64\) and down \(3, 32, 64\) do not fit"):
        ExpertWeights(w.gate, w.up, w.gate)
    with pytest.raises(ValueError, match=r"ExpertWeights.down_bias must have shape \(3, 64\), got \(3, 32\)"):
        ExpertWeights(w.gate, w.up, w.down, down_bias=np.zeros((3, 32)))
