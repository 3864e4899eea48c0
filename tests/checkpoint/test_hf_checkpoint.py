"""HF-style safetensors checkpoints of the Llama model in each vLLM layout: save → load is bit-identical."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jquant import scheme_from_config
from jquant.checkpoint.hf_checkpoint import load_hf_checkpoint, save_hf_checkpoint
from jquant.models.llama import LlamaConfig, LlamaForCausalLM
from jquant.flax import QParam, quantize_params, quantized_apply

CONFIG = LlamaConfig(vocab_size=64, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=64, rms_norm_eps=1e-5, rope_theta=10000.0,
                     max_position_embeddings=64, tie_word_embeddings=True)
PROJ = r".*_proj/kernel"

CONFIGS = {
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 64, "sym": True, "desc_act": False},
    "gptq_v2_asym": {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": False,
                     "checkpoint_format": "gptq_v2"},
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True},
    "fp8_block": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
    # Blocks other than the layouts' default 128 × 128 must come from the config: 64 gives another scale
    # grid; 192 rows give the same grid as 128 on the 256-row weights (read with 128, silently wrong).
    "fp8_block_64": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [64, 64]},
    "ct_fp8_block_192x128": {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {
        "group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "block",
                                                       "block_structure": [192, 128]},
                    "input_activations": {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 128,
                                          "dynamic": True}}}},
    "ct_nvfp4": {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "config_groups": {
        "group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group",
                                                       "group_size": 16}}}},
    "mxfp4": {"quant_method": "mxfp4"},
    "bnb_nf4_dq": {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
                   "bnb_4bit_use_double_quant": True},
}


@pytest.fixture(scope="module")
def tiny():
    model = LlamaForCausalLM(CONFIG)
    ids = jax.random.randint(jax.random.key(0), (1, 10), 0, CONFIG.vocab_size)
    return model, model.init(jax.random.key(1), ids)["params"], ids


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_save_load_bit_identical(tmp_path, tiny, name):
    model, params, ids = tiny
    scheme = scheme_from_config(CONFIGS[name])
    qparams, _ = quantize_params(params, [(PROJ, scheme)], prepare=False)
    save_hf_checkpoint(qparams, tmp_path, quantization_config=CONFIGS[name])
    loaded = load_hf_checkpoint(tmp_path, params, prepare=False)
    a = jax.tree_util.tree_leaves(qparams)
    b = jax.tree_util.tree_leaves(loaded)
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(np.atleast_1d(np.asarray(x)).view(np.uint8),
                                      np.atleast_1d(np.asarray(y)).view(np.uint8))
    fwd = jax.jit(lambda p: quantized_apply(model, {"params": p}, ids)[0])
    np.testing.assert_array_equal(fwd(loaded), fwd(qparams))


@pytest.mark.parametrize("config,input_scale", [
    (dict(CONFIGS["ct_nvfp4"], config_groups={"group_0": dict(
        CONFIGS["ct_nvfp4"]["config_groups"]["group_0"],
        input_activations={"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16,
                           "dynamic": "local"})}), "input_global_scale"),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16}, "input_scale")])
def test_nvfp4_w4a4_checkpoints_load_weight_only(tmp_path, tiny, config, input_scale):
    """NVFP4 W4A4 exports store a static activation scale beside every projection; NVFP4 runs weight-only
    (as vLLM on Hopper), so the loader reads the scale and the weights come back bit for bit."""
    from jquant.checkpoint.safetensors_file import load_file, save_file

    model, params, ids = tiny
    qparams, _ = quantize_params(params, [(PROJ, scheme_from_config(config))], prepare=False)
    save_hf_checkpoint(qparams, tmp_path, quantization_config=config)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    shape = (1,) if input_scale == "input_global_scale" else ()
    for key in [k for k in tensors if k.endswith("_proj.weight_scale")]:
        tensors[key.replace("weight_scale", input_scale)] = np.full(shape, 0.02, np.float32)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    loaded = load_hf_checkpoint(tmp_path, params, prepare=False)
    for x, y in zip(jax.tree_util.tree_leaves(qparams), jax.tree_util.tree_leaves(loaded)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    key = next(k for k in tensors if k.endswith(input_scale))
    tensors[key] = np.full((2, 2), 0.02, np.float32)   # not a scalar: refused, naming the tensor
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=input_scale):
        load_hf_checkpoint(tmp_path, params, prepare=False)


def test_float_checkpoint_round_trip(tmp_path, tiny):
    model, params, ids = tiny
    save_hf_checkpoint(params, tmp_path)
    loaded = load_hf_checkpoint(tmp_path, params)
    jax.tree.map(np.testing.assert_array_equal, loaded, params)


def test_config_disagreeing_with_tensors_names_the_parameter(tmp_path, tiny):
    _, params, _ = tiny
    qparams, _ = quantize_params(params, [(PROJ, scheme_from_config(CONFIGS["gptq"]))], prepare=False)
    save_hf_checkpoint(qparams, tmp_path, quantization_config=CONFIGS["gptq"])
    wrong = dict(CONFIGS["gptq"], bits=8)
    with pytest.raises(ValueError, match=r"parameter 'layers_0/\w+_proj/kernel'"):
        load_hf_checkpoint(tmp_path, params, quantization_config=wrong)


def test_quantized_tensors_without_config(tmp_path, tiny):
    _, params, _ = tiny
    qparams, _ = quantize_params(params, [(PROJ, scheme_from_config(CONFIGS["awq"]))], prepare=False)
    save_hf_checkpoint(qparams, tmp_path)  # no quantization_config written
    with pytest.raises(ValueError, match="no quantization_config"):
        load_hf_checkpoint(tmp_path, params)


def test_missing_and_leftover_tensors(tmp_path, tiny):
    from jquant.checkpoint.safetensors_file import load_file, save_file

    _, params, _ = tiny
    save_hf_checkpoint(params, tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["model.layers.9.mlp.up_proj.weight"] = np.zeros((2, 2), np.float32)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="match no model parameter"):
        load_hf_checkpoint(tmp_path, params)
    del tensors["model.layers.9.mlp.up_proj.weight"], tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"layers_1/down_proj/kernel"):
        load_hf_checkpoint(tmp_path, params)


def test_smollm2_gptq_checkpoint_gives_the_same_logits(tmp_path):
    from jquant.models import load_gguf, smollm2_path

    config, variables, _ = load_gguf(smollm2_path())
    model = LlamaForCausalLM(config)
    params = variables["params"]
    cfg = CONFIGS["gptq"]
    qparams, report = quantize_params(params, [(r".*layers_\d+/\w+_proj/kernel", scheme_from_config(cfg))])
    assert len(report.quantized) == 7 * config.num_layers
    save_hf_checkpoint(qparams, tmp_path, quantization_config=cfg)
    loaded = load_hf_checkpoint(tmp_path, params)
    ids = jnp.asarray([[1, 504, 3458, 282, 253, 2017, 30, 378]], jnp.int32)
    fwd = jax.jit(lambda p: quantized_apply(model, {"params": p}, ids)[0])
    np.testing.assert_array_equal(fwd(loaded), fwd(qparams))
    assert isinstance(loaded["layers_7"]["down_proj"]["kernel"], QParam)


def test_online_quantization_of_a_float_checkpoint(tmp_path, tiny):
    model, params, ids = tiny
    save_hf_checkpoint(params, tmp_path)
    loaded = load_hf_checkpoint(tmp_path, params, quantize="int8_ch")
    assert isinstance(loaded["layers_1"]["gate_proj"]["kernel"], QParam)
    assert not isinstance(loaded["embed_tokens"]["embedding"], QParam)
    direct, _ = quantize_params(params, [(PROJ, "int8_ch")])
    np.testing.assert_array_equal(quantized_apply(model, {"params": loaded}, ids)[0],
                                  quantized_apply(model, {"params": direct}, ids)[0])
    qparams, _ = quantize_params(params, [(PROJ, scheme_from_config(CONFIGS["gptq"]))], prepare=False)
    save_hf_checkpoint(qparams, tmp_path / "q", quantization_config=CONFIGS["gptq"])
    with pytest.raises(ValueError, match="already quantized"):
        load_hf_checkpoint(tmp_path / "q", params, quantize="int8_ch")


def test_fp8_codes_without_their_scale_are_refused(tmp_path, tiny):
    from jquant.checkpoint.safetensors_file import load_file, save_file

    _, params, _ = tiny
    config = CONFIGS["fp8_block"]
    qparams, _ = quantize_params(params, [(PROJ, scheme_from_config(config))], prepare=False)
    save_hf_checkpoint(qparams, tmp_path, quantization_config=config)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight_scale_inv"]   # a lost shard, say
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"'layers_1/up_proj/kernel'.*float8_e4m3fn codes with no scale"):
        load_hf_checkpoint(tmp_path, params)


def test_shards_follow_the_index_and_duplicates_are_refused(tmp_path, tiny):
    import json

    from jquant.checkpoint.safetensors_file import load_file, save_file

    _, params, _ = tiny
    save_hf_checkpoint(params, tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    stale = {"model.norm.weight": tensors["model.norm.weight"] + 7.0}   # an older shard left beside the new ones
    save_file(stale, str(tmp_path / "stale.safetensors"))
    with pytest.raises(ValueError, match=r"'model.norm.weight' is stored in both 'model.safetensors' and "
                                         r"'stale.safetensors'"):
        load_hf_checkpoint(tmp_path, params)
    index = {"metadata": {}, "weight_map": {name: "model.safetensors" for name in tensors}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    loaded = load_hf_checkpoint(tmp_path, params)   # the index names the shards to read, as vLLM filters them
    np.testing.assert_array_equal(loaded["final_norm"]["scale"], params["final_norm"]["scale"])
    index["weight_map"]["model.norm.weight"] = "missing.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"names shards that are not in .*\['missing.safetensors'\]"):
        load_hf_checkpoint(tmp_path, params)
