"""The XLA path of paged decode attention: gather each sequence's pages, dequantize, masked
softmax. What ``impl="xla"`` runs on CPU and the baseline the kernel is timed against."""

from __future__ import annotations

import jax.numpy as jnp


def decode_attention_xla(q, k_pages, v_pages, block_tables, lengths, k_scale, v_scale, *,
                         sm_scale: float):
    """``[B, Hq, D]`` float32. ``k_scale``/``v_scale``: per-(token, head) ``[P, S, Hkv]`` or None
    (per-tensor scales are folded in by the caller)."""
    batch, hq, d = q.shape
    num_pages, page_size, hkv, _ = k_pages.shape
    max_pages = block_tables.shape[1]
    bt = jnp.clip(block_tables, 0, num_pages - 1)
    k = k_pages[bt].astype(jnp.float32).reshape(batch, max_pages * page_size, hkv, d)
    v = v_pages[bt].astype(jnp.float32).reshape(batch, max_pages * page_size, hkv, d)
    if k_scale is not None:
        k = k * k_scale[bt].reshape(batch, -1, hkv)[..., None]
        v = v * v_scale[bt].reshape(batch, -1, hkv)[..., None]
    valid = jnp.arange(max_pages * page_size)[None, :] < lengths[:, None]          # [B, T]
    v = jnp.where(valid[:, :, None, None], v, 0.0)
    qg = q.astype(jnp.float32).reshape(batch, hkv, hq // hkv, d)
    logits = jnp.einsum("bhgd,bthd->bhgt", qg, k) * sm_scale
    logits = jnp.where(valid[:, None, None, :], logits, -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True)
    p = jnp.exp(logits - jnp.where(jnp.isfinite(m), m, 0.0))
    p = jnp.where(valid[:, None, None, :], p, 0.0)
    den = jnp.sum(p, axis=-1, keepdims=True)
    out = jnp.einsum("bhgt,bthd->bhgd", p, v) / jnp.where(den > 0, den, 1.0)
    return out.reshape(batch, hq, d)
