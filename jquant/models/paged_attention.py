"""The attention of one decoder layer over a paged (possibly quantized) KV cache.

New tokens are quantized into their slots first, then attended over together with the cached
context, so every query sees the keys and values as the cache stores them (a prompt processed in
one call scores exactly as if it had been fed token by token). One new token per sequence (decode)
runs the paged decode-attention kernel; several (prefill) gather and dequantize the sequence's
pages and run a causal softmax over them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jquant.kernels import kv_insert
from jquant.kernels.decode_attention import cache_decode_attention
from jquant.kv.attention_reference import dequantize_keys, dequantize_values
from jquant.kv.paged import PagedKVCache, token_slots, validate_append


def paged_attention(q: jax.Array, k: jax.Array, v: jax.Array, layer: PagedKVCache, block_tables: jax.Array,
                    lengths: jax.Array, positions: jax.Array, gqa_fn) -> tuple[jax.Array, PagedKVCache]:
    """Writes ``k, v [B, T, Hkv, D]`` at ``positions [B, T]`` (= lengths[:, None] + arange(T)) and
    attends ``q [B, T, Hq, D]`` over each sequence's context. Returns ``([B, T, Hq, D], layer)``.

    ``gqa_fn(q, k, v, mask)`` is the model's dense grouped-query attention (used for T > 1; k, v
    [B, Hkv, L, D]).

    Bad tables and lengths: with concrete ``block_tables`` and ``lengths`` (eager), ``validate_append``
    raises before anything is written (a sequence past its pages, a negative length, a used page
    outside the pool, a page two sequences own). Under jit nothing can raise: a token outside its
    sequence's pages (past the last, or at a negative position) is not written, and a sequence whose new
    tokens do not fit, whose length is negative or whose used pages lie outside the pool gets NaN
    outputs, as its answer must not look valid. Two sequences sharing a page are not detected under jit.
    """
    batch, t, hq, d = q.shape
    hkv = k.shape[2]
    if not any(isinstance(a, jax.core.Tracer) for a in (block_tables, lengths)):
        validate_append(block_tables, lengths, t, layer.num_pages, layer.page_size)
    # A sequence of negative length writes nothing, even where its positions reach 0 (its own stored tokens).
    slots = jnp.where((lengths >= 0)[:, None], token_slots(block_tables, positions, layer.page_size), -1)
    layer = kv_insert.insert(layer, k.reshape(batch * t, hkv, d), v.reshape(batch * t, hkv, d),
                             slots.reshape(-1))
    total = lengths + t
    if t == 1:
        out = cache_decode_attention(q[:, 0], layer, block_tables, jnp.minimum(total, _capacity(layer, block_tables)))
        out = out[:, None]
    else:
        keys = dequantize_keys(layer, block_tables).astype(q.dtype)     # [B, L, Hkv, D]
        values = dequantize_values(layer, block_tables).astype(q.dtype)
        key_pos = jnp.arange(keys.shape[1], dtype=jnp.int32)
        # Slots past a sequence's length may hold anything (another owner's stale tokens): a zero
        # probability times NaN would still poison the sum.
        values = jnp.where((key_pos[None, :] < total[:, None])[:, :, None, None], values, 0)
        mask = key_pos[None, None, :] <= positions[:, :, None]          # [B, T, L]
        out = gqa_fn(q, keys.transpose(0, 2, 1, 3), values.transpose(0, 2, 1, 3), mask[:, None, None])
    capacity = _capacity(layer, block_tables)
    used = jnp.arange(block_tables.shape[1])[None, :] < -(-jnp.minimum(total, capacity) // layer.page_size)[:, None]
    outside = jnp.any(used & ((block_tables < 0) | (block_tables >= layer.num_pages)), axis=1)
    invalid = (total > capacity) | (lengths < 0) | outside
    return jnp.where(invalid[:, None, None, None], jnp.nan, out).astype(q.dtype), layer


def _capacity(layer: PagedKVCache, block_tables: jax.Array) -> int:
    return block_tables.shape[1] * layer.page_size
