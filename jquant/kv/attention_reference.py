"""Pure-JAX decode attention over a paged quantized cache (one query token per sequence, GQA).

TurboQuant keys are scored in the rotated domain: q is rotated once and dotted with the (norm-
corrected) centroid vectors times the key norm; dequantized keys are never formed.
Sequences of length 0 give zeros.
"""

from __future__ import annotations

import jax.numpy as jnp

from jquant.kv import turboquant
from jquant.kv.paged import PagedKVCache


def _gather(arr, block_tables, num_pages):
    """[P, S, ...] -> [B, max_pages * S, ...] in each sequence's token order."""
    g = arr[jnp.clip(block_tables, 0, num_pages - 1)]
    return g.reshape(g.shape[0], g.shape[1] * g.shape[2], *g.shape[3:])


def _side(x, block_tables, num_pages):
    return _gather(x, block_tables, num_pages).astype(jnp.float32) if x.ndim == 3 else x


def dequantize_values(cache: PagedKVCache, block_tables):
    """Each sequence's values ``[B, max_pages * page_size, kv_heads, D]`` float32.

    Examples:
      >>> import jax.numpy as jnp
      >>> from jquant.kv import allocate, dequantize_values
      >>> cache = allocate("fp8", num_pages=4, page_size=4, kv_heads=2, head_dim=16)
      >>> values = dequantize_values(cache, jnp.array([[0, 1], [2, 3]], jnp.int32))
      >>> values.shape, str(values.dtype)
      ((2, 8, 2, 16), 'float32')
    """
    spec, p = cache.spec, cache.num_pages
    vc = _gather(cache.v_pages, block_tables, p)
    if spec.value_format == "uniform":
        return turboquant.dequantize_values(vc, _side(cache.v_scale, block_tables, p),
                                            _side(cache.v_min, block_tables, p), spec.value_bits)
    s = _side(cache.v_scale, block_tables, p)
    return vc.astype(jnp.float32) * (s[..., None] if s.ndim else s)


def dequantize_keys(cache: PagedKVCache, block_tables):
    """Each sequence's keys ``[B, max_pages * page_size, kv_heads, D]`` float32 (TurboQuant keys
    rotated back; the decode path never forms these, the prefill path attends over them).

    Examples:
      >>> import jax.numpy as jnp
      >>> from jquant.kv import allocate, dequantize_keys
      >>> cache = allocate("fp8", num_pages=4, page_size=4, kv_heads=2, head_dim=16, k_scale=0.5)
      >>> keys = dequantize_keys(cache, jnp.array([[0, 1], [2, 3]], jnp.int32))  # pages 0, 1 | 2, 3
      >>> keys.shape, str(keys.dtype)
      ((2, 8, 2, 16), 'float32')
    """
    spec, p, d = cache.spec, cache.num_pages, cache.head_dim
    kc = _gather(cache.k_pages, block_tables, p)
    if spec.key_format == "lloyd_max":
        return turboquant.dequantize_keys(kc, _side(cache.k_scale, block_tables, p), spec.key_bits, d,
                                          spec.norm_correction)
    ks = _side(cache.k_scale, block_tables, p)
    return kc.astype(jnp.float32) * (ks[..., None] if ks.ndim else ks)


def key_scores(q, cache: PagedKVCache, block_tables):
    """q [B, Hq, D] -> unscaled logits [B, Hq, L]."""
    spec, p, d = cache.spec, cache.num_pages, cache.head_dim
    b, hq, _ = q.shape
    g = hq // cache.kv_heads
    qg = q.astype(jnp.float32).reshape(b, cache.kv_heads, g, d)
    kc = _gather(cache.k_pages, block_tables, p)
    if spec.key_format == "lloyd_max":
        qr = qg @ turboquant.rotation(d)
        c = turboquant.rotated_key_directions(kc, spec.key_bits, d, spec.norm_correction)
        s = jnp.einsum("bhgd,blhd->bhgl", qr, c) * jnp.swapaxes(
            _side(cache.k_scale, block_tables, p), 1, 2)[:, :, None, :]
    else:
        ks = _side(cache.k_scale, block_tables, p)
        k = kc.astype(jnp.float32) * (ks[..., None] if ks.ndim else ks)
        s = jnp.einsum("bhgd,blhd->bhgl", qg, k)
    return s.reshape(b, hq, -1)


def attention_reference(q, cache: PagedKVCache, block_tables, lengths, *, scale=None):
    """softmax(q.k * scale) @ v over each sequence's first lengths[b] tokens; float32 [B, Hq, D].

    Examples:
      With one cached token, every query head reads that token's value; a sequence of length 0 gives
      zeros:

      >>> import jax.numpy as jnp, numpy as np
      >>> from jquant.kv import allocate, append_reference, attention_reference
      >>> cache = allocate("bf16", num_pages=2, page_size=4, kv_heads=1, head_dim=16)
      >>> block_tables = jnp.array([[0], [1]], jnp.int32)
      >>> rng = np.random.default_rng(0)
      >>> k, v = (jnp.asarray(rng.standard_normal((2, 1, 16)), jnp.bfloat16) for _ in range(2))
      >>> cache, lengths = append_reference(cache, k, v, block_tables, jnp.array([0, 0], jnp.int32))
      >>> q = jnp.asarray(rng.standard_normal((2, 2, 16)), jnp.float32)  # [B, query heads, D] (GQA 2:1)
      >>> out = attention_reference(q, cache, block_tables, lengths)
      >>> out.shape, bool(jnp.allclose(out[0], v[0].astype(jnp.float32)))
      ((2, 2, 16), True)
      >>> float(jnp.abs(attention_reference(q, cache, block_tables, jnp.array([1, 0]))[1]).max())
      0.0
    """
    b, hq, d = q.shape
    if d != cache.head_dim or hq % cache.kv_heads:
        raise ValueError(f"q [B, Hq, D] needs D={cache.head_dim} and Hq a multiple of "
                         f"{cache.kv_heads}; got {q.shape}")
    scale = d**-0.5 if scale is None else scale
    logits = key_scores(q, cache, block_tables) * scale
    valid = jnp.arange(logits.shape[-1])[None, :] < jnp.asarray(lengths)[:, None]
    logits = jnp.where(valid[:, None, :], logits, -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True)
    w = jnp.where(valid[:, None, :], jnp.exp(logits - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
    den = jnp.sum(w, axis=-1, keepdims=True)
    v = dequantize_values(cache, block_tables)  # [B, L, Hkv, D]
    # Slots past a length may hold anything (NaN scales of a page nobody owns): 0 * NaN is NaN.
    v = jnp.where(valid[:, :, None, None], v, 0.0)
    g = hq // cache.kv_heads
    vg = jnp.repeat(v, g, axis=2)  # query head h reads kv head h // g
    out = jnp.einsum("bhl,blhd->bhd", w, vg)
    # Keyed on length, not on den > 0, so a NaN in a sequence's cache shows up in its output.
    has = (jnp.asarray(lengths) > 0)[:, None, None]
    return jnp.where(has, out / jnp.where(has, den, 1.0), 0.0)
