"""kv_cache_dtype names (vLLM's spelling) and what one cached token costs.

Facts from vLLM (vllm/config/cache.py CacheDType; turboquant/config.py TQ_PRESETS and its
key_packed_size / value_packed_size): TurboQuant keys hold ceil(d*b/8) index bytes + an fp16 norm,
values ceil(d*b/8) bytes + fp16 scale + fp16 min; k8v4 keys are plain fp8 (d bytes).
vLLM's per-(token, head) variants are named int8_per_token_head / fp8_per_token_head, scales float32.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import jax.numpy as jnp

Kind = Literal["dense", "per_tensor", "per_token_head", "turboquant"]


@dataclasses.dataclass(frozen=True)
class KVCacheSpec:
    """One kv_cache_dtype: how keys and values are stored (``kind``, element formats, bits) and what a
    token costs.

    Examples:
      TurboQuant 4-bit keys hold packed indices and an fp16 norm; values packed codes, an fp16 scale
      and an fp16 minimum:

      >>> from jquant.kv import kv_cache_spec
      >>> spec = kv_cache_spec("turboquant_4bit_nc")
      >>> spec.kind, spec.key_format, spec.value_format, spec.norm_correction
      ('turboquant', 'lloyd_max', 'uniform', True)
      >>> spec.key_bytes(128), spec.value_bytes(128), spec.bytes_per_token_per_head(128)
      (66, 68, 134)
      >>> kv_cache_spec("bf16").bytes_per_token_per_head(128)
      512
    """

    name: str
    kind: Kind
    key_format: str  # bf16 | fp8_e4m3 | fp8_e5m2 | int8 | lloyd_max
    value_format: str  # bf16 | fp8_e4m3 | fp8_e5m2 | int8 | uniform
    key_bits: int
    value_bits: int
    norm_correction: bool = False

    def key_bytes(self, head_dim: int) -> int:
        if self.key_format == "lloyd_max":
            return math.ceil(head_dim * self.key_bits / 8) + 2  # + fp16 norm
        side = 4 if self.kind == "per_token_head" else 0
        return head_dim * self.key_bits // 8 + side

    def value_bytes(self, head_dim: int) -> int:
        if self.value_format == "uniform":
            return math.ceil(head_dim * self.value_bits / 8) + 4  # + fp16 scale, fp16 min
        side = 4 if self.kind == "per_token_head" else 0
        return head_dim * self.value_bits // 8 + side

    def bytes_per_token_per_head(self, head_dim: int) -> int:
        """K + V bytes one token costs in one KV head (per-tensor scalars excluded)."""
        return self.key_bytes(head_dim) + self.value_bytes(head_dim)


_FP8 = {"fp8_e4m3": jnp.float8_e4m3fn, "fp8_e5m2": jnp.float8_e5m2}

_SPECS = {
    "bf16": KVCacheSpec("bf16", "dense", "bf16", "bf16", 16, 16),
    "fp8_e4m3": KVCacheSpec("fp8_e4m3", "per_tensor", "fp8_e4m3", "fp8_e4m3", 8, 8),
    "fp8_e5m2": KVCacheSpec("fp8_e5m2", "per_tensor", "fp8_e5m2", "fp8_e5m2", 8, 8),
    "int8_per_token_head": KVCacheSpec("int8_per_token_head", "per_token_head", "int8", "int8", 8, 8),
    "fp8_per_token_head": KVCacheSpec(
        "fp8_per_token_head", "per_token_head", "fp8_e4m3", "fp8_e4m3", 8, 8
    ),
    "turboquant_k8v4": KVCacheSpec("turboquant_k8v4", "turboquant", "fp8_e4m3", "uniform", 8, 4),
    "turboquant_4bit_nc": KVCacheSpec(
        "turboquant_4bit_nc", "turboquant", "lloyd_max", "uniform", 4, 4, True
    ),
    "turboquant_k3v4_nc": KVCacheSpec(
        "turboquant_k3v4_nc", "turboquant", "lloyd_max", "uniform", 3, 4, True
    ),
    "turboquant_3bit_nc": KVCacheSpec(
        "turboquant_3bit_nc", "turboquant", "lloyd_max", "uniform", 3, 3, True
    ),
}
_ALIASES = {"auto": "bf16", "bfloat16": "bf16", "fp8": "fp8_e4m3"}
VALID_NAMES = tuple(sorted(set(_SPECS) | set(_ALIASES)))


def kv_cache_spec(name: str) -> KVCacheSpec:
    """The spec of a kv_cache_dtype name; unknown names raise ValueError listing the valid ones.

    Examples:
      >>> from jquant.kv import kv_cache_spec
      >>> spec = kv_cache_spec("fp8")  # vLLM's alias of fp8_e4m3
      >>> spec.name, spec.kind, spec.bytes_per_token_per_head(64)
      ('fp8_e4m3', 'per_tensor', 128)
      >>> kv_cache_spec("int4")
      Traceback (most recent call last):
          ...
      ValueError: unknown kv_cache_dtype 'int4'; valid: auto, bf16, bfloat16, fp8, ...
    """
    key = _ALIASES.get(name, name)
    if key not in _SPECS:
        raise ValueError(f"unknown kv_cache_dtype {name!r}; valid: {', '.join(VALID_NAMES)}")
    return _SPECS[key]


def storage_dtype(fmt: str):
    """Element dtype of a non-packed page format."""
    if fmt == "bf16":
        return jnp.bfloat16
    if fmt == "int8":
        return jnp.int8
    return _FP8[fmt]
