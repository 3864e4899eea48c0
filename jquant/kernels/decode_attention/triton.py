"""Paged decode attention as a Triton-backend Pallas kernel: split-K partials, XLA combine.

Grid (batch, kv_head, split). A program owns the query heads of one KV head (the GQA group,
padded to 16 rows for Triton's dot) and one contiguous run of the context. Each loop step gathers
``block_tokens`` rows of K and V straight from the page pool (row = slot * kv_heads + head of the
flattened ``[slots * kv_heads, head_dim]`` view: one contiguous head_dim run per token), widens the
codes to bf16 in registers, and folds the per-(token, head) scales into the logits (K) and the
probabilities (V), so no dequantized copy of the cache exists. Each split writes its unnormalised
output, running max and sum; ``combine`` merges them by log-sum-exp.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jquant.kernels.decode_attention.config import TuningConfig, split_plan

# A finite "minus infinity": exp(mask - max) is 0 and mask - mask stays finite, so a split with
# no tokens leaves m = _MASK, l = 0 and never produces a NaN.
_MASK = -1e30


def pool_rows(bt_ref, b, h, tok, *, page_size, kv_heads, max_pages, num_pages):
    """Rows of the flattened ``[slots * kv_heads, D]`` pool holding tokens ``tok`` of sequence ``b``,
    KV head ``h``; page indices are clamped into the pool, so a bad table never reads outside memory."""
    pidx = jnp.minimum(lax.div(tok, page_size), max_pages - 1)
    page = bt_ref[b * max_pages + pidx]
    page = jnp.minimum(jnp.maximum(page, 0), num_pages - 1)
    return (page * page_size + lax.rem(tok, page_size)) * kv_heads + h


def _kernel(lengths_ref, bt_ref, q_ref, k_ref, v_ref, *rest, page_size, kv_heads, max_pages,
            num_pages, block_tokens, split_tokens, sm_scale, per_token):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plt

    if per_token:
        ks_ref, vs_ref, o_ref, m_ref, l_ref = rest
    else:
        o_ref, m_ref, l_ref = rest
    b, h, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    length = lengths_ref[b]
    start = s * split_tokens
    end = jnp.minimum(length, start + split_tokens)
    n_steps = lax.div(jnp.maximum(end - start, 0) + (block_tokens - 1), block_tokens)

    q = q_ref[...].astype(jnp.bfloat16)                       # [G16, D]
    g16, d = q.shape
    iota = lax.iota(jnp.int32, block_tokens)

    def step(i, carry):
        acc, m, l = carry
        tok = start + i * block_tokens + iota
        valid = tok < length
        row = pool_rows(bt_ref, b, h, tok, page_size=page_size, kv_heads=kv_heads, max_pages=max_pages,
                        num_pages=num_pages)
        k = k_ref[row, :].astype(jnp.bfloat16)                # [T, D]
        logits = plt.dot(q, k, trans_b=True)                  # [G16, T] f32
        if per_token:
            logits = logits * ks_ref[row][None, :]
        logits = jnp.where(valid[None, :], logits * sm_scale, _MASK)
        m_new = jnp.maximum(m, jnp.max(logits, axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(logits - m_new[:, None])
        l_new = alpha * l + jnp.sum(p, axis=1)
        if per_token:
            p = p * vs_ref[row][None, :]
        # Rows past the length may hold anything (NaN in a never-written page): zero them, since
        # 0 * NaN would leak into the sum.
        p = jnp.where(valid[None, :], p, 0.0)
        v = jnp.where(valid[:, None], v_ref[row, :].astype(jnp.bfloat16), jnp.bfloat16(0))
        acc = alpha[:, None] * acc + plt.dot(p.astype(jnp.bfloat16), v)
        return acc, m_new, l_new

    init = (jnp.zeros((g16, d), jnp.float32), jnp.full((g16,), _MASK, jnp.float32),
            jnp.zeros((g16,), jnp.float32))
    acc, m, l = lax.fori_loop(0, n_steps, step, init)
    o_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l


def partials(q, k_pages, v_pages, block_tables, lengths, k_scale, v_scale, *, sm_scale: float,
             config: TuningConfig, interpret: bool):
    """Per-split unnormalised outputs ``[S, B, Hkv, G16, D]`` and running max / sum
    ``[S, B, Hkv, G16]`` (float32). ``k_scale``/``v_scale``: per-(token, head) arrays or None."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plt

    batch, hq, d = q.shape
    num_pages, page_size, hkv, _ = k_pages.shape
    max_pages = block_tables.shape[1]
    group = hq // hkv
    g16 = -(-group // 16) * 16
    block = config.block_tokens
    splits, split_tokens = split_plan(batch, hkv, max_pages * page_size, config)

    qg = q.reshape(batch, hkv, group, d)
    if g16 != group:
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, g16 - group), (0, 0)))
    per_token = k_scale is not None
    args = [lengths.astype(jnp.int32), block_tables.astype(jnp.int32).reshape(-1), qg,
            k_pages.reshape(-1, d), v_pages.reshape(-1, d)]
    if per_token:
        args += [k_scale.astype(jnp.float32).reshape(-1), v_scale.astype(jnp.float32).reshape(-1)]
    whole = lambda a: pl.BlockSpec(a.shape, lambda b, h, s, n=a.ndim: (0,) * n)
    in_specs = [whole(args[0]), whole(args[1]),
                pl.BlockSpec((None, None, g16, d), lambda b, h, s: (b, h, 0, 0))]
    in_specs += [whole(a) for a in args[3:]]
    kernel = functools.partial(
        _kernel, page_size=page_size, kv_heads=hkv, max_pages=max_pages, num_pages=num_pages,
        block_tokens=block, split_tokens=split_tokens, sm_scale=float(sm_scale),
        per_token=per_token)
    out_shape = [jax.ShapeDtypeStruct((splits, batch, hkv, g16, d), jnp.float32),
                 jax.ShapeDtypeStruct((splits, batch, hkv, g16), jnp.float32),
                 jax.ShapeDtypeStruct((splits, batch, hkv, g16), jnp.float32)]
    out_specs = [pl.BlockSpec((None, None, None, g16, d), lambda b, h, s: (s, b, h, 0, 0)),
                 pl.BlockSpec((None, None, None, g16), lambda b, h, s: (s, b, h, 0)),
                 pl.BlockSpec((None, None, None, g16), lambda b, h, s: (s, b, h, 0))]
    o, m, l = pl.pallas_call(
        kernel, grid=(batch, hkv, splits), in_specs=in_specs, out_specs=out_specs,
        out_shape=out_shape, interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=config.num_warps,
                                           num_stages=config.num_stages),
        name=f"jquant_decode_attention_{k_pages.dtype.name}",
    )(*args)
    return o[:, :, :, :group], m[:, :, :, :group], l[:, :, :, :group]


def combine(o, m, l):
    """Log-sum-exp merge of the splits: ``[B, Hkv, G, D]`` float32; zero where no token was seen
    (length 0), never NaN from the merge itself."""
    m_all = jnp.max(m, axis=0)
    w = jnp.exp(m - m_all[None])
    den = jnp.sum(w * l, axis=0)
    num = jnp.sum(w[..., None] * o, axis=0)
    return jnp.where(den[..., None] > 0, num / jnp.where(den > 0, den, 1.0)[..., None], 0.0)
