"""Mixed-precision compressed-tensors checkpoints: a scheme per config group, chosen per module."""

import jax
import numpy as np
import pytest

from jquant import scheme_from_config
from jquant.checkpoint.hf_checkpoint import PROJECTIONS, load_hf_checkpoint, save_hf_checkpoint
from jquant.checkpoint.module_scheme import module_scheme
from jquant.flax import quantize_params
from jquant.models.llama import LlamaConfig, LlamaForCausalLM

CONFIG = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2,
                     num_kv_heads=1, head_dim=32, rope_theta=1e4, rms_norm_eps=1e-5, max_position_embeddings=32)
W4A16 = {"format": "pack-quantized", "targets": ["re:.*mlp.*proj$"],
         "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}}
FP8_DYNAMIC = {"format": "float-quantized", "targets": ["Linear"],
               "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"},
               "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}
# llm-compressor's mixed precision: W4A16 MLPs, FP8 attention; the KV-cache group quantizes no linear layer.
MIXED = {"quant_method": "compressed-tensors", "format": "mixed-precision", "ignore": ["lm_head"],
         "config_groups": {"group_0": W4A16, "group_1": FP8_DYNAMIC,
                           "group_2": {"targets": ["LlamaAttention"], "weights": None}}}


def test_each_module_gets_its_groups_scheme():
    scheme_of = module_scheme(MIXED)
    mlp, attention = scheme_of("model.layers.1.mlp.down_proj"), scheme_of("model.layers.0.self_attn.o_proj")
    assert mlp.name == "int4_g32" and mlp.weight_only
    assert attention.weight.format == "fp8_e4m3" and attention.activation.mode == "dynamic_per_token"
    assert scheme_of("lm_head") is None
    # Names and regexes are tried before class names, whatever the groups' order.
    swapped = dict(MIXED, config_groups={"a": FP8_DYNAMIC, "b": W4A16})
    assert module_scheme(swapped)("model.layers.1.mlp.up_proj") == mlp
    # A layer no group targets stays float.
    only_mlp = dict(MIXED, config_groups={"group_0": W4A16, "group_1": dict(FP8_DYNAMIC, targets=["re:.*q_proj"])})
    assert module_scheme(only_mlp)("model.layers.0.self_attn.k_proj") is None


def test_scheme_from_config_sends_mixed_configs_to_module_scheme():
    with pytest.raises(ValueError, match="module_scheme"):
        scheme_from_config(MIXED)
    single = dict(MIXED, config_groups={"group_0": dict(W4A16, targets=["Linear"]),
                                        "kv": MIXED["config_groups"]["group_2"]})
    assert scheme_from_config(single).name == "int4_g32"   # the attention-only group is not a second scheme


def test_a_mixed_checkpoint_loads_back_bit_identically(tmp_path):
    # Mixed configs were refused ("must hold exactly one group"); vLLM loads them.
    model = LlamaForCausalLM(CONFIG)
    params = model.init(jax.random.key(1), jax.numpy.zeros((1, 4), jax.numpy.int32))["params"]
    scheme_of = module_scheme(MIXED)
    mlp, attention = scheme_of("model.layers.0.mlp.up_proj"), scheme_of("model.layers.0.self_attn.q_proj")
    qparams, _ = quantize_params(params, [(r".*(gate|up|down)_proj/kernel", mlp), (PROJECTIONS, attention)],
                                 prepare=False)
    save_hf_checkpoint(qparams, tmp_path, quantization_config=MIXED, model_config=CONFIG.to_hf_config())
    loaded = load_hf_checkpoint(tmp_path, params, prepare=False)
    assert loaded["layers_1"]["down_proj"]["kernel"].scheme == mlp
    assert loaded["layers_1"]["v_proj"]["kernel"].scheme == attention
    assert jax.tree_util.tree_structure(loaded) == jax.tree_util.tree_structure(qparams)
    for a, b in zip(jax.tree_util.tree_leaves(loaded), jax.tree_util.tree_leaves(qparams)):
        a, b = np.atleast_1d(np.asarray(a)), np.atleast_1d(np.asarray(b))
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


def test_a_gptq_checkpoint_with_per_module_overrides_loads_back_bit_identically(tmp_path):
    # GPTQModel's dynamic rules (vLLM's override_config): layer 1 in 8 bits, groups of 64, with act-order;
    # layer 0's down_proj excluded (float). These checkpoints were refused.
    config = {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True, "desc_act": False,
              "dynamic": {r"+:model\.layers\.1\..*": {"bits": 8, "group_size": 64, "desc_act": True},
                          r"-:model\.layers\.0\.mlp\.down_proj": {}}}
    scheme_of = module_scheme(config)
    base, layer1 = scheme_of("model.layers.0.self_attn.q_proj"), scheme_of("model.layers.1.mlp.up_proj")
    assert (base.weight.bits, base.weight.group_size) == (4, 32)
    assert (layer1.weight.bits, layer1.weight.group_size, layer1.layout.desc_act) == (8, 64, True)
    assert scheme_of("model.layers.0.mlp.down_proj") is None
    with pytest.raises(ValueError, match="module_scheme"):
        scheme_from_config(config)

    model = LlamaForCausalLM(CONFIG)
    params = model.init(jax.random.key(2), jax.numpy.zeros((1, 4), jax.numpy.int32))["params"]
    qparams, _ = quantize_params(params, [(r"layers_0/down_proj/kernel", None), (r"layers_1/.*_proj/kernel", layer1),
                                          (PROJECTIONS, base)], prepare=False)
    save_hf_checkpoint(qparams, tmp_path, quantization_config=config, model_config=CONFIG.to_hf_config())
    loaded = load_hf_checkpoint(tmp_path, params, prepare=False)
    assert loaded["layers_1"]["o_proj"]["kernel"].scheme == layer1
    assert not hasattr(loaded["layers_0"]["down_proj"]["kernel"], "scheme")   # float
    for a, b in zip(jax.tree_util.tree_leaves(loaded), jax.tree_util.tree_leaves(qparams)):
        a, b = np.atleast_1d(np.asarray(a)), np.atleast_1d(np.asarray(b))
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))
