"""Paged decode attention as a Triton-backend Pallas kernel: split-K partials, XLA combine.

Grid (batch, kv_head block, split). A program owns the query heads of ``kv_heads_per_program`` KV
heads (their GQA groups, padded to 16 rows for Triton's dot; with several heads q is block-diagonal,
see ``TuningConfig``) and one contiguous run of the context. Each loop step gathers
``block_tokens`` rows of K and V straight from the page pool (row = slot * kv_heads + head of the
flattened ``[slots * kv_heads, head_dim]`` view: one contiguous head_dim run per token), widens the
codes to bf16 or f16 in registers (``config.operand_dtype_for``), and folds the per-(token, head)
scales into the logits (K) and the probabilities (V), so no dequantized copy of the cache exists.
Each split writes its unnormalised output, running max and sum; ``combine`` merges them by
log-sum-exp.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jquant.kernels.decode_attention.config import TuningConfig, fit_launch, operand_dtype_for, split_plan
from jquant.kernels.lowered_once import lowered_once

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
            num_pages, block_tokens, split_tokens, sm_scale, per_token, heads, group, operand):
    """``kv_heads``: head blocks of the pool view (KV heads / ``heads``); ``heads`` KV heads of
    ``group`` query heads each per program (q rows ``r`` of head ``r // group``)."""
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

    q, qs = _operand_q(q_ref[...], operand, sm_scale)       # [G16, heads · D], [G16, 1] or a scalar
    g16, d = q.shape
    iota = lax.iota(jnp.int32, block_tokens)
    if heads > 1:
        # own[r, j]: q row r belongs to head j of the block (rows past heads · group: none).
        own = (lax.broadcasted_iota(jnp.int32, (g16, heads), 0) // group
               == lax.broadcasted_iota(jnp.int32, (g16, heads), 1))

    def per_row(scales):
        """Per-(token, head) scales ``[T]`` (one head) or ``[T, heads]`` as ``[G16, T]``, each q row
        taking its own head's (a select, so another head's NaN scale stays in its rows)."""
        if heads == 1:
            return scales[None, :]
        return jnp.sum(jnp.where(own[:, None, :], scales[None, :, :], 0.0), axis=2)

    def step(i, carry):
        acc, m, l = carry
        tok = start + i * block_tokens + iota
        valid = tok < length
        # Tokens past the length read the split's first token instead (valid: start < end): pages past
        # a sequence may hold anything (NaN in a never-written page), and 0 · NaN would leak into the
        # sums. Redirecting the rows costs a select per token; zeroing the V tile took 291 of the 919
        # instructions a warp issued per step (the kernel's Triton IR compiled for sm_90 by Triton
        # 3.9's ptxas). A valid token's NaN reaches the output either way.
        row = pool_rows(bt_ref, b, h, jnp.where(valid, tok, start), page_size=page_size, kv_heads=kv_heads,
                        max_pages=max_pages, num_pages=num_pages)
        k = k_ref[row, :].astype(operand)                     # [T, heads · D]
        logits = plt.dot(q, k, trans_b=True)                  # [G16, T] f32
        if per_token:
            logits = logits * per_row(ks_ref[row])
        logits = jnp.where(valid[None, :], logits * qs, _MASK)
        m_new = jnp.maximum(m, jnp.max(logits, axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(logits - m_new[:, None])
        l_new = alpha * l + jnp.sum(p, axis=1)
        if per_token:
            p = p * per_row(vs_ref[row])
        p = jnp.where(valid[None, :], p, 0.0)
        v = v_ref[row, :].astype(operand)
        if per_token and operand == jnp.float16:
            # p · v_scale can sit far below float16's normal range (2^-14: V scales of 1e-5 are
            # plausible), so each row is divided by its largest term for the dot and multiplied back
            # after; bfloat16 has float32's range and needs none of this. A NaN or zero row keeps 1.
            top = jnp.max(p, axis=1)
            top = jnp.where(top > 0, top, 1.0)
            pv = plt.dot((p * (1.0 / top)[:, None]).astype(operand), v) * top[:, None]
        else:
            pv = plt.dot(p.astype(operand), v)
        acc = alpha[:, None] * acc + pv
        return acc, m_new, l_new

    init = (jnp.zeros((g16, d), jnp.float32), jnp.full((g16,), _MASK, jnp.float32),
            jnp.zeros((g16,), jnp.float32))
    acc, m, l = lax.fori_loop(0, n_steps, step, init)
    if heads > 1:   # row r's own head's columns of the block-diagonal product
        dh = d // heads
        acc = jnp.sum(jnp.where(own[:, :, None], acc.reshape(g16, heads, dh), 0.0), axis=1)
    o_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l


@lowered_once("sm_scale", "config", "interpret")
def partials(q, k_pages, v_pages, block_tables, lengths, k_scale, v_scale, *, sm_scale: float,
             config: TuningConfig | None, interpret: bool):
    """Per-split unnormalised outputs ``[S, B, Hkv, G, D]`` and running max / sum
    ``[S, B, Hkv, G]`` (float32; G query heads per KV head). ``k_scale``/``v_scale``: per-(token, head) arrays or None.
    ``config``: the launch (None: the default that fits in shared memory, ``fit_launch``)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plt

    batch, hq, d = q.shape
    num_pages, page_size, hkv, _ = k_pages.shape
    max_pages = block_tables.shape[1]
    group = hq // hkv
    config = fit_launch(config, d, k_pages.dtype.itemsize, page_size)
    heads = config.kv_heads_per_program
    if hkv % heads:
        raise ValueError(f"kv_heads_per_program={heads} must divide the KV heads ({hkv})")
    blocks = hkv // heads
    rows = heads * group
    g16 = -(-rows // 16) * 16
    block = config.block_tokens
    splits, split_tokens = split_plan(batch, blocks, max_pages * page_size, config)

    qg = q.reshape(batch, blocks, heads, group, d)
    if heads > 1:   # block-diagonal: row (j, g) holds q in head j's columns, zeros elsewhere
        eye = jnp.eye(heads, dtype=bool)[None, None, :, None, :, None]
        qg = jnp.where(eye, qg[:, :, :, :, None, :], jnp.zeros((), q.dtype))
    qg = qg.reshape(batch, blocks, rows, heads * d)
    if g16 != rows:
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, g16 - rows), (0, 0)))
    operand = jnp.dtype(operand_dtype_for(config, k_pages.dtype))
    per_token = k_scale is not None
    # Pool views of one row per (slot, head block): a token's ``heads`` heads are contiguous.
    args = [lengths.astype(jnp.int32), block_tables.astype(jnp.int32).reshape(-1), qg,
            k_pages.reshape(-1, heads * d), v_pages.reshape(-1, heads * d)]
    if per_token:
        scale_rows = (-1,) if heads == 1 else (-1, heads)
        args += [k_scale.astype(jnp.float32).reshape(scale_rows),
                 v_scale.astype(jnp.float32).reshape(scale_rows)]
    whole = lambda a: pl.BlockSpec(a.shape, lambda b, h, s, n=a.ndim: (0,) * n)
    in_specs = [whole(args[0]), whole(args[1]),
                pl.BlockSpec((None, None, g16, heads * d), lambda b, h, s: (b, h, 0, 0))]
    in_specs += [whole(a) for a in args[3:]]
    kernel = functools.partial(
        _kernel, page_size=page_size, kv_heads=blocks, max_pages=max_pages, num_pages=num_pages,
        block_tokens=block, split_tokens=split_tokens, sm_scale=float(sm_scale), per_token=per_token,
        heads=heads, group=group, operand=operand)
    out_shape = [jax.ShapeDtypeStruct((splits, batch, blocks, g16, d), jnp.float32),
                 jax.ShapeDtypeStruct((splits, batch, blocks, g16), jnp.float32),
                 jax.ShapeDtypeStruct((splits, batch, blocks, g16), jnp.float32)]
    out_specs = [pl.BlockSpec((None, None, None, g16, d), lambda b, h, s: (s, b, h, 0, 0)),
                 pl.BlockSpec((None, None, None, g16), lambda b, h, s: (s, b, h, 0)),
                 pl.BlockSpec((None, None, None, g16), lambda b, h, s: (s, b, h, 0))]
    o, m, l = pl.pallas_call(
        kernel, grid=(batch, blocks, splits), in_specs=in_specs, out_specs=out_specs,
        out_shape=out_shape, interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=config.num_warps,
                                           num_stages=config.num_stages),
        name=f"jquant_decode_attention_{k_pages.dtype.name}",
    )(*args)
    heads_of = lambda a: a[:, :, :, :rows].reshape(splits, batch, hkv, group, *a.shape[4:])
    return heads_of(o), heads_of(m), heads_of(l)


def _operand_q(q, operand, sm_scale: float):
    """A program's q rows ``[G16, D]`` in the dot's operand dtype, and what their logits are multiplied by.

    bfloat16: q rounded, the factor the softmax scale. float16 (5 exponent bits): each row is first
    scaled so its largest finite magnitude is 2^13, so no row overflows float16 or falls into its
    subnormals whatever q's magnitude (an extra float32 rounding, 2^-24, beside float16's 2^-11), and
    its factor ``[G16, 1]`` carries the scale back. A non-finite value neither steers its row's scale
    nor leaves its row (NaN in, NaN out). In the kernel, once a program: in XLA it is a row reduction
    and its consumers before every layer's kernel, in a decode step bound by its launches at B = 1.
    """
    if operand == jnp.bfloat16:
        return q.astype(operand), sm_scale
    qf = q.astype(jnp.float32)
    mag = jnp.abs(qf)
    amax = jnp.max(jnp.where(mag < jnp.inf, mag, 0.0), axis=1, keepdims=True)
    amax = jnp.maximum(amax, 1e-30)                 # a zero row: any factor; 2^13 / 1e-30 stays finite
    return (qf * (8192.0 / amax)).astype(operand), amax * (sm_scale / 8192.0)


def combine(o, m, l):
    """Log-sum-exp merge of the splits: ``[B, Hkv, G, D]`` float32; zero where no token was seen
    (length 0), never NaN from the merge itself, NaN where the partials hold one."""
    m_all = jnp.max(m, axis=0)
    # A split that saw no token (l = 0, m the mask) weighs nothing. Not left to exp: where XLA
    # contracts a scaled m (the TurboQuant kernel's m · ln 2) into an FMA, mask − mask is the
    # product's rounding residual (up to ~4e22 at 7e29), not 0, and exp of it inf, inf · 0 NaN
    # (a length-0 sequence came out NaN under jit on the CPU).
    w = jnp.where(l == 0, 0.0, jnp.exp(m - m_all[None]))
    den = jnp.sum(w * l, axis=0)
    num = jnp.sum(w[..., None] * o, axis=0)
    # den is ≥ 1 once a split saw a token (its max term is exp(0)) and 0 only when none did; keyed
    # on den == 0, not den > 0, so a NaN from the cache (a NaN K scale: den NaN) shows as NaN.
    empty = den == 0
    return jnp.where(empty[..., None], 0.0, num / jnp.where(empty, 1.0, den)[..., None])
