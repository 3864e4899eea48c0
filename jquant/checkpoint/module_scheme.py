"""Which scheme vLLM applies to each module of a checkpoint: one for the whole model, one per
compressed-tensors config group (llm-compressor's mixed-precision checkpoints), or GPTQModel's
per-module ``dynamic`` overrides of bits, group size, act-order and symmetry."""

from __future__ import annotations

from typing import Callable

from jquant.checkpoint.hf_config import (compressed_tensors_group_scheme, compressed_tensors_groups,
                                         gptq_dynamic_rules, group_targets, quant_method, scheme_from_config,
                                         skipped_modules)
from jquant.schemes.scheme import Scheme


def module_scheme(quantization_config: dict) -> Callable[[str], Scheme | None]:
    """A function of HF module names (``model.layers.0.mlp.down_proj``) to the scheme the config
    quantizes that module with, or None where it stays float (``skipped_modules``).

    A compressed-tensors config with several ``config_groups`` gives each module the scheme of the
    first group whose targets match it, as vLLM's ``find_matched_target``: module names and "re:"
    regexes first (in the config's order), then class names (``Linear``). A GPTQ config's ``dynamic``
    rules override the bits, group size, ``desc_act`` and ``sym`` of the modules they match first, as
    vLLM's ``override_config``.

    Examples:
      >>> from jquant.checkpoint.module_scheme import module_scheme
      >>> def group(targets, bits, strategy):
      ...     return {"targets": targets, "weights": {"num_bits": bits, "type": "int", "strategy": strategy,
      ...                                             "group_size": 32 if strategy == "group" else None}}
      >>> config = {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
      ...           "config_groups": {"group_0": group(["re:.*mlp.*"], 4, "group"),
      ...                             "group_1": group(["Linear"], 8, "channel")}}
      >>> scheme_of = module_scheme(config)
      >>> scheme_of("model.layers.0.mlp.down_proj").name, scheme_of("model.layers.0.self_attn.q_proj").name
      ('int4_g32', 'int8_ch')
      >>> scheme_of("lm_head") is None
      True
    """
    skipped = skipped_modules(quantization_config)
    method = quant_method(quantization_config)
    if method == "gptq":
        return _gptq_scheme_of(quantization_config, skipped)
    groups = compressed_tensors_groups(quantization_config) if method == "compressed-tensors" else {}
    if len(groups) <= 1:
        scheme = scheme_from_config(quantization_config)
        return lambda module: None if skipped(module) else scheme
    entries = []
    for name, group in groups.items():
        where = f"quantization_config['config_groups'][{name!r}]"
        targets = group_targets(group, where) if isinstance(group, dict) else None
        if targets is None:
            raise ValueError(f"{where} lists no targets: with several groups each must say which modules it "
                             "quantizes")
        entries.append((name, compressed_tensors_group_scheme(quantization_config, name, group), *targets))

    def scheme_of(module: str) -> Scheme | None:
        if skipped(module):
            return None
        by_name = next((scheme for _, scheme, match, _ in entries if match(module)), None)
        return by_name or next((scheme for _, scheme, _, linear in entries if linear), None)
    return scheme_of


def _gptq_scheme_of(quantization_config: dict, skipped) -> Callable[[str], Scheme | None]:
    base = {k: v for k, v in quantization_config.items() if k != "dynamic"}
    schemes: dict[tuple, Scheme] = {(): scheme_from_config(base)}   # a malformed config raises here
    rule = gptq_dynamic_rules(quantization_config)

    def scheme_of(module: str) -> Scheme | None:
        if skipped(module):
            return None
        overrides = rule(module) or {}
        key = tuple(sorted(overrides.items()))
        if key not in schemes:
            schemes[key] = scheme_from_config({**base, **overrides})
        return schemes[key]
    return scheme_of
