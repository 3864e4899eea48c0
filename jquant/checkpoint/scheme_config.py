"""Registered scheme → the HF ``quantization_config`` a checkpoint of it carries (for writing).

The inverse of ``scheme_from_config`` for the schemes vLLM runs on a dense model with the same
numerics: ``scheme_from_config(checkpoint_config(name))`` quantizes and computes exactly as
``get_scheme(name)`` (``tests/checkpoint/test_scheme_config.py``), and its ``checkpoint_layout`` is
the layout the weights are written in.
"""

from __future__ import annotations

import copy

from jquant.formats.bnb_int8 import DEFAULT_THRESHOLD
from jquant.schemes.scheme import Scheme, get_scheme, schemes


def gptq_config(bits: int, group_size: int | None, symmetric: bool, act_order: bool) -> dict:
    """The HF ``quantization_config`` of a GPTQ checkpoint with these settings (``group_size`` None:
    per output channel, written as -1). Asymmetric weights are stored ``gptq_v2`` (zero points as they
    are, read so by vLLM's ``use_v2_format``): v1 stores zero - 1, which cannot hold the zero point 0 of an
    all-positive group."""
    config = {"quant_method": "gptq", "bits": bits, "group_size": -1 if group_size is None else group_size,
              "sym": symmetric, "desc_act": act_order}
    return config if symmetric else {**config, "checkpoint_format": "gptq_v2"}


def awq_config(bits: int, group_size: int) -> dict:
    """The HF ``quantization_config`` of an AWQ (GEMM) checkpoint: uint codes with zero points."""
    return {"quant_method": "awq", "bits": bits, "group_size": group_size, "zero_point": True, "version": "gemm"}


def _compressed_tensors(fmt: str, weights: dict, activations: dict | None = None) -> dict:
    group = {"targets": ["Linear"], "weights": {"symmetric": True, "dynamic": False, **weights}}
    if activations is not None:
        group["input_activations"] = {"symmetric": True, "dynamic": True, "strategy": "token", **activations}
    return {"quant_method": "compressed-tensors", "format": fmt, "config_groups": {"group_0": group}}


def _fp8_block(ue8m0: bool) -> dict:
    config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    return {**config, "scale_fmt": "ue8m0"} if ue8m0 else config


def _bnb(quant_type: str, double_quant: bool) -> dict:
    return {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": quant_type,
            "bnb_4bit_use_double_quant": double_quant}


_CONFIGS = {
    **{f"int4_g{g}": gptq_config(4, g, True, False) for g in (32, 64, 128)},
    "int4_g128_asym": awq_config(4, 128),
    "int8_ch": _compressed_tensors("pack-quantized", {"num_bits": 8, "type": "int", "strategy": "channel"}),
    "int8_w8a8": _compressed_tensors("int-quantized", {"num_bits": 8, "type": "int", "strategy": "channel"},
                                     {"num_bits": 8, "type": "int"}),
    "fp8_e4m3_channel": _compressed_tensors("float-quantized", {"num_bits": 8, "type": "float", "strategy": "channel"},
                                            {"num_bits": 8, "type": "float"}),
    "fp8_e4m3_block128x128": _fp8_block(ue8m0=False),
    "fp8_e4m3_block128x128_ue8m0": _fp8_block(ue8m0=True),
    # No input_activations: vLLM runs it weight-only (W4A16 NVFP4), as jquant's nvfp4 does on Hopper.
    "nvfp4": _compressed_tensors("nvfp4-pack-quantized", {"num_bits": 4, "type": "float", "strategy": "tensor_group",
                                                          "group_size": 16}),
    # llm-compressor's MXFP4A16 (E8M0 scales stored as uint8 exponents).
    "mxfp4_ct": _compressed_tensors("mxfp4-pack-quantized", {"num_bits": 4, "type": "float", "strategy": "group",
                                                             "group_size": 32, "scale_dtype": "torch.uint8"}),
    # llm-compressor's MXFP8A16: float8_e4m3fn codes, E8M0 scales stored as uint8 exponents.
    "mxfp8_ct": _compressed_tensors("mxfp8-quantized", {"num_bits": 8, "type": "float", "strategy": "group",
                                                        "group_size": 32, "scale_dtype": "torch.uint8"}),
    "nf4": _bnb("nf4", False),
    "nf4_dq": _bnb("nf4", True),
    "fp4_bnb": _bnb("fp4", False),
    "llm_int8": {"quant_method": "bitsandbytes", "load_in_8bit": True, "load_in_4bit": False,
                 "llm_int8_threshold": DEFAULT_THRESHOLD},
}
_NO_CONFIG = {
    "fp8_e4m3_tensor": "vLLM runs a dynamic per-tensor FP8 checkpoint with per-token activations (another "
                       "numerics) and a static one needs calibrated input_scales; write fp8_e4m3_channel",
    "mxfp4": "its gpt-oss layout holds MoE experts; vLLM reads dense MXFP4 layers from compressed-tensors "
             "mxfp4-pack-quantized, whose quantizer rounds scales as mxfp4_ct does: write mxfp4_ct",
    "mxfp8": "vLLM reads dense MXFP8 layers from compressed-tensors mxfp8-quantized, whose quantizer rounds "
             "scales as mxfp8_ct does: write mxfp8_ct",
}


def checkpoint_config(name: "str | Scheme", *, act_order: bool = False) -> dict:
    """The HF ``quantization_config`` of a checkpoint of registered scheme ``name`` (or the registered
    ``Scheme`` itself). ``act_order`` sets
    GPTQ's ``desc_act`` (weights carrying ``g_idx``) on the GPTQ-written int4 schemes; the other layouts
    need no flag (compressed-tensors stores a ``weight_g_idx`` where the weights have one, GPTQ of the
    float formats keeps static groups).

    Examples:
      >>> from jquant.checkpoint.scheme_config import checkpoint_config
      >>> checkpoint_config("fp8_e4m3_block128x128")
      {'quant_method': 'fp8', 'fmt': 'e4m3', 'activation_scheme': 'dynamic', 'weight_block_size': [128, 128]}
      >>> checkpoint_config("int4_g64", act_order=True)["desc_act"]
      True
      >>> checkpoint_config("mxfp4")
      Traceback (most recent call last):
          ...
      ValueError: no dense checkpoint layout for scheme 'mxfp4': its gpt-oss layout holds MoE experts; ...

    Raises ValueError for a scheme with no such checkpoint, saying why and which schemes have one.
    """
    if isinstance(name, Scheme):
        registered = name.name in schemes() and get_scheme(name.name) == name
        if not registered:
            raise ValueError(f"scheme {name.name!r} is not a registered scheme (or differs from the one of that "
                             "name): checkpoint_config writes the registered schemes, named as in schemes()")
        name = name.name
    if not isinstance(name, str):
        raise TypeError(f"checkpoint_config takes a registered scheme's name, got {type(name).__name__}")
    if name in _NO_CONFIG:
        raise ValueError(f"no dense checkpoint layout for scheme {name!r}: {_NO_CONFIG[name]}")
    if name not in _CONFIGS:
        raise ValueError(f"no checkpoint layout known for scheme {name!r}; schemes with one: {', '.join(_CONFIGS)}")
    config = copy.deepcopy(_CONFIGS[name])
    if act_order and config["quant_method"] == "gptq":
        config["desc_act"] = True
    return config


def writable_schemes() -> tuple[str, ...]:
    """The registered schemes ``checkpoint_config`` has a checkpoint for."""
    return tuple(_CONFIGS)
