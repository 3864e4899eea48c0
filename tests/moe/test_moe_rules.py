"""quantize_params path rules reach MoE expert stacks: QExperts exactly as quantize_experts gives them,
beside QParam Dense kernels, in nested trees; unused rules and unquantizable stacks are named."""

import chex
import jax
import jax.numpy as jnp
import pytest

import jquant
from jquant.flax import QParam, quantize_params, quantized_apply
from jquant.kernels.moe import QExperts
from jquant.models.moe import MoE, quantize_experts
from test_moe_layer import CONFIGS, inputs, make_params


@pytest.fixture(scope="module")
def deepseek():
    model = MoE(**CONFIGS["deepseek-v3"])
    return model, make_params(model)


def test_rules_reach_expert_stacks_and_dense_kernels(deepseek):
    model, params = deepseek
    rules = [(r".*shared_expert/.*kernel", "int4_g32"), (r".*gate_up_proj", "fp8_e4m3_block128x128"),
             (r".*down_proj", "mxfp4")]
    qparams, report = quantize_params(params, rules, prepare=False)
    assert report.quantized == {"down_proj": "mxfp4", "gate_up_proj": "fp8_e4m3_block128x128",
                                "shared_expert/down_proj/kernel": "int4_g32",
                                "shared_expert/gate_proj/kernel": "int4_g32",
                                "shared_expert/up_proj/kernel": "int4_g32"}
    assert report.kept == () and report.unused_rules == ()
    assert isinstance(qparams["shared_expert"]["down_proj"]["kernel"], QParam)  # a Dense down_proj: QParam
    # the same stacks quantize_experts gives
    expected, _ = quantize_experts(params, [(r".*gate_up_proj", "fp8_e4m3_block128x128"), (r".*down_proj", "mxfp4")])
    for name in ("gate_up_proj", "down_proj"):
        assert isinstance(qparams[name], QExperts) and qparams[name].scheme == expected[name].scheme
        chex.assert_trees_all_equal(qparams[name], expected[name])
    # router, correction bias: untouched
    assert qparams["router_weight"] is params["router_weight"]
    assert qparams["e_score_correction_bias"] is params["e_score_correction_bias"]
    x = inputs("deepseek-v3")
    y = jax.jit(lambda p, x: quantized_apply(model, {"params": p}, x))(qparams, x)
    ref = model.apply({"params": params}, x)
    assert float(jnp.linalg.norm(y - ref)) < 0.2 * float(jnp.linalg.norm(ref))


def test_a_scheme_name_quantizes_every_candidate():
    model = MoE(**CONFIGS["gpt-oss"])
    params = {"layers_0": {"moe": make_params(model)}}
    qparams, report = quantize_params(params, "int4_g32")
    assert report.quantized == {"layers_0/moe/down_proj": "int4_g32", "layers_0/moe/gate_up_proj": "int4_g32"}
    moe = qparams["layers_0"]["moe"]
    assert all(isinstance(moe[n], QExperts) for n in ("gate_up_proj", "down_proj"))
    assert moe["gate_up_bias"] is params["layers_0"]["moe"]["gate_up_bias"]  # biases stay float
    expected, _ = quantize_experts(params, "int4_g32")
    chex.assert_trees_all_equal(qparams, expected)
    # quantized leaves are left alone by a second pass
    again, report = quantize_params(qparams, "int4_g32", strict=False)
    assert report.quantized == {} and report.unused_rules == (".*",)
    chex.assert_trees_all_equal(again, qparams)


def test_skip_and_float_rules_apply_to_expert_stacks():
    model = MoE(**CONFIGS["gpt-oss"])
    params = make_params(model)
    qparams, report = quantize_params(params, [(r"down_proj", None), (r".*", "mxfp4")], skip=(r"gate_up_proj",),
                                      strict=False)
    assert report.quantized == {} and report.kept == ("down_proj",) and report.unused_rules == (".*",)
    assert qparams["down_proj"] is params["down_proj"] and qparams["gate_up_proj"] is params["gate_up_proj"]


def test_unused_rules_and_unquantizable_stacks_are_named():
    model = MoE(**CONFIGS["gpt-oss"])
    params = make_params(model)
    with pytest.raises(ValueError, match=r"rule\(s\) \['.*experts/w1'\] matched no parameter path; candidates "
                                         r"were \['gate_up_proj', 'down_proj'\] \(2-D Dense kernels and \[E, N, K\] "
                                         r"expert stacks named gate_up_proj/down_proj\)"):
        quantize_params(params, [(r".*gate_up_proj", "mxfp4"), (r".*down_proj", None), (r".*experts/w1", "mxfp4")])
    # intermediate 32 holds no group of 128
    with pytest.raises(ValueError, match=r"parameter 'down_proj' \(8, 64, 32\) cannot be quantized with scheme "
                                         r"'int4_g128': .* not divisible by group_size 128"):
        quantize_params(params, [(r".*", "int4_g128")])
    with pytest.raises(ValueError, match="unknown scheme"):
        quantize_params(params, [(r".*gate_up_proj", "int3")])
    assert jquant.get_scheme("mxfp4").weight_only  # (the schemes above run through QExperts.apply)
