"""Quantize-and-insert of new tokens into the paged KV cache as one Triton-backend Pallas kernel.

Grid (kv_head, token block). A program loads ``block_tokens`` rows of K and V of one KV head
(row = token * kv_heads + head of the flattened ``[T * kv_heads, D]`` inputs), quantizes them in
registers and stores codes and side arrays at row ``slot * kv_heads + head`` of the flattened page
pool ``[P * S * kv_heads, D or packed bytes]``, in place (the pool is aliased to the output). Rows
whose slot is negative or past the pool are masked out of every store, so their old contents stay.

Every step mirrors ``insert_reference`` as XLA computes it, so codes and scales are bit-identical:

* XLA rewrites ``x / constant`` into ``x * (1 / constant)`` (its algebraic simplifier), so divisions
  by a constant here are multiplications by the same float32 reciprocal. The reference divides by
  data correctly rounded (``exact_divide``); Triton's ``/`` is the approximate ``div.full.f32``, so
  the kernel divides with the IEEE ``div.rn.f32`` (inline PTX).
* Triton's min/max drop NaN where XLA's propagate it: NaN is carried explicitly.

Covered: bf16, per-tensor FP8 (e4m3 / e5m2), per-(token, head) INT8 / FP8 and TurboQuant k8v4 (FP8 keys,
4-bit uniform values); head_dim a power of two ≥ 16. TurboQuant's Lloyd-Max keys are not: their
Hadamard rotation is a float32 dot and their norm a float32 sum, whose last bits depend on the
summation order, which a Triton kernel cannot reproduce from XLA's (cuBLAS, TF32 or not).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jquant.kernels.lowered_once import lowered_once
from jquant.kernels.triton_exact import clip_keep_nan, ieee_divide, max_keep_nan, row_abs_max, row_has_nan
from jquant.kernels.triton_launch import check_num_warps, check_power_of_two
from jquant.kv import scalar
from jquant.kv.dtypes import KVCacheSpec
from jquant.kv.paged import PagedKVCache


@dataclasses.dataclass(frozen=True)
class InsertConfig:
    """block_tokens: new tokens per program (a power of two; fewer when T is smaller);
    num_warps: Triton's warps per program.

    Examples:
      >>> from jquant.kernels.kv_insert import InsertConfig
      >>> InsertConfig(block_tokens=16, num_warps=8)
      InsertConfig(block_tokens=16, num_warps=8)
      >>> InsertConfig(block_tokens=24)
      Traceback (most recent call last):
          ...
      ValueError: block_tokens must be a power of two, got 24
    """

    block_tokens: int = 32
    num_warps: int = 4

    def __post_init__(self):
        check_power_of_two("block_tokens", self.block_tokens)
        check_num_warps(self.num_warps)


def covers_format(spec: KVCacheSpec) -> bool:
    """Whether the kernel writes this format at some head_dim: all but Lloyd-Max TurboQuant keys."""
    return spec.kind != "turboquant" or (spec.key_format == "fp8_e4m3" and spec.value_bits == 4)


def covers(spec: KVCacheSpec, head_dim: int) -> bool:
    """Whether the kernel writes this format at this head_dim (else the caller falls back to the
    reference)."""
    return covers_format(spec) and head_dim >= 16 and not head_dim & (head_dim - 1)


def _recip(c: float) -> np.float32:
    """The float32 1 / c XLA multiplies by where the reference divides by the constant c."""
    return np.float32(1.0) / np.float32(c)


def _encode(x, scale, fmt: str, interpret: bool):
    """``scalar.encode``: codes of x / scale (scale None: 1, no division) in fmt."""
    y = x if scale is None else ieee_divide(x, scale, interpret)
    if fmt == "int8":   # +-0.5 and clamp; the int8 store truncates, as the reference's convert does
        y = jnp.where(jnp.isnan(y), 0.0, y)   # XLA converts NaN to 0
        return jnp.minimum(jnp.maximum(jnp.where(y >= 0, y + 0.5, y - 0.5), -128.0), 127.0)
    m = scalar.fmt_max(fmt)
    return clip_keep_nan(y, -m, m)


def _token_head_scale(x, fmt: str):
    """``scalar.token_head_scale`` of the rows of x: [rows] float32."""
    return max_keep_nan(row_abs_max(x) * _recip(scalar.fmt_max(fmt)), np.float32(scalar.TOKEN_HEAD_MIN_SCALE))


def _uniform4(even, odd, interpret: bool):
    """``turboquant.quantize_values`` at 4 bits of rows given as their even and odd columns:
    packed bytes [rows, D/2] (int32; low nibble = even column), float32 scale and min [rows]."""
    nan = row_has_nan(even) | row_has_nan(odd)
    lo = jnp.where(nan, jnp.float32(jnp.nan), jnp.minimum(jnp.min(even, axis=1), jnp.min(odd, axis=1)))
    hi = jnp.where(nan, jnp.float32(jnp.nan), jnp.maximum(jnp.max(even, axis=1), jnp.max(odd, axis=1)))
    levels = 15.0
    span = hi - lo
    s = max_keep_nan(span * _recip(levels), np.float32(1e-8))

    def codes(v):
        q = jnp.floor(ieee_divide(v - lo[:, None], s[:, None], interpret) + 0.5)
        return jnp.where(jnp.isnan(q), 0.0, clip_keep_nan(q, 0.0, levels)).astype(jnp.int32)

    return codes(even) | (codes(odd) << 4), s, lo


def _store(ref, dst, ok, val):
    """ref[dst[i], :] = val[i] for the rows i where ok (ref 2-D) or ref[dst[i]] = val[i] (1-D)."""
    from jax.experimental.pallas import triton as plt

    if val.ndim == 1:
        plt.store(ref.at[dst], val.astype(ref.dtype), mask=ok)
        return
    # Whole index arrays on both axes: interpret mode scatters only those under a mask.
    rows = jnp.broadcast_to(dst[:, None], val.shape)
    cols = lax.broadcasted_iota(jnp.int32, val.shape, 1)
    plt.store(ref.at[rows, cols], val.astype(ref.dtype), mask=jnp.broadcast_to(ok[:, None], val.shape))


def _kernel(*refs, spec: KVCacheSpec, tokens: int, kv_heads: int, head_dim: int, num_slots: int,
            block: int, num_outputs: int, interpret: bool):
    from jax.experimental import pallas as pl

    slots_ref, k_ref, v_ref, *rest = refs
    if spec.kind == "per_tensor":
        scale_refs, rest = rest[:2], rest[2:]
    outs = rest[num_outputs:]             # rest[:num_outputs] are the same buffers, as inputs
    head, blk = pl.program_id(0), pl.program_id(1)
    tok = blk * block + lax.iota(jnp.int32, block)
    src_tok = jnp.minimum(tok, tokens - 1)    # lanes past T re-read the last token, never store
    slot = slots_ref[src_tok]
    ok = (tok < tokens) & (slot >= 0) & (slot < num_slots)
    # Masked lanes point one row past the pool: no store reaches it (interpret mode drops it).
    dst = jnp.where(ok, slot * kv_heads + head, num_slots * kv_heads)
    src = src_tok * kv_heads + head
    k_out, v_out, *side_outs = outs

    if spec.kind == "turboquant":        # k8v4: fp8 keys at scale 1, 4-bit uniform values
        k = k_ref[src, :].astype(jnp.float32)
        _store(k_out, dst, ok, _encode(k, None, spec.key_format, interpret))
        # Whole rows loaded, then split in registers into even and odd columns (the nibble pairs).
        even, odd = jnp.unstack(v_ref[src, :].astype(jnp.float32).reshape(block, head_dim // 2, 2), axis=2)
        packed, s, lo = _uniform4(even, odd, interpret)
        vs_out, vm_out = side_outs
        _store(v_out, dst, ok, packed)
        _store(vs_out, dst, ok, s)
        _store(vm_out, dst, ok, lo)
        return
    for i, (x_ref, out, fmt) in enumerate(((k_ref, k_out, spec.key_format),
                                           (v_ref, v_out, spec.value_format))):
        if spec.kind == "dense":
            _store(out, dst, ok, x_ref[src, :])
            continue
        x = x_ref[src, :].astype(jnp.float32)
        if spec.kind == "per_tensor":
            _store(out, dst, ok, _encode(x, scale_refs[i][0], fmt, interpret))
        else:
            s = _token_head_scale(x, fmt)
            _store(out, dst, ok, _encode(x, s[:, None], fmt, interpret))
            _store(side_outs[i], dst, ok, s)


@lowered_once("config", "interpret")
def insert(cache: PagedKVCache, k_new, v_new, slots, *, config: InsertConfig, interpret: bool) -> PagedKVCache:
    """``insert_reference``'s contract for a covered format (``covers``) and T ≥ 1; slots int32 [T]."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plt

    spec, d = cache.spec, cache.head_dim
    tokens, kv_heads = k_new.shape[:2]
    num_slots = cache.num_pages * cache.page_size
    block = min(config.block_tokens, pl.next_power_of_2(tokens))
    flat = lambda a: a.reshape(num_slots * kv_heads, -1)
    aliased = [flat(cache.k_pages), flat(cache.v_pages)]
    if spec.kind == "per_token_head":
        aliased += [cache.k_scale.reshape(-1), cache.v_scale.reshape(-1)]
    elif spec.kind == "turboquant":
        aliased += [cache.v_scale.reshape(-1), cache.v_min.reshape(-1)]
    inputs = [slots, k_new.reshape(tokens * kv_heads, d), v_new.reshape(tokens * kv_heads, d)]
    if spec.kind == "per_tensor":      # [1] views of the float32 scalars: no op runs before the kernel
        inputs += [cache.k_scale.reshape(1), cache.v_scale.reshape(1)]
    args = inputs + aliased
    whole = lambda a: pl.BlockSpec(a.shape, lambda h, b, n=a.ndim: (0,) * n)
    kernel = functools.partial(_kernel, spec=spec, tokens=tokens, kv_heads=kv_heads, head_dim=d,
                               num_slots=num_slots, block=block, num_outputs=len(aliased),
                               interpret=interpret)
    outs = pl.pallas_call(
        kernel, grid=(kv_heads, pl.cdiv(tokens, block)), in_specs=[whole(a) for a in args],
        out_specs=[whole(a) for a in aliased],
        out_shape=[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in aliased],
        input_output_aliases={len(inputs) + i: i for i in range(len(aliased))},
        interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=config.num_warps, num_stages=1),
        name=f"jquant_kv_insert_{spec.name}",
    )(*args)
    k_pages, v_pages = outs[0].reshape(cache.k_pages.shape), outs[1].reshape(cache.v_pages.shape)
    ks, vs, vm = cache.k_scale, cache.v_scale, cache.v_min
    if spec.kind == "per_token_head":
        ks, vs = outs[2].reshape(ks.shape), outs[3].reshape(vs.shape)
    elif spec.kind == "turboquant":
        vs, vm = outs[2].reshape(vs.shape), outs[3].reshape(vm.shape)
    return PagedKVCache(k_pages, v_pages, ks, vs, vm, spec, d)
