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
from jquant.kv.paged import PagedKVCache


def new_token_slots(block_tables: jax.Array, positions: jax.Array, page_size: int) -> jax.Array:
    """Flat slots ``[B, T]`` of tokens at ``positions [B, T]``; -1 (not written) past a sequence's
    pages, so an overflowing sequence never writes into a page the clamped table lookup would hit."""
    max_pages = block_tables.shape[1]
    page_idx = positions // page_size
    page = jnp.take_along_axis(block_tables, jnp.clip(page_idx, 0, max_pages - 1), axis=1)
    return jnp.where(page_idx < max_pages, page * page_size + positions % page_size, -1)


def paged_attention(q: jax.Array, k: jax.Array, v: jax.Array, layer: PagedKVCache, block_tables: jax.Array,
                    lengths: jax.Array, positions: jax.Array, gqa_fn) -> tuple[jax.Array, PagedKVCache]:
    """Writes ``k, v [B, T, Hkv, D]`` at ``positions [B, T]`` (= lengths[:, None] + arange(T)) and
    attends ``q [B, T, Hq, D]`` over each sequence's context. Returns ``([B, T, Hq, D], layer)``.

    ``gqa_fn(q, k, v, mask)`` is the model's dense grouped-query attention (used for T > 1).
    A sequence whose new tokens do not fit its pages gets NaN outputs: nothing is written past its
    pages, and its answer must not look valid.
    """
    batch, t, hq, d = q.shape
    hkv = k.shape[2]
    slots = new_token_slots(block_tables, positions, layer.page_size)
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
        out = gqa_fn(q, keys, values, mask[:, None, None])
    overflow = total > _capacity(layer, block_tables)
    return jnp.where(overflow[:, None, None, None], jnp.nan, out).astype(q.dtype), layer


def _capacity(layer: PagedKVCache, block_tables: jax.Array) -> int:
    return block_tables.shape[1] * layer.page_size
