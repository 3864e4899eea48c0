"""scheme_from_config over vLLM's quant_method vocabulary, and its errors."""

import pytest

import jquant
from jquant import scheme_from_config

CASES = [
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "fp8_e4m3", "dynamic_per_tensor", "fp8"),
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
]


@pytest.mark.parametrize("config, fmt, activation, layout", CASES)
def test_config_maps_to_scheme(config, fmt, activation, layout):
    scheme = scheme_from_config(config)
    assert (scheme.weight_format, scheme.activation, scheme.checkpoint_layout) == (fmt, activation, layout)
    assert scheme.weight_format in jquant.formats()


def test_gptq_details_carry_over():
    s = scheme_from_config({"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": True,
                            "sym": True, "checkpoint_format": "gptq_v2"})
    assert dict(s.weight_options)["group_size"] == 64
    assert dict(s.layout_options) == {"checkpoint_format": "gptq_v2", "desc_act": True}


def test_block_fp8_ue8m0_carries_over():
    s = scheme_from_config({"quant_method": "fp8", "weight_block_size": [128, 128], "scale_fmt": "ue8m0"})
    assert dict(s.activation_options)["ue8m0"] and dict(s.weight_options)["ue8m0"]


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
    ({"quant_method": "bitsandbytes", "load_in_8bit": True}, ValueError, "8-bit"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "int4"}, ValueError,
     "bnb_4bit_quant_type"),
])
def test_malformed_configs(config, err, match):
    with pytest.raises(err, match=match):
        scheme_from_config(config)
