"""HF ``quantization_config`` → Scheme, in vLLM's ``quant_method`` vocabulary.

Accepted: ``fp8`` (with ``weight_block_size`` and ``scale_fmt``), ``awq``, ``gptq`` (with
``checkpoint_format``), ``compressed-tensors`` (``pack-quantized``, ``float-quantized``,
``nvfp4-pack-quantized``), ``modelopt`` (FP8, NVFP4; flat or under ``"quantization"``), ``mxfp4`` and
``bitsandbytes`` (4-bit). Anything else, or a malformed config, raises a ValueError that names the key.
"""

from __future__ import annotations

from typing import Any

from jquant import builtin_schemes as bs
from jquant.registry import Scheme


def _get(cfg: dict, key: str, types, default: Any = ..., where: str = "quantization_config"):
    if key not in cfg:
        if default is ...:
            raise ValueError(f"{where} needs {key!r}; got keys {sorted(cfg)}")
        return default
    value = cfg[key]
    if not isinstance(value, types) or isinstance(value, bool) and bool not in _as_tuple(types):
        raise ValueError(f"{where}[{key!r}] must be {_type_names(types)}, got {value!r}")
    return value


def _as_tuple(types):
    return types if isinstance(types, tuple) else (types,)


def _type_names(types):
    return " or ".join(t.__name__ for t in _as_tuple(types))


def _group_size(value: int, where: str) -> int | None:
    if value == -1:
        return None
    if value <= 0:
        raise ValueError(f"{where}['group_size'] must be positive or -1, got {value}")
    return value


def _fp8(cfg: dict) -> Scheme:
    fmt = _get(cfg, "fmt", str, "e4m3")
    if fmt not in ("e4m3", "e5m2"):
        raise ValueError(f"quantization_config['fmt'] must be 'e4m3' or 'e5m2', got {fmt!r}")
    act = _get(cfg, "activation_scheme", str, "dynamic")
    if act not in ("dynamic", "static"):
        raise ValueError(f"quantization_config['activation_scheme'] must be 'dynamic' or 'static', got {act!r}")
    block = _get(cfg, "weight_block_size", (list, tuple), None)
    if block is not None:
        if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
            raise ValueError(f"quantization_config['weight_block_size'] must be two positive ints, got {block!r}")
        if act != "dynamic":
            raise ValueError("quantization_config: block FP8 ('weight_block_size') needs activation_scheme "
                             f"'dynamic', got {act!r}")
        scale_fmt = _get(cfg, "scale_fmt", (str, type(None)), None)
        if scale_fmt not in (None, "ue8m0"):
            raise ValueError(f"quantization_config['scale_fmt'] must be 'ue8m0' or absent, got {scale_fmt!r}")
        return bs.fp8_block(tuple(block), ue8m0=scale_fmt == "ue8m0", element=f"fp8_{fmt}")
    return bs.fp8_tensor(static_activations=act == "static", element=f"fp8_{fmt}", layout="fp8")


def _awq(cfg: dict) -> Scheme:
    bits = _get(cfg, "bits", int, _get(cfg, "w_bit", int, 4))
    if bits != 4:
        raise ValueError(f"quantization_config['bits'] must be 4 for AWQ, got {bits}")
    group = _group_size(_get(cfg, "group_size", int, _get(cfg, "q_group_size", int, 128)), "quantization_config")
    zero_point = _get(cfg, "zero_point", bool, True)
    return bs.int_weight_only(4, group, symmetric=not zero_point, layout="awq")


def _gptq(cfg: dict) -> Scheme:
    bits = _get(cfg, "bits", int)
    if bits not in (2, 3, 4, 8):
        raise ValueError(f"quantization_config['bits'] must be 2, 3, 4 or 8 for GPTQ, got {bits}")
    group = _group_size(_get(cfg, "group_size", int, 128), "quantization_config")
    sym = _get(cfg, "sym", bool, True)
    desc_act = _get(cfg, "desc_act", bool, False)
    fmt = _get(cfg, "checkpoint_format", str, "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"quantization_config['checkpoint_format'] must be 'gptq' or 'gptq_v2', got {fmt!r}")
    return bs.int_weight_only(bits, group, symmetric=sym, layout="gptq",
                              layout_options={"checkpoint_format": fmt, "desc_act": desc_act and group is not None})


def _compressed_tensors(cfg: dict) -> Scheme:
    fmt = _get(cfg, "format", str)
    groups = _get(cfg, "config_groups", dict)
    if len(groups) != 1:
        raise ValueError(f"quantization_config['config_groups'] must hold exactly one group (mixed schemes per "
                         f"layer are not supported yet), got {sorted(groups)}")
    (gname, group), = groups.items()
    where = f"quantization_config['config_groups'][{gname!r}]"
    if not isinstance(group, dict):
        raise ValueError(f"{where} must be a dict, got {group!r}")
    weights = _get(group, "weights", dict, where=where)
    wwhere = where + "['weights']"
    acts = _get(group, "input_activations", (dict, type(None)), None, where=where)
    num_bits = _get(weights, "num_bits", int, where=wwhere)
    kind = _get(weights, "type", str, "int", where=wwhere)
    strategy = _get(weights, "strategy", str, where=wwhere)
    if fmt == "pack-quantized":
        if kind != "int" or num_bits not in (4, 8):
            raise ValueError(f"{wwhere}: pack-quantized needs type 'int' with num_bits 4 or 8, got {kind!r}/{num_bits}")
        if acts is not None:
            raise ValueError(f"{where}: pack-quantized with input_activations (W{num_bits}A{acts.get('num_bits')}) "
                             "is not supported; only weight-only")
        group_size = {"group": lambda: _get(weights, "group_size", int, where=wwhere),
                      "channel": lambda: None}.get(strategy)
        if group_size is None:
            raise ValueError(f"{wwhere}['strategy'] must be 'group' or 'channel' for pack-quantized, got {strategy!r}")
        return bs.int_weight_only(num_bits, group_size(), symmetric=_get(weights, "symmetric", bool, True, wwhere),
                                  layout="compressed-tensors")
    if fmt == "float-quantized":
        if kind != "float" or num_bits != 8:
            raise ValueError(f"{wwhere}: float-quantized needs type 'float' with num_bits 8, got {kind!r}/{num_bits}")
        act_strategy = None if acts is None else _get(acts, "strategy", str, where=where + "['input_activations']")
        if strategy == "block":
            block = tuple(_get(weights, "block_structure", (list, tuple), where=wwhere))
            return bs.fp8_block(block, layout="compressed-tensors")
        if strategy not in ("tensor", "channel"):
            raise ValueError(f"{wwhere}['strategy'] must be 'tensor', 'channel' or 'block', got {strategy!r}")
        if acts is not None and not _get(acts, "dynamic", (bool, str), True, where=where + "['input_activations']"):
            return bs.fp8_tensor(static_activations=True, layout="compressed-tensors")
        if strategy == "channel" or act_strategy == "token":
            return bs.fp8_channel(layout="compressed-tensors", weight_only=acts is None)
        return bs.fp8_tensor(layout="compressed-tensors", weight_only=acts is None)
    if fmt == "nvfp4-pack-quantized":
        return bs.nvfp4(convention="compressed-tensors")
    raise ValueError(f"quantization_config['format'] {fmt!r} is not supported; expected 'pack-quantized', "
                     "'float-quantized' or 'nvfp4-pack-quantized'")


def _modelopt(cfg: dict) -> Scheme:
    inner = cfg.get("quantization", cfg)
    if not isinstance(inner, dict):
        raise ValueError(f"quantization_config['quantization'] must be a dict, got {inner!r}")
    algo = _get(inner, "quant_algo", str)
    if algo.upper() == "FP8":
        return bs.fp8_tensor(static_activations=True, layout="modelopt")
    if algo.upper() == "NVFP4":
        return bs.nvfp4(convention="modelopt")
    raise ValueError(f"quantization_config['quant_algo'] must be 'FP8' or 'NVFP4' for modelopt, got {algo!r}")


def _bitsandbytes(cfg: dict) -> Scheme:
    if _get(cfg, "load_in_8bit", bool, False):
        raise ValueError("quantization_config: bitsandbytes 8-bit (LLM.int8) is not supported; use load_in_4bit")
    if not _get(cfg, "load_in_4bit", bool, True):
        raise ValueError("quantization_config: bitsandbytes config sets neither load_in_4bit nor load_in_8bit")
    qtype = _get(cfg, "bnb_4bit_quant_type", str, "fp4")
    if qtype not in ("nf4", "fp4"):
        raise ValueError(f"quantization_config['bnb_4bit_quant_type'] must be 'nf4' or 'fp4', got {qtype!r}")
    return bs.bnb_4bit(qtype, double_quant=_get(cfg, "bnb_4bit_use_double_quant", bool, False))


_METHODS = {
    "fp8": _fp8,
    "awq": _awq,
    "gptq": _gptq,
    "compressed-tensors": _compressed_tensors,
    "compressed_tensors": _compressed_tensors,
    "modelopt": _modelopt,
    "mxfp4": lambda cfg: bs.mxfp4(),
    "bitsandbytes": _bitsandbytes,
}


def scheme_from_config(quantization_config: dict) -> Scheme:
    """The Scheme for a HF ``quantization_config`` dict (the ``config.json`` entry vLLM reads)."""
    if not isinstance(quantization_config, dict):
        raise TypeError(f"quantization_config must be a dict, got {type(quantization_config).__name__}")
    method = quantization_config.get("quant_method")
    if method is None and "quantization" in quantization_config:
        method = "modelopt"  # hf_quant_config.json carries no quant_method
    if not isinstance(method, str):
        raise ValueError(f"quantization_config needs a 'quant_method' string, got {method!r}")
    parse = _METHODS.get(method.lower())
    if parse is None:
        raise ValueError(f"quant_method {method!r} is not supported; supported: {sorted(set(_METHODS) - {'compressed_tensors'})}")
    return parse(quantization_config)
