"""scheme_from_config over vLLM's quant_method vocabulary, and its errors."""

import copy

import pytest

import jquant
from jquant import scheme_from_config
from jquant.schemes.spec import LayoutSpec

CASES = [
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "fp8_e4m3", "dynamic_per_token", "fp8"),
    ({"quant_method": "fp8", "activation_scheme": "static"}, "fp8_e4m3", "static", "fp8"),
    ({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
     "fp8_e4m3", "dynamic_per_token_group", "fp8-block"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128], "scale_fmt": "ue8m0"},
     "fp8_e4m3", "dynamic_per_token_group", "fp8-block"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"},
     "uint4", "none", "awq"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True, "sym": True}, "int4", "none", "gptq"),
    ({"quant_method": "gptq", "bits": 8, "group_size": -1, "sym": False, "checkpoint_format": "gptq_v2"},
     "uint8", "none", "gptq"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                           "group_size": 128}}}}, "int4", "none", "compressed-tensors"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
        "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}}},
     "fp8_e4m3", "dynamic_per_token", "compressed-tensors"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "block",
                                           "block_structure": [128, 128]},
        "input_activations": {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 128,
                              "dynamic": True}}}},
     "fp8_e4m3", "dynamic_per_token_group", "compressed-tensors"),
    ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group",
                                           "group_size": 16}}}}, "nvfp4", "none", "compressed-tensors"),
    ({"quant_method": "modelopt", "quant_algo": "FP8"}, "fp8_e4m3", "static", "modelopt"),
    ({"quantization": {"quant_algo": "NVFP4", "group_size": 16}}, "nvfp4", "none", "modelopt"),
    ({"quant_method": "mxfp4"}, "mxfp4", "none", "gpt-oss"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
      "bnb_4bit_use_double_quant": True}, "nf4", "none", "bnb"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "fp4"}, "fp4_bnb", "none", "bnb"),
    ({"quant_method": "bitsandbytes", "load_in_8bit": True, "load_in_4bit": False, "llm_int8_threshold": 6.0},
     "int8_bnb", "llm_int8", "bnb"),
]


def _ct_mxfp4(**weights):
    args = {"num_bits": 4, "type": "float", "symmetric": True, "group_size": 32, "strategy": "group",
            "dynamic": False, "scale_dtype": "torch.uint8", "zp_dtype": "torch.uint8", **weights}
    return {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": args, "input_activations": None}}}


def test_compressed_tensors_mxfp4_is_mxfp4_ct():
    """llm-compressor's MXFP4A16 (as it writes config.json) and its W4A4 MXFP4 preset: vLLM runs both
    weight-only (CompressedTensorsW4A16Mxfp4), with compressed-tensors' scale rounding."""
    assert scheme_from_config(_ct_mxfp4()) == jquant.get_scheme("mxfp4_ct")
    w4a4 = _ct_mxfp4()
    w4a4["config_groups"]["group_0"]["input_activations"] = {"num_bits": 4, "type": "float", "strategy": "group",
                                                             "group_size": 32, "dynamic": True}
    assert scheme_from_config(w4a4) == jquant.get_scheme("mxfp4_ct")
    for bad, match in (({"group_size": 16}, "group_size 32"), ({"symmetric": False}, "zero point"),
                       ({"type": "int"}, "type 'float'")):
        with pytest.raises(ValueError, match=match):
            scheme_from_config(_ct_mxfp4(**bad))


def test_compressed_tensors_mxfp8_is_mxfp8_ct():
    """llm-compressor's MXFP8A16 and its W8A8 MXFP8 preset: vLLM's CompressedTensorsW8A8Mxfp8 runs both
    weight-only on Hopper (Marlin or a bfloat16 dequantization), with compressed-tensors' scale rounding."""
    a16 = _ct_mxfp4(num_bits=8)
    a16["format"] = "mxfp8-quantized"
    assert scheme_from_config(a16) == jquant.get_scheme("mxfp8_ct")
    a8 = copy.deepcopy(a16)
    a8["config_groups"]["group_0"]["input_activations"] = {"num_bits": 8, "type": "float", "strategy": "group",
                                                           "group_size": 32, "dynamic": True}
    assert scheme_from_config(a8) == jquant.get_scheme("mxfp8_ct")
    for bad, match in (({"group_size": 16}, "group_size 32"), ({"symmetric": False}, "zero point"),
                       ({"num_bits": 4}, "num_bits 8")):
        config = _ct_mxfp4(**{"num_bits": 8, **bad})
        config["format"] = "mxfp8-quantized"
        with pytest.raises(ValueError, match=match):
            scheme_from_config(config)


@pytest.mark.parametrize("threshold, expected", [(6.0, 6.0), (None, 6.0), (0, 0.0), (3.5, 3.5)])
def test_bitsandbytes_8bit_threshold(threshold, expected):
    """transformers writes every BitsAndBytesConfig field; a null threshold is the default, as vLLM reads it."""
    config = {"quant_method": "bitsandbytes", "_load_in_8bit": True, "load_in_8bit": True, "load_in_4bit": False,
              "llm_int8_threshold": threshold, "llm_int8_skip_modules": None, "bnb_4bit_quant_type": "fp4"}
    scheme = scheme_from_config(config)
    assert scheme.activation.outlier_threshold == expected
    assert scheme == jquant.schemes.builtin.llm_int8(expected)
    assert (scheme == jquant.get_scheme("llm_int8")) == (expected == 6.0)


@pytest.mark.parametrize("config, fmt, activation, layout", CASES)
def test_config_maps_to_scheme(config, fmt, activation, layout):
    scheme = scheme_from_config(config)
    assert (scheme.weight.format, scheme.activation.mode, scheme.checkpoint_layout) == (fmt, activation, layout)
    assert scheme.weight.format in jquant.formats()


def test_gptq_details_carry_over():
    s = scheme_from_config({"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": True,
                            "sym": True, "checkpoint_format": "gptq_v2"})
    assert (s.weight.bits, s.weight.symmetric, s.weight.group_size) == (4, True, 64)
    assert s.layout == LayoutSpec(checkpoint_format="gptq_v2", desc_act=True)
    assert s.layout_kwargs() == {"checkpoint_format": "gptq_v2", "desc_act": True}


def test_block_fp8_ue8m0_carries_over():
    s = scheme_from_config({"quant_method": "fp8", "weight_block_size": [128, 128], "scale_fmt": "ue8m0"})
    assert s.activation.ue8m0 is True and s.weight.ue8m0 is True


@pytest.mark.parametrize("config, err, match", [
    ("fp8", TypeError, "dict"),
    ({}, ValueError, "quant_method"),
    ({"quant_method": "squeezellm"}, ValueError, "not supported"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, ValueError, "weight_block_size"),
    ({"quant_method": "fp8", "activation_scheme": "per_token"}, ValueError, "activation_scheme"),
    ({"quant_method": "gptq", "bits": 5}, ValueError, "bits"),
    ({"quant_method": "gptq", "bits": "4"}, ValueError, "bits"),
    ({"quant_method": "gptq"}, ValueError, "bits"),
    ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, ValueError, "checkpoint_format"),
    ({"quant_method": "awq", "bits": 3}, ValueError, "bits"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized"}, ValueError, "config_groups"),
    ({"quant_method": "compressed-tensors", "format": "marlin-24", "config_groups": {"g": {"weights": {
        "num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}}}}, ValueError, "format"),
    ({"quant_method": "modelopt", "quant_algo": "INT4_AWQ"}, ValueError, "quant_algo"),
    ({"quant_method": "bitsandbytes", "load_in_8bit": True, "load_in_4bit": True}, ValueError, "both"),
    ({"quant_method": "bitsandbytes", "load_in_8bit": True, "llm_int8_has_fp16_weight": True}, ValueError,
     "has_fp16_weight"),
    ({"quant_method": "bitsandbytes", "load_in_8bit": True, "llm_int8_threshold": -1.0}, ValueError, ">= 0"),
    ({"quant_method": "bitsandbytes", "load_in_8bit": True, "llm_int8_threshold": float("inf")}, ValueError,
     "finite"),
    ({"quant_method": "bitsandbytes", "load_in_8bit": True, "llm_int8_threshold": "6"}, ValueError,
     "llm_int8_threshold"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "int4"}, ValueError,
     "bnb_4bit_quant_type"),
])
def test_malformed_configs(config, err, match):
    with pytest.raises(err, match=match):
        scheme_from_config(config)


@pytest.mark.parametrize("version", ["gemm", "GEMM", "exllama", "exllamav2", "ipex"])
def test_awq_versions_with_gemm_packing_load(version):
    s = scheme_from_config({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
                            "version": version})
    assert s.checkpoint_layout == "awq"


@pytest.mark.parametrize("version, match", [("gemv", "packed along K"), ("GEMV_FAST", "interleaved"),
                                            ("marlin", "Marlin"), ("gemm_v9", "must be one of")])
def test_awq_versions_with_other_packing_are_refused(version, match):
    with pytest.raises(ValueError, match=rf"'version'.*{match}"):
        scheme_from_config({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
                            "version": version})


@pytest.mark.parametrize("config", [
    {"quantization": {"quant_algo": "NVFP4", "group_size": 32}},
    {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 8},
    {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group",
                                           "group_size": 32}}}},
])
def test_nvfp4_group_size_other_than_16_is_refused(config):
    with pytest.raises(ValueError, match=r"'group_size'\] must be 16"):
        scheme_from_config(config)


def test_asymmetric_nvfp4_is_refused():
    # compressed-tensors' compressor would apply the zero point its decompressor ignores: no reading is right.
    config = {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group",
                                           "group_size": 16, "symmetric": False}}}}
    with pytest.raises(ValueError, match=r"\['symmetric'\] is false: NVFP4 has no zero point"):
        scheme_from_config(config)


@pytest.mark.parametrize("config", [
    {"model_type": "llama", "architectures": ["LlamaForCausalLM"],
     "quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True}},
    {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64},
])
def test_whole_config_json_gets_a_hint(config):
    with pytest.raises(ValueError, match=r"config\['quantization_config'\]"):
        scheme_from_config(config)
    with pytest.raises(ValueError, match=r"config\['quantization_config'\]"):
        jquant.checkpoint.hf_config.skipped_modules(config)


NAMES = ["lm_head", "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj",
         "model.layers.1.mlp.down_proj", "model.layers.11.mlp.down_proj", "model.layers.1.mlp.up_proj"]
CT_FP8 = {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": {
    "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "tensor"}}}}


@pytest.mark.parametrize("config, skipped", [
    # compressed-tensors: equality, and "re:" regexes matched at the start only (re.match).
    (dict(CT_FP8, ignore=["lm_head", "re:.*layers\\.1\\.mlp\\.down"]), {0, 3}),
    (dict(CT_FP8, ignore=["re:layers\\.1"]), set()),  # not anchored at the start of the name
    (dict(CT_FP8, ignore=["model.layers.1.mlp"]), set()),  # a parent name is not a match
    # Targets: a layer no group targets stays float (regexes by re.match, names by equality, the Linear
    # class for every linear layer); a group aimed at attention only (the KV cache) targets no linear.
    (dict(CT_FP8, config_groups={"group_0": dict(CT_FP8["config_groups"]["group_0"], targets=["re:.*mlp.*"])}),
     {0, 1, 2}),
    (dict(CT_FP8, config_groups={"group_0": dict(CT_FP8["config_groups"]["group_0"],
                                                 targets=["re:.*down_proj$", "model.layers.0.self_attn.k_proj"]),
                                 "group_1": {"targets": ["LlamaAttention"]}}), {0, 1, 5}),
    # AWQ: substrings ("down_proj" hits both layers; "layers.1." does not hit "layers.11.").
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
      "modules_to_not_convert": ["down_proj", "layers.1."]}, {3, 4, 5}),
    # fp8: whole names, from ignored_layers, else modules_to_not_convert.
    ({"quant_method": "fp8", "activation_scheme": "dynamic", "modules_to_not_convert": ["lm_head", "down_proj"]},
     {0}),
    ({"quant_method": "fp8", "activation_scheme": "dynamic", "ignored_layers": ["model.layers.0.self_attn.k_proj"],
      "modules_to_not_convert": ["lm_head"]}, {2}),
    # GPTQModel dynamic "-:" exclusions (re.match) and modules_to_not_convert substrings.
    ({"quant_method": "gptq", "bits": 4, "dynamic": {"-:.*self_attn\\.q": {}}, "modules_to_not_convert": ["lm_"]},
     {0, 1}),
    # The first dynamic rule that matches decides (vLLM's get_dynamic_override): an override before an
    # exclusion keeps layer 1's down_proj quantized.
    ({"quant_method": "gptq", "bits": 4, "dynamic": {"+:.*layers\\.1\\.mlp\\.down": {"bits": 8},
                                                     "-:.*down_proj": {}}}, {4}),
    # GPTQ modules_in_block_to_quantize (AutoGPTQ nests one list per step): only modules holding an entry.
    ({"quant_method": "gptq", "bits": 4, "modules_in_block_to_quantize": [["self_attn.q_proj"], ["mlp.up_proj"]]},
     {0, 2, 3, 4}),
    # bitsandbytes: a dotted component, or a dotted prefix.
    ({"quant_method": "bitsandbytes", "load_in_4bit": True, "llm_int8_skip_modules": ["lm_head", "model.layers.1"]},
     {0, 3, 5}),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True, "llm_int8_skip_modules": ["k_proj", "model.layers.1.m"]},
     {2}),
    # ModelOpt: exact, substring or glob, under "quantization" (hf_quant_config.json) or flat ("ignore").
    ({"quantization": {"quant_algo": "FP8", "exclude_modules": ["lm_head", "model.layers.*.k_proj"]}}, {0, 2}),
    ({"quant_method": "modelopt", "quant_algo": "FP8", "ignore": ["*down_proj"]}, {3, 4}),
    ({"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "lm_head"]}, {0, 1, 2}),
])
def test_skipped_modules_match_like_vllm(config, skipped):
    skip = jquant.checkpoint.hf_config.skipped_modules(config)
    assert {i for i, n in enumerate(NAMES) if skip(n)} == skipped


@pytest.mark.parametrize("config, match", [
    (dict(CT_FP8, ignore="lm_head"), "'ignore'"),
    (dict(CT_FP8, ignore=["re:("]), "valid regex"),
    ({"quant_method": "awq", "modules_to_not_convert": [3]}, "modules_to_not_convert"),
    ({"quant_method": "gptq", "bits": 4, "dynamic": {"-:(": {}}}, "valid regex"),
])
def test_bad_skip_lists(config, match):
    with pytest.raises(ValueError, match=match):
        jquant.checkpoint.hf_config.skipped_modules(config)


def test_gptq_per_module_overrides_are_refused_by_the_scheme_too():
    # scheme_from_config built the default scheme for every module, layer 1's 8-bit override ignored.
    config = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True,
              "dynamic": {r"+:model\.layers\.1\..*": {"bits": 8, "group_size": 32}, r"-:model\.layers\.[2-9].*": {}}}
    with pytest.raises(ValueError, match="per-module overrides"):
        scheme_from_config(config)
    exclusions_only = dict(config, dynamic={r"-:model\.layers\.[2-9].*": {}})
    assert scheme_from_config(exclusions_only).name == scheme_from_config(dict(config, dynamic=None)).name


def _ct_static(weight_strategy, act_strategy="tensor"):
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": weight_strategy},
        "input_activations": {"num_bits": 8, "type": "float", "strategy": act_strategy, "dynamic": False}}}}


@pytest.mark.parametrize("strategy", ["tensor", "channel"])
def test_compressed_tensors_static_input_keeps_the_weight_granularity(strategy):
    s = scheme_from_config(_ct_static(strategy))
    assert s.activation.mode == "static" and s.weight.granularity == strategy


def test_compressed_tensors_static_input_must_be_per_tensor():
    with pytest.raises(ValueError, match="static activation scales must be per tensor"):
        scheme_from_config(_ct_static("channel", "token"))


def _ct_fp8(weights=None, acts=None, **group):
    group = {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel", **(weights or {})},
             **group}
    if acts is not None:
        group["input_activations"] = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True, **acts}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": group}}


_BLOCK = {"strategy": "block", "block_structure": [128, 128]}


@pytest.mark.parametrize("config, match", [
    # vLLM runs block FP8 without input_activations weight-only (W8A16): not per-token-group FP8 activations.
    (_ct_fp8(_BLOCK), "block FP8"),
    (_ct_fp8(_BLOCK, {"strategy": "tensor", "dynamic": False}), "block FP8"),
    # vLLM has no scheme for asymmetric or dynamic FP8 weights.
    (_ct_fp8({"symmetric": False}, {}), r"'symmetric'\] is false: asymmetric FP8 weights"),
    (_ct_fp8({"dynamic": True}), r"'dynamic'\] is set"),
    # Activations vLLM's W8A8 FP8 does not take (it falls back to weight-only): not read as FP8 W8A8.
    (_ct_fp8(acts={"type": "int"}), "FP8 activations"),
    (_ct_fp8(acts={"num_bits": 4}), "FP8 activations"),
    (_ct_fp8({"strategy": "tensor"}, {"strategy": "tensor", "dynamic": False, "symmetric": False}),
     "asymmetric static FP8 activations"),
])
def test_compressed_tensors_fp8_that_vllm_reads_otherwise_is_refused(config, match):
    with pytest.raises(ValueError, match=match):
        scheme_from_config(config)


def test_compressed_tensors_block_fp8_with_dynamic_activations():
    s = scheme_from_config(_ct_fp8(_BLOCK, {"strategy": "group", "group_size": 128}))
    assert (s.weight.block_size, s.activation.mode) == ((128, 128), "dynamic_per_token_group")


def test_compressed_tensors_group_format_overrides_the_global_one():
    # llm-compressor writes "mixed-precision" globally and each group's own format (vLLM reads the group's).
    weights = {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": 64}
    config = {"quant_method": "compressed-tensors", "format": "mixed-precision", "config_groups": {"group_0": {
        "targets": ["Linear"], "format": "pack-quantized", "weights": weights}}}
    s = scheme_from_config(config)
    assert (s.weight.bits, s.weight.group_size, s.weight.symmetric) == (4, 64, False)
    fp8 = _ct_fp8(acts={})
    fp8["config_groups"]["group_0"]["format"] = "pack-quantized"  # the group's format, not the global one
    with pytest.raises(ValueError, match="pack-quantized"):
        scheme_from_config(fp8)


def test_compressed_tensors_transforms_are_refused():
    config = dict(_ct_fp8(acts={}), transform_config={"config_groups": {"u": {"type": "hadamard"}}})
    with pytest.raises(ValueError, match="transform_config"):
        scheme_from_config(config)


@pytest.mark.parametrize("weights, acts", [
    ({"num_bits": 8, "type": "float", "strategy": "tensor"},
     {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}),
    ({"num_bits": 8, "type": "float", "strategy": "channel"},
     {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}),
    ({"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True},
     {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True, "symmetric": True}),
])
def test_compressed_tensors_naive_quantized_reads_as_its_typed_format(weights, acts):
    # naive-quantized (e.g. nm-testing/Meta-Llama-3.1-8B-Instruct-FP8-hf) was refused; vLLM loads it.
    group = {"targets": ["Linear"], "weights": weights, "input_activations": acts}
    naive = {"quant_method": "compressed-tensors", "format": "naive-quantized", "config_groups": {"group_0": group}}
    typed = dict(naive, format="float-quantized" if weights["type"] == "float" else "int-quantized")
    assert scheme_from_config(naive) == scheme_from_config(typed)
