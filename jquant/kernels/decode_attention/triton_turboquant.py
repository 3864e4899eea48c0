"""Paged decode attention over TurboQuant pages as a Triton-backend Pallas kernel.

Grid, split-K and the log-sum-exp ``combine`` are ``triton.py``'s: one program per (sequence, KV head,
split), the GQA group padded to 16 rows, rows gathered from the flattened pool
``[slots * kv_heads, packed bytes]``. The packed codes are unpacked in registers; no dequantized key or
value reaches HBM. The loop is ALU-bound, so each step is counted in instructions:

* Keys are scored in the rotated domain like ``attention_reference``: q is rotated once, outside.
  Indices become unit centroids through the odd polynomial that passes through the Lloyd-Max table,
  evaluated in fp16 (Triton packs fp16 pairs into one instruction; Triton has no register table
  lookup, and a 16-way select costs more). Integers become floats by OR-ing them into the bits of a
  power of two, not by a quarter-rate conversion. Norm correction divides each logit by the token's
  centroid norm, whose square comes from a dot of the squared centroids with ones (it lands in the
  logits' layout; a row sum would keep a second copy of the centroids in another layout); the fp16
  key norm multiplies it. q is fp16 too, each row scaled by a power of two into range. k8v4 keys are
  fp8 codes times the cache's scalar k_scale, not rotated.
* Values v = code * scale + min: codes become bf16 128 + code by OR-ing them into the bits of 128.0, so
  p @ v = (p * scale) @ (128 + code) + sum(p * min) - 128 * sum(p * scale); the last sum uses the same
  bf16 p * scale the dot saw, so the offset cancels exactly.
* A 4-bit row stays two dot operands, its low nibbles (dims 2i) and high nibbles (2i + 1); q's columns
  are permuted to match and the output's permuted back. A 3-bit row is eight fields per 24-bit group
  (dims 8i + j), read by three stride-3 byte loads. Keys join the fields back into dim order; values
  broadcast each group to its 8 dims and shift each dim by its own amount instead (``_codes3``):
  Triton's MMA layout pass halves the assumed bit width of a dot operand with a join behind it
  (AccelerateMatmul, kWidth 8 for these 8-bit loads), which needs K ≥ 32, and the value dot's K is
  the step's tokens (16 in the tests, where 3-bit values came out wrong on the H200 while the
  same code passed interpreted; built without the join they pass on the H100). The keys' joins run
  along the key dot's K (head_dim ≥ 64).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jquant.kernels.decode_attention.config import TuningConfig, split_plan
from jquant.kernels.decode_attention.triton import _MASK, combine, pool_rows
from jquant.kernels.lowered_once import lowered_once
from jquant.kv import lloyd_max, turboquant
from jquant.kv.dtypes import KVCacheSpec
from jquant.kv.paged import PagedKVCache

_BF16_128 = 0x4300         # bfloat16 bits of 128.0: OR-ing an integer n < 128 in gives 128 + n exactly
_FIELDS = {4: 2, 3: 8}     # fields per word: a byte of nibbles, a 24-bit group of 3-bit codes


@functools.lru_cache(maxsize=None)
def centroid_poly(bits: int) -> tuple[float, ...]:
    """a_k with unit_centroid[idx] = u * sum_k a_k u^(2k), u = (2 idx - (2^bits - 1)) / 2^bits: the odd
    polynomial through the (symmetric) Lloyd-Max table of N(0, 1); in u its terms stay in fp16 range."""
    table = np.asarray(lloyd_max.unit_centroids(bits))
    u = np.arange(1, 2**bits, 2) / 2**bits
    a = np.linalg.solve(u[:, None] ** (2 * np.arange(len(u)) + 1), table[len(u):])
    return tuple(float(x) for x in a)


def centroids(twice_idx, bits: int, poly: tuple[float, ...]):
    """fp16 unit centroids of uint32 codes given as 2 * idx: OR-ing 2 idx into the fp16 bits of
    2^(10 - bits), whose ulp is 2^-bits, gives u exactly after one subtraction. fp16 Horner stays
    within 1e-3 of the table (tested; 7e-4 at 4 bits), about fp16 q's own rounding."""
    magic = jnp.uint32((25 - bits) << 10)   # fp16 bits of 2^(10 - bits)
    u = lax.bitcast_convert_type((twice_idx | magic).astype(jnp.uint16), jnp.float16)
    u = u - (2.0 ** (10 - bits) + (2**bits - 1) / 2**bits)
    w = u * u
    h = poly[-1] * w + poly[-2]
    for a in poly[-3::-1]:
        h = h * w + a
    return u * h


def column_dims(bits: int, head_dim: int) -> np.ndarray:
    """``[parts, head_dim / parts]``: the head dim each column of each dot operand holds (``_parts``):
    low and high nibbles for 4-bit codes, dim order otherwise."""
    if bits == 4:
        return np.arange(head_dim).reshape(head_dim // 2, 2).T
    return np.arange(head_dim)[None]


def _key_bits(spec: KVCacheSpec) -> int:
    return spec.key_bits if spec.key_format == "lloyd_max" else 8


def supports(spec: KVCacheSpec, head_dim: int) -> bool:
    """Whether every dot operand is at least 16 wide (Triton's dot) for these codes at head_dim."""
    return all(column_dims(bits, head_dim).shape[1] >= 16 for bits in (_key_bits(spec), spec.value_bits))


def _words(ref, row, bits: int, head_dim: int):
    """The rows' codes as uint32 words: bytes (4-bit), or 24-bit groups assembled from the three
    bytes of each group by three stride-3 loads (3-bit; [T, 48] is no power-of-two block)."""
    from jax.experimental import pallas as pl

    if bits == 4:
        return ref[row, :].astype(jnp.uint32)
    b0, b1, b2 = (ref[row, pl.ds(k, head_dim // 8, stride=3)].astype(jnp.uint32) for k in range(3))
    return b0 | (b1 << 8) | (b2 << 16)


def _fields(words, bits: int, shift: int):
    """Field j of every word, times 2^shift (one shift and one mask each), in field order."""
    mask = jnp.uint32(((1 << bits) - 1) << shift)
    out = []
    for j in range(_FIELDS[bits]):
        at = bits * j - shift
        out.append((words >> at if at > 0 else words << -at) & mask)
    return out


def _parts(fields):
    """Dot operands in ``column_dims`` order: the two nibble fields as they are; the eight 3-bit fields
    interleaved back into one ``[T, D]`` tile in dim order (three levels of pairwise joins: Triton's
    join takes two), which compiles to fewer instructions than eight narrow dots."""
    if len(fields) == 2:
        return fields
    while len(fields) > 1:
        h = len(fields) // 2
        t, w = fields[0].shape
        fields = [jnp.stack([fields[j], fields[j + h]], axis=-1).reshape(t, 2 * w) for j in range(h)]
    return fields


def _codes3(ref, row, head_dim: int):
    """``[T, head_dim]`` 3-bit codes in dim order without a join (see the module docstring): each
    24-bit group broadcast to its 8 dims, dim d shifted right by 3 (d mod 8)."""
    words = _words(ref, row, 3, head_dim)                                    # [T, D / 8]
    t = words.shape[0]
    words = jnp.broadcast_to(words[:, :, None], (t, head_dim // 8, 8)).reshape(t, head_dim)
    shift = 3 * (lax.iota(jnp.uint32, head_dim) % 8)
    return (words >> shift[None, :]) & jnp.uint32(7)


def _dots(q, parts):
    """sum_p q[p] @ parts[p]^T: ``[G16, T]`` float32."""
    from jax.experimental.pallas import triton as plt

    out = plt.dot(q[0], parts[0], trans_b=True)
    for qp, kp in zip(q[1:], parts[1:]):
        out += plt.dot(qp, kp, trans_b=True)
    return out


def _key_logits(q, k_ref, ks_ref, row, *, head_dim, bits, poly, norm_correction):
    """Logits ``[G16, T]`` of one block of tokens, but for the row scales of q."""
    if bits == 8:   # fp8 codes (exact in fp16); the scalar k_scale is folded into q's row scale
        return _dots(q, [k_ref[row, :].astype(jnp.float16)])
    cs = _parts([centroids(f, bits, poly) for f in _fields(_words(k_ref, row, bits, head_dim), bits, 1)])
    logits = _dots(q, cs) * ks_ref[row].astype(jnp.float32)[None, :]
    if not norm_correction:
        return logits
    ones = jnp.ones((q[0].shape[0], cs[0].shape[1]), jnp.float16)
    return logits * lax.rsqrt(_dots([ones] * len(cs), [c * c for c in cs]))


def _kernel(lengths_ref, bt_ref, q_ref, qs_ref, k_ref, *refs, page_size, kv_heads, max_pages, num_pages,
            block_tokens, split_tokens, head_dim, key_bits, value_bits, poly,
            norm_correction):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plt

    if key_bits == 8:
        ks_ref = None
        v_ref, vs_ref, vm_ref, o_ref, m_ref, l_ref = refs
    else:
        ks_ref, v_ref, vs_ref, vm_ref, o_ref, m_ref, l_ref = refs
    b, h, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    length = jnp.minimum(lengths_ref[b], max_pages * page_size)   # as the reference: no token past the table
    start = s * split_tokens
    end = jnp.minimum(length, start + split_tokens)
    n_steps = lax.div(jnp.maximum(end - start, 0) + (block_tokens - 1), block_tokens)

    q = [q_ref[:, p, :] for p in range(q_ref.shape[1])]          # fp16 [G16, D / parts]
    q_scale = qs_ref[...]              # its row scales times sm_scale / ln 2: logits in base 2
    g16 = q[0].shape[0]
    v_parts, v_width = o_ref.shape[1:]
    iota = lax.iota(jnp.int32, block_tokens)

    def step(i, carry):
        accs, off, m, l = carry
        tok = start + i * block_tokens + iota
        valid = tok < length
        row = pool_rows(bt_ref, b, h, tok, page_size=page_size, kv_heads=kv_heads, max_pages=max_pages,
                        num_pages=num_pages)
        logits = _key_logits(q, k_ref, ks_ref, row, head_dim=head_dim, bits=key_bits, poly=poly,
                             norm_correction=norm_correction)
        logits = jnp.where(valid[None, :], logits * q_scale[:, None], _MASK)
        m_new = jnp.maximum(m, jnp.max(logits, axis=1))
        alpha = jnp.exp2(m - m_new)
        p = jnp.exp2(logits - m_new[:, None])
        l_new = alpha * l + jnp.sum(p, axis=1)
        # Scales and mins past the length may be anything (NaN in a page no sequence owns): mask the
        # products, as 0 * NaN would leak. The value codes themselves are always finite.
        ps = jnp.where(valid[None, :], p * vs_ref[row].astype(jnp.float32)[None, :], 0.0)
        ps = ps.astype(jnp.bfloat16)
        pm = jnp.where(valid[None, :], p * vm_ref[row].astype(jnp.float32)[None, :], 0.0)
        off = alpha * off + jnp.sum(pm - 128.0 * ps.astype(jnp.float32), axis=1)
        codes = ([_codes3(v_ref, row, head_dim)] if value_bits == 3
                 else _fields(_words(v_ref, row, value_bits, head_dim), value_bits, 0))
        vals = [lax.bitcast_convert_type((c | jnp.uint32(_BF16_128)).astype(jnp.uint16), jnp.bfloat16)
                for c in codes]
        accs = tuple(alpha[:, None] * a + plt.dot(ps, v) for a, v in zip(accs, vals))
        return accs, off, m_new, l_new

    init = (tuple(jnp.zeros((g16, v_width), jnp.float32) for _ in range(v_parts)),
            jnp.zeros((g16,), jnp.float32), jnp.full((g16,), _MASK, jnp.float32),
            jnp.zeros((g16,), jnp.float32))
    accs, off, m, l = lax.fori_loop(0, n_steps, step, init)
    for p, a in enumerate(accs):
        o_ref[:, p, :] = a + off[:, None]
    m_ref[...] = m
    l_ref[...] = l


@lowered_once("scale", "config", "interpret")
def turboquant_decode_attention(q, layer: PagedKVCache, block_tables, lengths, *, scale: float | None = None,
                                config: TuningConfig | None = None, interpret: bool = False):
    """``attention_reference`` of a TurboQuant layer by the kernel: float32 ``[B, Hq, D]``, zeros for
    a sequence of length 0. Page indices are clamped into the pool (a bad table reads a wrong page,
    never outside memory)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plt

    spec, d, hkv = layer.spec, layer.head_dim, layer.kv_heads
    batch, hq, dq = q.shape
    if spec.kind != "turboquant" or dq != d or hq % hkv or not supports(spec, d):
        raise ValueError(f"needs a TurboQuant layer, q [B, Hq, {d}] with Hq a multiple of {hkv} and "
                         f"dot operands ≥ 16 wide; got {spec.name}, q {q.shape}")
    config = config or TuningConfig()
    if config.kv_heads_per_program != 1:
        raise ValueError("the TurboQuant kernel attends one KV head per program "
                         f"(kv_heads_per_program=1), got {config.kv_heads_per_program}")
    key_bits = _key_bits(spec)
    num_pages, page_size = layer.num_pages, layer.page_size
    max_pages = block_tables.shape[1]
    group = hq // hkv
    g16 = -(-group // 16) * 16
    splits, split_tokens = split_plan(batch, hkv, max_pages * page_size, config)

    kdims, vdims = column_dims(key_bits, d), column_dims(spec.value_bits, d)
    qf = q.astype(jnp.float32).reshape(batch, hkv, group, d)
    if key_bits != 8:
        qf = jnp.matmul(qf, turboquant.rotation(d)[:, kdims.ravel()], precision=lax.Precision.HIGHEST)
    # fp16 q (its 11 bits beat bf16's 8) needs range: each row is scaled by a power of two to a
    # largest magnitude in [0.5, 1), undone on the logits with sm_scale (and k8v4's k_scale). Logits
    # are in base 2 (exp2 is one instruction, exp a libdevice call); m returns to base e for combine.
    _, e = jnp.frexp(jnp.max(jnp.abs(qf), axis=-1))
    sm_scale = (d**-0.5 if scale is None else scale) / math.log(2)
    q_scale = jnp.ldexp(jnp.full(e.shape, sm_scale, jnp.float32), e)
    if key_bits == 8:
        q_scale = q_scale * layer.k_scale
    elif not spec.norm_correction:
        q_scale = q_scale * d**-0.5    # the N(0, 1/d) scale of the centroids (unit ones in the kernel)
    pad = ((0, 0), (0, 0), (0, g16 - group))
    qk = jnp.pad(jnp.ldexp(qf, -e[..., None]).reshape(batch, hkv, group, *kdims.shape),
                 pad + ((0, 0), (0, 0))).astype(jnp.float16)
    q_scale = jnp.pad(q_scale, pad)

    flat = lambda a: a.reshape(-1, a.shape[-1]) if a.ndim == 4 else a.reshape(-1)
    args = [lengths.astype(jnp.int32), block_tables.astype(jnp.int32).reshape(-1), qk, q_scale,
            flat(layer.k_pages)]
    if key_bits != 8:
        args.append(flat(layer.k_scale))
    args += [flat(layer.v_pages), flat(layer.v_scale), flat(layer.v_min)]
    whole = lambda a: pl.BlockSpec(a.shape, lambda b, h, s, n=a.ndim: (0,) * n)
    in_specs = [whole(a) for a in args]
    in_specs[2] = pl.BlockSpec((None, None, g16, *kdims.shape), lambda b, h, s: (b, h, 0, 0, 0))
    in_specs[3] = pl.BlockSpec((None, None, g16), lambda b, h, s: (b, h, 0))
    kernel = functools.partial(
        _kernel, page_size=page_size, kv_heads=hkv, max_pages=max_pages, num_pages=num_pages,
        block_tokens=config.block_tokens, split_tokens=split_tokens,
        head_dim=d, key_bits=key_bits,
        value_bits=spec.value_bits, poly=centroid_poly(key_bits) if key_bits != 8 else (),
        norm_correction=spec.norm_correction)
    lead = (splits, batch, hkv, g16)
    o, m, l = pl.pallas_call(
        kernel, grid=(batch, hkv, splits), in_specs=in_specs,
        out_specs=[pl.BlockSpec((None, None, None, g16, *vdims.shape), lambda b, h, s: (s, b, h, 0, 0, 0)),
                   pl.BlockSpec((None, None, None, g16), lambda b, h, s: (s, b, h, 0)),
                   pl.BlockSpec((None, None, None, g16), lambda b, h, s: (s, b, h, 0))],
        out_shape=[jax.ShapeDtypeStruct((*lead, *vdims.shape), jnp.float32),
                   jax.ShapeDtypeStruct(lead, jnp.float32), jax.ShapeDtypeStruct(lead, jnp.float32)],
        interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        name=f"jquant_decode_attention_{spec.name}",
    )(*args)
    out = combine(o[:, :, :, :group].reshape(splits, batch, hkv, group, d), m[..., :group] * math.log(2),
                  l[..., :group])
    return out[..., np.argsort(vdims.ravel())].reshape(batch, hq, d)
