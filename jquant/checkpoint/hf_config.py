"""HF ``quantization_config`` → Scheme, in vLLM's ``quant_method`` vocabulary.

Accepted: ``fp8`` (with ``weight_block_size`` and ``scale_fmt``), ``awq`` (GEMM-packed ``version``s),
``gptq`` (with ``checkpoint_format``), ``compressed-tensors`` (``pack-quantized``, ``float-quantized``,
``int-quantized``, ``naive-quantized``, ``nvfp4-pack-quantized``, ``mxfp4-pack-quantized``,
``mxfp8-quantized``; several config groups, like
GPTQModel's per-module overrides, through ``jquant.checkpoint.module_scheme``), ``modelopt``
(``quant_algo`` FP8, FP8_PER_CHANNEL_PER_TOKEN, FP8_PB_WO, NVFP4, W4A16_NVFP4, MXFP8; flat or under
``"quantization"``), ``mxfp4`` and ``bitsandbytes`` (4- and 8-bit). Anything else, or
a malformed config, raises a ValueError that names the key.
``skipped_modules`` reads the same config's ignore list: the modules that stay in float.
"""

from __future__ import annotations

import fnmatch
import math
import re
from typing import Any, Callable

from jquant.formats.bnb_int8 import DEFAULT_THRESHOLD
from jquant.schemes import builtin as bs
from jquant.schemes.scheme import Scheme
from jquant.schemes.spec import LayoutSpec


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
    # vLLM's Fp8LinearMethod quantizes dynamic activations per token wherever CUTLASS FP8 runs (sm_89+,
    # the GPUs FP8 schemes target); per tensor only without it.
    return bs.fp8_tensor(static_activations=act == "static", per_token_activations=act == "dynamic",
                         element=f"fp8_{fmt}", layout="fp8")


# AutoAWQ / transformers ``version``: exllama(v2) and ipex kernels load GEMM checkpoints and repack at
# load time; GEMV, GEMV-fast and Marlin checkpoints store other tensor shapes and nibble orders.
_AWQ_GEMM_PACKED = ("gemm", "exllama", "exllamav2", "ipex")
_AWQ_OTHER_PACKING = {"gemv": "qweight [N, K/8] packed along K", "gemv_fast": "interleaved [N/4, K/2] words",
                      "marlin": "Marlin tiles"}


def _awq(cfg: dict) -> Scheme:
    version = _get(cfg, "version", str, "gemm").lower()
    if version in _AWQ_OTHER_PACKING:
        raise ValueError(f"quantization_config['version'] {version!r}: AWQ {version} checkpoints store "
                         f"{_AWQ_OTHER_PACKING[version]}, not the GEMM layout jquant reads; re-export the model "
                         "with version 'gemm'")
    if version not in _AWQ_GEMM_PACKED:
        raise ValueError(f"quantization_config['version'] must be one of {list(_AWQ_GEMM_PACKED)} (GEMM-packed "
                         f"AWQ), got {version!r}")
    bits = _get(cfg, "bits", int, _get(cfg, "w_bit", int, 4))
    if bits != 4:
        raise ValueError(f"quantization_config['bits'] must be 4 for AWQ, got {bits}")
    group = _group_size(_get(cfg, "group_size", int, _get(cfg, "q_group_size", int, 128)), "quantization_config")
    zero_point = _get(cfg, "zero_point", bool, True)
    return bs.int_weight_only(4, group, symmetric=not zero_point, layout="awq")


def _gptq(cfg: dict) -> Scheme:
    _gptq_dynamic(cfg)   # one scheme for every module, or an error (not the default scheme for all)
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
                              layout_spec=LayoutSpec(checkpoint_format=fmt, desc_act=desc_act and group is not None))


def _compressed_tensors(cfg: dict) -> Scheme:
    groups = compressed_tensors_groups(cfg)
    if len(groups) != 1:
        raise ValueError(f"quantization_config['config_groups'] holds {len(groups)} groups {sorted(groups)}, a "
                         "scheme per layer: module_scheme(quantization_config) gives each module's")
    (gname, group), = groups.items()
    return compressed_tensors_group_scheme(cfg, gname, group)


def compressed_tensors_groups(cfg: dict) -> dict:
    """The config groups that quantize linear layers: vLLM drops a group aimed at attention only (its
    targets all end in "Attention": the KV cache, read by ``kv_cache_settings``)."""
    groups = _get(cfg, "config_groups", dict)
    return {name: group for name, group in groups.items()
            if not (isinstance(group, dict) and group.get("targets")
                    and all(str(t).endswith("Attention") for t in group["targets"]))}


def compressed_tensors_group_scheme(cfg: dict, gname: str, group) -> Scheme:
    """The scheme of config group ``gname`` of a compressed-tensors ``cfg``."""
    where = f"quantization_config['config_groups'][{gname!r}]"
    if not isinstance(group, dict):
        raise ValueError(f"{where} must be a dict, got {group!r}")
    if _get(cfg, "transform_config", (dict, type(None)), None):
        # vLLM applies these (Hadamard / SpinQuant rotations) to activations and weights at run time.
        raise ValueError("quantization_config['transform_config'] (online rotations of the weights and "
                         "activations) is not supported; the layers would compute without them")
    # vLLM: a group's own "format" wins over the global one ("mixed-precision" configs set it per group).
    fmt = _get(group, "format", (str, type(None)), None, where=where) or _get(cfg, "format", str)
    weights = _get(group, "weights", dict, where=where)
    wwhere = where + "['weights']"
    acts = _get(group, "input_activations", (dict, type(None)), None, where=where)
    num_bits = _get(weights, "num_bits", int, where=wwhere)
    kind = _get(weights, "type", str, "int", where=wwhere)
    if fmt == "naive-quantized":
        # compressed-tensors' float- and int-quantized compressors are its naive one with the codes'
        # dtype fixed: the same tensors (weight, weight_scale, weight_zero_point), as vLLM reads them.
        fmt = "float-quantized" if kind == "float" else "int-quantized"
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
        _check_fp8_args(weights, acts, where)
        act_strategy = None if acts is None else _get(acts, "strategy", str, where=where + "['input_activations']")
        if strategy == "block":
            if acts is None or not _get(acts, "dynamic", (bool, str), True, where=where + "['input_activations']"):
                # vLLM runs these W8A16 (Marlin) or not at all; fp8_block quantizes activations per token group.
                raise ValueError(f"{where}: block FP8 ('strategy': 'block') is supported with dynamic "
                                 "input_activations only (W8A8); weight-only or static-activation block FP8 "
                                 "is not")
            block = tuple(_get(weights, "block_structure", (list, tuple), where=wwhere))
            return bs.fp8_block(block, layout="compressed-tensors")
        if strategy not in ("tensor", "channel"):
            raise ValueError(f"{wwhere}['strategy'] must be 'tensor', 'channel' or 'block', got {strategy!r}")
        if acts is not None and not _get(acts, "dynamic", (bool, str), True, where=where + "['input_activations']"):
            if act_strategy != "tensor":
                raise ValueError(f"{where}['input_activations']: static activation scales must be per tensor "
                                 f"(strategy 'tensor'), got {act_strategy!r}")
            static = bs.fp8_channel if strategy == "channel" else bs.fp8_tensor
            return static(static_activations=True, layout="compressed-tensors")
        if strategy == "channel":
            return bs.fp8_channel(layout="compressed-tensors", weight_only=acts is None)
        # vLLM's CompressedTensorsW8A8Fp8 quantizes dynamic activations per token whatever their strategy
        # says ("tensor" included).
        return bs.fp8_tensor(layout="compressed-tensors", weight_only=acts is None, per_token_activations=True)
    if fmt == "int-quantized":
        return _int_quantized(weights, acts, where)
    if fmt == "nvfp4-pack-quantized":
        _nvfp4_group(_get(weights, "group_size", int, 16, where=wwhere), wwhere)
        if not _get(weights, "symmetric", bool, True, wwhere):
            # compressed-tensors' compressor applies a zero point its decompressor ignores: no reading is right.
            raise ValueError(f"{wwhere}['symmetric'] is false: NVFP4 has no zero point (nvfp4-pack-quantized "
                             "is symmetric)")
        return bs.nvfp4(convention="compressed-tensors")
    if fmt in ("mxfp4-pack-quantized", "mxfp8-quantized"):
        return _ct_mx(weights, wwhere, fmt)
    raise ValueError(f"quantization_config['format'] {fmt!r} is not supported; expected 'pack-quantized', "
                     "'float-quantized', 'int-quantized', 'naive-quantized', 'nvfp4-pack-quantized', "
                     "'mxfp4-pack-quantized' or 'mxfp8-quantized'")


def _ct_mx(weights: dict, wwhere: str, fmt: str) -> Scheme:
    """vLLM's ``_is_mxfp4`` / ``_is_mxfp8``: float, 4 or 8 bits, symmetric groups of 32. Input activations
    (the W4A4 MXFP4 and W8A8 MXFP8 presets) are not quantized: on Hopper vLLM runs every such layer weight-only
    (``CompressedTensorsW4A16Mxfp4``; ``CompressedTensorsW8A8Mxfp8`` through Marlin or a bfloat16
    dequantization)."""
    bits = 4 if fmt == "mxfp4-pack-quantized" else 8
    kind, num_bits = _get(weights, "type", str, "int", where=wwhere), _get(weights, "num_bits", int, where=wwhere)
    strategy, group = _get(weights, "strategy", str, where=wwhere), _get(weights, "group_size", int, None, wwhere)
    if (kind, num_bits, strategy, group) != ("float", bits, "group", 32):
        raise ValueError(f"{wwhere}: {fmt} needs type 'float', num_bits {bits}, strategy 'group' and "
                         f"group_size 32, got {kind!r}, {num_bits}, {strategy!r}, {group!r}")
    if not _get(weights, "symmetric", bool, True, wwhere):
        raise ValueError(f"{wwhere}['symmetric'] is false: MXFP{bits} has no zero point")
    return bs.mxfp4_compressed_tensors() if bits == 4 else bs.mxfp8_compressed_tensors()


def _check_fp8_args(weights: dict, acts: dict | None, where: str) -> None:
    """What vLLM's ``_is_fp8_w8a8`` / ``_is_fp8_w8a16`` accept: symmetric, static FP8 weights; FP8
    (type 'float', 8 bits) activations, symmetric where static. vLLM refuses the weights otherwise, and
    runs activations it cannot take weight-only (W8A16): refused here rather than read as W8A8."""
    wwhere, awhere = where + "['weights']", where + "['input_activations']"
    if not _get(weights, "symmetric", bool, True, wwhere):
        raise ValueError(f"{wwhere}['symmetric'] is false: asymmetric FP8 weights are not supported")
    if _get(weights, "dynamic", (bool, str), False, where=wwhere):
        raise ValueError(f"{wwhere}['dynamic'] is set: FP8 weights must be static (stored with their scales)")
    if acts is None:
        return
    kind, bits = _get(acts, "type", str, "int", where=awhere), _get(acts, "num_bits", int, where=awhere)
    if kind != "float" or bits != 8:
        raise ValueError(f"{awhere}: FP8 weights take FP8 activations (type 'float', num_bits 8), got "
                         f"{kind!r}/{bits}")
    if not _get(acts, "dynamic", (bool, str), True, where=awhere) and not _get(acts, "symmetric", bool, True, awhere):
        raise ValueError(f"{awhere}['symmetric'] is false: asymmetric static FP8 activations (a zero point) "
                         "are not supported")


def _int_quantized(weights: dict, acts: dict | None, where: str) -> Scheme:
    """compressed-tensors INT8 W8A8: symmetric int8 weights per channel (or tensor), symmetric int8
    activations per token (dynamic) or per tensor (static), as vLLM's ``W8A8Int8`` reads them."""
    wwhere, awhere = where + "['weights']", where + "['input_activations']"
    if _get(weights, "type", str, "int", where=wwhere) != "int" or _get(weights, "num_bits", int, where=wwhere) != 8:
        raise ValueError(f"{wwhere}: int-quantized needs type 'int' with num_bits 8")
    if not _get(weights, "symmetric", bool, True, wwhere):
        raise ValueError(f"{wwhere}: asymmetric INT8 weights are not supported (vLLM's W8A8 INT8 takes symmetric)")
    if _get(weights, "strategy", str, where=wwhere) not in ("channel", "tensor"):
        raise ValueError(f"{wwhere}['strategy'] must be 'channel' or 'tensor' for int-quantized")
    if acts is None:
        raise ValueError(f"{where}: int-quantized without input_activations (INT8 weight-only) is stored "
                         "pack-quantized; expected input_activations for W8A8")
    if _get(acts, "type", str, "int", where=awhere) != "int" or _get(acts, "num_bits", int, where=awhere) != 8:
        raise ValueError(f"{awhere}: needs type 'int' with num_bits 8")
    if not _get(acts, "symmetric", bool, True, awhere):
        raise ValueError(f"{awhere}: asymmetric INT8 activations (azp) are not supported")
    dynamic = _get(acts, "dynamic", (bool, str), True, where=awhere)
    strategy = _get(acts, "strategy", str, "token" if dynamic else "tensor", where=awhere)
    if dynamic and strategy != "token" or not dynamic and strategy != "tensor":
        raise ValueError(f"{awhere}: INT8 activations are dynamic per token or static per tensor, got "
                         f"dynamic={dynamic!r}, strategy={strategy!r}")
    return bs.int8_w8a8(static_activations=not dynamic)


# quant_algo values vLLM's ModelOpt configs accept that jquant does not read, and why.
_MODELOPT_REFUSED = {
    "MIXED_PRECISION": "it sets a quant_algo per layer (quantized_layers), and jquant reads one scheme per "
                       "checkpoint",
}


def _modelopt(cfg: dict) -> Scheme:
    inner = cfg.get("quantization", cfg)
    if not isinstance(inner, dict):
        raise ValueError(f"quantization_config['quantization'] must be a dict, got {inner!r}")
    where = "quantization_config['quantization']" if inner is not cfg else "quantization_config"
    algo = _get(inner, "quant_algo", str, where=where).upper()  # as vLLM reads it: ModelOpt may write lowercase
    if algo == "FP8":
        return bs.fp8_tensor(static_activations=True, layout="modelopt")
    if algo == "FP8_PER_CHANNEL_PER_TOKEN":
        return bs.fp8_channel(layout="modelopt")
    if algo == "FP8_PB_WO":
        # "Weight-only" by name, but vLLM's ModelOptFp8PbWoLinearMethod runs it W8A8: 128 × 128 weight blocks,
        # activations quantized per token in groups of 128, as fp8_block computes.
        return bs.fp8_block((128, 128), layout="modelopt")
    if algo in ("NVFP4", "W4A16_NVFP4"):
        # W4A16_NVFP4 stores NVFP4's weight tensors without an input_scale; jquant's NVFP4 runs weight-only,
        # as vLLM runs W4A16_NVFP4 (Marlin).
        _nvfp4_group(_get(inner, "group_size", int, 16, where=where), where)
        return bs.nvfp4(convention="modelopt")
    if algo == "MXFP8":
        return bs.mxfp8_modelopt()
    if algo in _MODELOPT_REFUSED:
        raise ValueError(f"{where}['quant_algo'] {algo!r} is not supported: {_MODELOPT_REFUSED[algo]}")
    raise ValueError(f"{where}['quant_algo'] must be 'FP8', 'FP8_PER_CHANNEL_PER_TOKEN', 'FP8_PB_WO', 'NVFP4', "
                     f"'W4A16_NVFP4' or 'MXFP8' for modelopt, got {algo!r}")


def _nvfp4_group(group: int, where: str) -> None:
    if group != 16:
        raise ValueError(f"{where}['group_size'] must be 16 for NVFP4 (one E4M3 scale per 16 values), got {group}")


def _bitsandbytes(cfg: dict) -> Scheme:
    # vLLM's get_safe_value reads a null field as its default (transformers writes every field).
    cfg = {k: v for k, v in cfg.items() if v is not None}
    if _get(cfg, "load_in_8bit", bool, False):
        if _get(cfg, "load_in_4bit", bool, False):
            raise ValueError("quantization_config: bitsandbytes config sets both load_in_8bit and load_in_4bit")
        if _get(cfg, "llm_int8_has_fp16_weight", bool, False):
            raise ValueError("quantization_config: llm_int8_has_fp16_weight keeps float16 weights for "
                             "training; such a checkpoint is not int8 (load it unquantized)")
        threshold = _get(cfg, "llm_int8_threshold", (int, float), DEFAULT_THRESHOLD)
        if isinstance(threshold, bool) or not math.isfinite(threshold) or threshold < 0:
            raise ValueError(f"quantization_config['llm_int8_threshold'] must be a finite number >= 0, "
                             f"got {threshold!r}")
        return bs.llm_int8(float(threshold))
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


def quant_method(quantization_config: dict) -> str:
    """The config's quantization method, as vLLM names it (hf_quant_config.json's nested form: modelopt)."""
    if not isinstance(quantization_config, dict):
        raise TypeError(f"quantization_config must be a dict, got {type(quantization_config).__name__}")
    if "quantization_config" in quantization_config:
        raise ValueError("this looks like a whole config.json (it has a 'quantization_config' key); pass "
                         "config['quantization_config'] instead")
    method = quantization_config.get("quant_method")
    if method is None and ("model_type" in quantization_config or "architectures" in quantization_config):
        raise ValueError("this looks like a config.json without a 'quantization_config' entry (it has "
                         "'model_type'/'architectures'): the model is not quantized; pass "
                         "config['quantization_config'] of a quantized model")
    if method is None and "quantization" in quantization_config:
        method = "modelopt"  # hf_quant_config.json carries no quant_method
    if not isinstance(method, str):
        raise ValueError(f"quantization_config needs a 'quant_method' string, got {method!r}")
    if method.lower() not in _METHODS:
        raise ValueError(f"quant_method {method!r} is not supported; supported: {sorted(set(_METHODS) - {'compressed_tensors'})}")
    return "compressed-tensors" if method.lower() == "compressed_tensors" else method.lower()


def scheme_from_config(quantization_config: dict) -> Scheme:
    """The Scheme for a HF ``quantization_config`` dict (the ``config.json`` entry vLLM reads).

    A whole ``config.json`` is refused with a hint to pass its ``quantization_config``.

    Examples:
      >>> import jquant
      >>> scheme = jquant.scheme_from_config({"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True})
      >>> scheme.name, scheme.checkpoint_layout, scheme.layout_kwargs()
      ('int4_g128', 'gptq', {'checkpoint_format': 'gptq', 'desc_act': False})
      >>> jquant.scheme_from_config({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True}).name
      'int4_g128_asym'
      >>> jquant.scheme_from_config({"quant_method": "fp8", "weight_block_size": [128, 128]}).name
      'fp8_e4m3_block128x128'
      >>> jquant.scheme_from_config({"quant_method": "hqq"})
      Traceback (most recent call last):
          ...
      ValueError: quant_method 'hqq' is not supported; supported: [...]
    """
    return _METHODS[quant_method(quantization_config)](quantization_config)


def _names(cfg: dict, key: str, where: str = "quantization_config") -> list[str]:
    names = _get(cfg, key, (list, tuple, type(None)), None, where=where) or []
    if not all(isinstance(n, str) for n in names):
        raise ValueError(f"{where}[{key!r}] must be a list of module names, got {names!r}")
    return list(names)


def _regex(pattern: str, key: str):
    try:
        return re.compile(pattern)
    except re.error as e:
        raise ValueError(f"quantization_config[{key!r}]: {pattern!r} is not a valid regex: {e}") from e


def _exact(names):
    return lambda module: module in names


def _substring(names):
    return lambda module: any(n in module for n in names)


def _compressed_tensors_ignore(cfg: dict):
    # vLLM: "re:<regex>" entries by re.match (anchored at the start only), others by equality.
    names = _names(cfg, "ignore")
    regexes = [_regex(n[3:], "ignore") for n in names if n.startswith("re:")]
    exact = {n for n in names if not n.startswith("re:")}
    targeted = _compressed_tensors_targets(cfg)
    return lambda module: module in exact or any(r.match(module) for r in regexes) or not targeted(module)


def _compressed_tensors_targets(cfg: dict):
    """Whether a linear module is one a config group targets (vLLM leaves a layer no target matches
    unquantized); no group naming targets narrows nothing."""
    groups = cfg.get("config_groups")
    if not isinstance(groups, dict):
        return lambda module: True
    targets = [group_targets(group, f"quantization_config['config_groups'][{name!r}]")
               for name, group in compressed_tensors_groups(cfg).items() if isinstance(group, dict)]
    targets = [t for t in targets if t is not None]
    if not targets:
        return lambda module: True
    return lambda module: any(by_name(module) or linear for by_name, linear in targets)


def group_targets(group: dict, where: str):
    """One config group's ``targets`` as (a predicate on module names, whether a class target names the
    Linear layers), None when it lists none. Names match by equality, "re:" regexes by re.match; a
    target without a dot is a class name (vLLM tries names and regexes before classes)."""
    targets = _names(group, "targets", where)
    if not targets:
        return None
    regexes = [_regex(t[3:], "targets") for t in targets if t.startswith("re:")]
    exact = {t for t in targets if not t.startswith("re:") and "." in t}
    linear = any(not t.startswith("re:") and "." not in t and t.endswith("Linear") for t in targets)
    return (lambda module: module in exact or any(r.match(module) for r in regexes)), linear


def _modelopt_exclude(cfg: dict):
    # vLLM: exact name, substring (older ModelOpt lists), or a glob (fnmatch) over the module name.
    inner = cfg.get("quantization", cfg)
    where = "quantization_config['quantization']" if inner is not cfg else "quantization_config"
    names = _names(inner, "exclude_modules", where) + (_names(cfg, "ignore") if inner is cfg else [])
    return lambda module: any(n in module or fnmatch.fnmatchcase(module, n) for n in names)


GPTQ_OVERRIDES = ("bits", "group_size", "desc_act", "sym")   # what vLLM's override_config reads


def gptq_dynamic_rules(cfg: dict) -> Callable[[str], "dict | bool | None"]:
    """GPTQModel's per-module ``dynamic`` rules as a function of module names, as vLLM's
    ``get_dynamic_override``: the first pattern (in the config's order) that re.matches the name
    decides; False for a "-:" exclusion, the overrides (``GPTQ_OVERRIDES`` keys) for a "+:" or bare
    pattern, None where none matches. A pattern that is no regex raises here."""
    rules = [(str(pattern).startswith("-:"),
              _regex(str(pattern).removeprefix("-:").removeprefix("+:"), "dynamic"),
              {k: v for k, v in (overrides or {}).items() if k in GPTQ_OVERRIDES})
             for pattern, overrides in (_get(cfg, "dynamic", (dict, type(None)), None) or {}).items()]

    def rule(module: str):
        for negative, regex, overrides in rules:
            if regex.match(module):
                return False if negative else overrides
        return None
    return rule


def _gptq_dynamic(cfg: dict) -> None:
    """Refuses ``dynamic`` rules that give modules other schemes: no one scheme describes the model."""
    dynamic = _get(cfg, "dynamic", (dict, type(None)), None) or {}
    overrides = [k for k, v in dynamic.items()
                 if not str(k).startswith("-:") and any(key in (v or {}) for key in GPTQ_OVERRIDES)]
    if overrides:
        raise ValueError(f"quantization_config['dynamic']: per-module overrides {overrides} give modules other "
                         "bits or group sizes: module_scheme(quantization_config) gives each module's scheme")


def _gptq_skip(cfg: dict):
    # GPTQModel's per-module "dynamic" rules: a "-:<regex>" matched first keeps a module unquantized.
    substring = _substring(_names(cfg, "modules_to_not_convert"))
    # vLLM: when 'modules_in_block_to_quantize' is given (AutoGPTQ / AutoRound write it, nested one list
    # per sequential step), only modules holding one of its entries as a substring are quantized.
    listed = _get(cfg, "modules_in_block_to_quantize", (list, tuple, type(None)), None)
    quantized = None
    if listed is not None:
        quantized = [n for entry in listed for n in (entry if isinstance(entry, (list, tuple)) else [entry])]
        if not all(isinstance(n, str) for n in quantized):
            raise ValueError("quantization_config['modules_in_block_to_quantize'] must be a list of module names "
                             f"(or of lists of them), got {listed!r}")
    rule = gptq_dynamic_rules(cfg)
    return lambda module: (substring(module) or rule(module) is False
                           or quantized is not None and not any(n in module for n in quantized))


def _bnb_skip(cfg: dict):
    # vLLM: a skip entry equal to one dotted component of the name, or to a dotted prefix of it.
    names = set(_names(cfg, "llm_int8_skip_modules")) | set(_names(cfg, "modules_to_not_convert"))

    def skipped(module: str) -> bool:
        parts = module.split(".")
        return any(p in names for p in parts) or any(".".join(parts[:i]) in names for i in range(1, len(parts) + 1))
    return skipped


def _fp8_skip(cfg: dict):
    # vLLM reads 'ignored_layers', else 'modules_to_not_convert', and matches whole module names.
    return _exact(set(_names(cfg, "ignored_layers") or _names(cfg, "modules_to_not_convert")))


def _mxfp4_skip(cfg: dict):
    names = _names(cfg, "modules_to_not_convert")  # gpt-oss lists globs ("model.layers.*.self_attn")
    # A listed module covers its submodules too (self_attn → self_attn.q_proj).
    return lambda module: any(fnmatch.fnmatchcase(module, n) or fnmatch.fnmatchcase(module, n + ".*")
                              for n in names)


_SKIPS = {
    "fp8": _fp8_skip,
    "awq": lambda cfg: _substring(_names(cfg, "modules_to_not_convert")),  # vLLM: substring of the name
    "gptq": _gptq_skip,
    "compressed-tensors": _compressed_tensors_ignore,
    "modelopt": _modelopt_exclude,
    "mxfp4": _mxfp4_skip,
    "bitsandbytes": _bnb_skip,
}


def skipped_modules(quantization_config: dict) -> Callable[[str], bool]:
    """A predicate on HF module names (``model.layers.0.mlp.down_proj``, ``lm_head``): True for the
    modules the config keeps in float, matched the way vLLM matches each format's list —
    compressed-tensors ``ignore`` (names, ``re:`` regexes), ``modules_to_not_convert`` (AWQ: substrings;
    fp8: whole names, or ``ignored_layers``; GPTQ: substrings, plus ``dynamic`` ``-:`` regexes and
    modules holding no entry of ``modules_in_block_to_quantize``;
    mxfp4: names or globs), bitsandbytes ``llm_int8_skip_modules`` (name components or dotted
    prefixes) and ModelOpt ``exclude_modules`` (names, substrings or globs)."""
    return _SKIPS[quant_method(quantization_config)](quantization_config)
