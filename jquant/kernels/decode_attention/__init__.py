"""Paged decode attention (one query token per sequence) over bf16 / fp8 / int8 KV pages."""

from jquant.kernels.decode_attention.api import choose_impl, decode_attention
from jquant.kernels.decode_attention.config import TuningConfig
from jquant.kernels.decode_attention.paged_cache import cache_decode_attention

__all__ = ["TuningConfig", "cache_decode_attention", "choose_impl", "decode_attention"]
