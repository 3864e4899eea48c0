"""Decode attention over one layer of a ``jquant.kv`` paged cache, whatever its format.

bf16, per-tensor FP8 and per-(token, head) INT8/FP8 pages go to ``decode_attention`` (the Pallas
kernel on a CUDA GPU, XLA elsewhere); TurboQuant pages are scored in the rotated domain by the
pure-JAX path (``jquant.kv.attention_reference``), which never forms dequantized keys.
"""

from __future__ import annotations

import jax

from jquant.kernels.decode_attention.api import decode_attention
from jquant.kernels.decode_attention.config import TuningConfig
from jquant.kv.attention_reference import attention_reference
from jquant.kv.paged import PagedKVCache


def cache_decode_attention(q: jax.Array, layer: PagedKVCache, block_tables: jax.Array, lengths: jax.Array,
                           *, impl: str = "auto", config: TuningConfig | None = None) -> jax.Array:
    """``q [B, Hq, D]`` against each sequence's first ``lengths[b]`` cached tokens; ``[B, Hq, D]`` in
    q's dtype (zeros for a sequence of length 0). ``config``: the kernel's launch (None: its default)."""
    kind = layer.spec.kind
    if kind == "turboquant":
        return attention_reference(q, layer, block_tables, lengths).astype(q.dtype)
    scales = {} if kind == "dense" else dict(k_scale=layer.k_scale, v_scale=layer.v_scale)
    return decode_attention(q, layer.k_pages, layer.v_pages, block_tables, lengths, impl=impl, config=config,
                            **scales)
