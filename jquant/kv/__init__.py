"""Quantized paged KV cache formats (vLLM kv_cache_dtype names) with pure-JAX references."""

from jquant.kv.attention_reference import attention_reference, dequantize_keys, dequantize_values
from jquant.kv.cache import PagedCache, default_skip_layers
from jquant.kv.dtypes import VALID_NAMES, KVCacheSpec, kv_cache_spec
from jquant.kv.insert_reference import append_reference, insert_reference
from jquant.kv.paged import PagedKVCache, allocate, slots_for, token_slots, validate_append
from jquant.kv.scalar import calibrate_kv_scales

__all__ = ["VALID_NAMES", "KVCacheSpec", "PagedCache", "PagedKVCache", "allocate", "append_reference",
           "attention_reference", "calibrate_kv_scales", "default_skip_layers", "dequantize_keys",
           "dequantize_values", "insert_reference", "kv_cache_spec", "slots_for", "token_slots", "validate_append"]
