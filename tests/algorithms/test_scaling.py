"""Scales migrated through a Llama layer (AWQ, SmoothQuant): folding leaves the float model's function
unchanged, and the calibrated models beat round-to-nearest on the model output."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jquant.algorithms.awq import awq_llama
from jquant.algorithms.scaling import fold_scales, scaled_groups
from jquant.algorithms.smoothquant import smoothquant_llama
from jquant.checkpoint.hf_checkpoint import PROJECTIONS
from jquant.flax.linen import quantized_apply
from jquant.flax.rules import quantize_params
from jquant.models.fused import fuse_projections
from jquant.models.llama import LlamaConfig, LlamaForCausalLM
from jquant.schemes.qparam import QParam

GQA = LlamaConfig(vocab_size=61, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=64)
MHA = dataclasses.replace(GQA, num_kv_heads=4)


def _params(config, seed=3):
    """Random params with a few outlier input channels (norm scales ×12 on 3 channels), as real LLM
    activations have; the up projection's outputs get outliers too (down_proj's input)."""
    params = LlamaForCausalLM(config).init(jax.random.key(seed), jnp.zeros((1, 4), jnp.int32))["params"]
    rng = np.random.default_rng(seed)
    for i in range(config.num_layers):
        layer = params[f"layers_{i}"]
        for norm in ("input_norm", "post_attention_norm"):
            scale = np.array(layer[norm]["scale"])
            scale[rng.choice(config.hidden_size, 3, replace=False)] *= 12.0
            layer[norm]["scale"] = jnp.asarray(scale)
        up = np.array(layer["up_proj"]["kernel"])
        up[:, rng.choice(config.intermediate_size, 4, replace=False)] *= 8.0
        layer["up_proj"]["kernel"] = jnp.asarray(up)
    return params


def _ids(config, rows=8, length=16, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, config.vocab_size, (rows, length)), jnp.int32)


@pytest.mark.parametrize("config,fused", [(GQA, False), (MHA, False), (GQA, True)])
def test_folding_any_positive_scales_keeps_the_float_model(config, fused):
    model = LlamaForCausalLM(config, fused_projections=fused)
    params = _params(config)
    params = fuse_projections(params) if fused else params
    ids = _ids(config)
    want, _ = model.apply({"params": params}, ids)
    rng = np.random.default_rng(1)
    layer = params["layers_1"]
    for group in scaled_groups(config, fused):
        if group.previous is None:
            continue
        k = layer[group.linears[0]]["kernel"].shape[0]
        layer = fold_scales(layer, group, jnp.asarray(rng.uniform(0.25, 4.0, k), jnp.float32), config)
    got, _ = model.apply({"params": {**params, "layers_1": layer}}, ids)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-4, atol=2e-4)
    assert [g.previous is not None for g in scaled_groups(config, fused)][1] == (config is MHA and not fused)


def test_o_proj_of_grouped_query_attention_refuses_a_scale():
    group = scaled_groups(GQA, False)[1]
    with pytest.raises(ValueError, match="cannot absorb"):
        fold_scales(_params(GQA)["layers_0"], group, jnp.ones(64), GQA)


def _output_error(model, params, quantized, ids):
    want, _ = model.apply({"params": params}, ids)
    got, _ = quantized_apply(model, {"params": quantized}, ids)
    return float(jnp.mean((got - want) ** 2))


@pytest.mark.parametrize("config,scheme", [(GQA, "int4_g32"), (MHA, "int4_g128_asym")])
def test_awq_beats_round_to_nearest_on_the_model_output(config, scheme):
    config = dataclasses.replace(config, hidden_size=128, intermediate_size=256, head_dim=32)
    model = LlamaForCausalLM(config)
    params = _params(config)
    calib, held_out = _ids(config, seed=0), _ids(config, seed=1)
    awq = awq_llama(model, params, calib, scheme, progress=False)
    rtn, _ = quantize_params(params, [(PROJECTIONS, scheme)], prepare=False)
    err_awq, err_rtn = _output_error(model, params, awq, held_out), _output_error(model, params, rtn, held_out)
    assert err_awq < 0.8 * err_rtn, (err_awq, err_rtn)
    kernel = awq["layers_0"]["q_proj"]["kernel"]
    assert isinstance(kernel, QParam) and kernel.scheme.name == scheme
    assert not np.allclose(awq["layers_0"]["input_norm"]["scale"], params["layers_0"]["input_norm"]["scale"])


def test_smoothquant_beats_plain_w8a8_on_the_model_output():
    # FP8's exponent keeps small channels' relative precision beside an outlier (unlike int8), so the
    # gain is modest: 0.91x the plain W8A8 error on this model (per-tensor FP8 activations).
    model = LlamaForCausalLM(GQA)
    params = _params(GQA)
    for i in range(GQA.num_layers):   # stronger outliers: ×30 more on the norms' outlier channels
        for norm in ("input_norm", "post_attention_norm"):
            s = params[f"layers_{i}"][norm]["scale"]
            params[f"layers_{i}"][norm]["scale"] = jnp.where(s > 3, s * 30, s)
    calib, held_out = _ids(GQA, seed=0), _ids(GQA, seed=1)
    smooth = smoothquant_llama(model, params, calib, "fp8_e4m3_tensor", progress=False)
    plain, _ = quantize_params(params, [(PROJECTIONS, "fp8_e4m3_tensor")], prepare=False)
    err_smooth = _output_error(model, params, smooth, held_out)
    err_plain = _output_error(model, params, plain, held_out)
    assert err_smooth < 0.95 * err_plain, (err_smooth, err_plain)


def test_smoothquant_at_alpha_zero_with_unit_weights_changes_nothing_but_quantization():
    model = LlamaForCausalLM(GQA)
    params = _params(GQA)
    got = smoothquant_llama(model, params, _ids(GQA), "int8_ch", alpha=0.0, progress=False)
    chex.assert_trees_all_equal_structs(jax.tree.map(lambda _: 0, got, is_leaf=lambda x: isinstance(x, QParam)),
                                        jax.tree.map(lambda _: 0, quantize_params(params, [(PROJECTIONS, "int8_ch")],
                                                                                   prepare=False)[0],
                                                     is_leaf=lambda x: isinstance(x, QParam)))
