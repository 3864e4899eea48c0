"""W4A16 on Hopper with Mosaic GPU: TMA-pipelined weight tiles, int4 decoded into wgmma registers.

``y = x @ W`` is computed transposed, ``yᵀ = W_nk · xᵀ`` ("swap AB", as Marlin/Machete do for small
M): the weight, stored ``[N, K]`` as signed int4 (``code − 8``, K permuted into word order), is
wgmma's A operand, decoded from shared memory straight into registers (a 32-bit word of 8 codes
per thread and row, two codes per ``shr``/``lop3``/``sub.bf16x2``, ``w4a16_mgpu_decode``),
scaled per group, never written back; ``xᵀ`` is the B operand
in shared memory, so M only sets wgmma's N (8 … 256) and even M = 1 uses the tensor cores.
The TMA engine keeps ``max_concurrent_steps`` weight tiles in flight per CTA without spending
registers, which the Triton kernels could not do for loads that do not feed a dot.

FP4 (E2M1, MXFP4 / NVFP4) and NF4 use the same tiles, decoded by inline PTX
(``w4a16_mgpu_decode``; Mosaic GPU's own FP4 conversion is Blackwell-only): each pair of E2M1
codes is stored in a byte layout that a multiply and a mask decode (the scales carry the
last ``× 2^126``); table codes (NF4, bitsandbytes FP4) are looked up with ``prmt``. Groups of
16 / 32 pick their scale per column inside each 64-wide chunk.

Grid: (N / block_n, split_k, M / block_m). Each CTA streams its K range. With
``MgpuConfig.final_output`` (every default launch) the split-K CTAs of a tile form a
cluster and the kernel writes the final ``[M, N]`` itself (``w4a16_mgpu_epilogue``); otherwise
each CTA writes an fp32 ``[block_n, block_m]`` partial and XLA sums and transposes them.

Interpret mode (CPU): its wgmma reads A only from shared memory, so there the decoded tile is
stored to a scratch buffer first; everything else (TMA pipeline, decode, scaling) is the same code.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jquant.pallas_kernels.w4a16_mgpu_common import (K_CHUNK, SUB_CHUNK_GROUPS, MgpuConfig,
                                                     check_launch, decode_mma_step,
                                                     group_acc_fits,
                                                     launch_kernel, load_weight_spans,
                                                     step_specs, weight_row_codes)
from jquant.pallas_kernels.w4a16_mgpu_decode import (E2M1_SCALE_EXP, from_word_order,
                                                     pack_e2m1_pairs, signed_int4,
                                                     to_word_order, unpack_e2m1_pairs)
from jquant.pallas_kernels.w4a16_mgpu_epilogue import start_bias_copy, store_final_output
from jquant.pallas_kernels.w4a16_mgpu_ws import w4a16_mgpu_ws
from jquant.pallas_kernels.w4a16_layout import (_round_up, _sort_act_order, canonical_lut,
                                                gather_pad, lut_values)

@dataclasses.dataclass(frozen=True)
class PackedW4NK:
    """A 4-bit weight laid out for the Mosaic GPU kernel.

    ``data`` int4 ``[N_pad, K_pad]``: ``code − 8`` for int4 codes (exact in int4 for uint4b8 and
    for asymmetric codes, whose zero points are shifted the same way), or E2M1 codes in pairs
    (``lut="e2m1"``, ``pack_e2m1_pairs``), or table codes as they are (``"nf4"``, ``"fp4_bnb"``);
    ``word_order``: its K axis permuted within blocks of 32 codes (``to_word_order``).
    ``scale`` ``[K_pad / G, N_pad]`` (bf16, fp16 or fp32: converted to x's dtype in the kernel;
    E2M1's times 2^(126 − k), ``_e2m1_prescale``); ``zero`` optional ``[K_pad / G, N_pad]``:
    ``zero − 8`` (int4 asymmetric), subtracted before scaling. ``perm``: act-order gather of x's
    columns; ``global_scale``: optional fp32 ``[1]`` multiplier (NVFP4's; for E2M1 always, times
    2^k). ``group_size`` in stored rows.
    """

    data: jax.Array
    scale: jax.Array
    zero: jax.Array | None = None
    perm: jax.Array | None = None
    global_scale: jax.Array | None = None
    lut: str = "int4"
    k: int = 0
    n: int = 0
    group_size: int = 0
    word_order: bool = False

    @property
    def n_pad(self) -> int:
        return self.data.shape[0]

    @property
    def k_pad(self) -> int:
        return self.data.shape[1]

    @property
    def nbytes(self) -> int:
        return self.data.size // 2 + sum(math.prod(leaf.shape) * jnp.dtype(leaf.dtype).itemsize
                                         for leaf in (self.scale, self.zero, self.perm,
                                                      self.global_scale)
                                         if leaf is not None)


jax.tree_util.register_dataclass(
    PackedW4NK, data_fields=["data", "scale", "zero", "perm", "global_scale"],
    meta_fields=["lut", "k", "n", "group_size", "word_order"])


def w4a16_mgpu(xs: jax.Array, packed: PackedW4NK, *, config: MgpuConfig, bias=None,
               interpret: bool = False) -> jax.Array:
    """fp32 ``[split_k, N_pad, M_pad]`` partials of ``(xs @ W)ᵀ`` for ``xs`` ``[M, K_pad]``
    (columns in stored order, see ``gather_pad``), ``M_pad`` = M rounded up to ``block_m``; or,
    with ``config.final_output``, ``xs @ W · global_scale + bias`` itself, ``[M, N]`` (N_pad
    columns where N's rows would break the TMA's 16-byte stride, ``final_output_cols``) in x's
    dtype.
    The rows of the last x tile past M are never read: the TMA copy fills them with zeros
    (so at M = 1 the L2 serves one row of x per step, not ``block_m``). The copy's 8-row tiling
    needs M < 8 or a multiple of 8 (``x_rows``). Likewise ``xs`` may stop at K columns (not
    K_pad) where K is a multiple of 64 (the x tile's swizzle tiling): the copy fills the
    padded columns with zeros (``kernel_x``)."""
    cfg = config
    if xs.dtype not in (jnp.bfloat16, jnp.float16):
        raise TypeError(f"xs must be bf16 or fp16 (wgmma's 16-bit operand), got {xs.dtype} "
                        f"(shape {tuple(xs.shape)})")
    if (xs.ndim != 2 or xs.shape[1] not in (packed.k_pad, packed.k) or xs.shape[0] < 1
            or x_rows(xs.shape[0]) != xs.shape[0] or xs.shape[1] % K_CHUNK):
        raise ValueError(f"xs has shape {tuple(xs.shape)}; expected [M, K_pad={packed.k_pad}] "
                         f"or [M, K={packed.k}] (a multiple of {K_CHUNK}) with "
                         "1 ≤ M < 8 or M a multiple of 8")
    if bias is not None and not cfg.final_output:
        raise ValueError("bias goes to the kernel only with MgpuConfig.final_output")
    if bias is not None:
        if bias.shape not in ((packed.n,), (packed.n_pad,)):
            raise ValueError(f"bias has shape {tuple(bias.shape)}; expected ({packed.n},) or "
                             f"({packed.n_pad},) (N or N_pad)")
        if not jnp.issubdtype(bias.dtype, jnp.floating):
            raise TypeError(f"bias must be a float array, got {bias.dtype}")
    m_pad = _round_up(xs.shape[0], cfg.block_m)
    k_split = check_launch(packed.n_pad, packed.k_pad, m_pad, packed.group_size, cfg)
    if cfg.compute_wgs > 1:
        return w4a16_mgpu_ws(xs, packed, config=cfg, bias=bias, interpret=interpret)
    bn, bm = cfg.block_n, cfg.block_m
    g = packed.group_size
    steps = k_split // cfg.block_k
    has_zero = packed.zero is not None

    def body(ni, si, mi, x_gmem, w_gmem, s_gmem, z_gmem, out, *a_scratch):
        def mma(w_smem, x_smem, s_smem, z_smem, acc_ref, **kw):
            decode_mma_step(w_smem, x_smem, s_smem, z_smem[0] if z_smem else None, acc_ref,
                            rows=slice(None), group_size=g, dtype=xs.dtype,
                            lut=packed.lut, word_order=packed.word_order,
                            interpret=interpret, row_codes=weight_row_codes(cfg),
                            a_scratch=a_scratch[0] if interpret else None, **kw)

        def step(idx, w_smem, x_smem, s_smem, *z_smem, acc_ref):
            del idx
            mma(w_smem, x_smem, s_smem, z_smem, acc_ref)
            return acc_ref

        # E2M1 scales carry 2^E2M1_SCALE_EXP (prepack_nk); this decode unscales its codes.
        scale_factor = 2.0 ** -E2M1_SCALE_EXP if packed.lut == "e2m1" else 1.0

        def group_acc_step(idx, w_smem, x_smem, s_smem, *rest):
            """Per group: unscaled wgmmas into a fresh accumulator, then ``sum += s · acc``."""
            del idx
            *z_smem, total = rest
            per_group = g // K_CHUNK
            # Loaded here, outside the groups' scopes: a 256-code span holds two groups.
            spans = load_weight_spans(w_smem, slice(None), weight_row_codes(cfg),
                                      packed.word_order)
            for j in range(cfg.block_k // g):
                def group_dot(acc_ref, j=j):
                    mma(w_smem, x_smem, s_smem, z_smem, acc_ref, scaled=False,
                        chunks=range(j * per_group, (j + 1) * per_group), spans=spans)
                    return acc_ref[...]

                part = pl.run_scoped(group_dot, plgpu.ACC((bn, bm), jnp.float32))
                s = plgpu.load(s_smem.at[j], layout=plgpu.Layout.WGMMA.reduce(1))
                s = s.astype(jnp.float32) * scale_factor
                total = total + part * jax.lax.broadcast_in_dim(s, (bn, bm), (0,))
            return total

        in_specs = step_specs(cfg, group_size=g, coords=lambda t: (ni, mi, si * steps + t),
                              has_zero=has_zero, delay_all=False)
        pipeline_kw = dict(grid=(steps,), in_specs=in_specs,
                           max_concurrent_steps=max(2, min(cfg.max_concurrent_steps, steps)))
        operands = (w_gmem, x_gmem, s_gmem, *([z_gmem] if has_zero else []))

        def run(acc_ref):
            plgpu.emit_pipeline(functools.partial(_step_with_acc, step, acc_ref),
                                **pipeline_kw)(*operands)
            plgpu.wgmma_wait(0)
            return acc_ref[...]

        if cfg.final_output:
            start_bias_copy(out, ni, si, bn)
        if cfg.group_acc:
            zeros = plgpu.layout_cast(jnp.zeros((bn, bm), jnp.float32), plgpu.Layout.WGMMA)
            acc = plgpu.emit_pipeline(group_acc_step, init_carry=zeros, **pipeline_kw)(*operands)
        else:
            acc = pl.run_scoped(run, plgpu.ACC((bn, bm), jnp.float32))
        if cfg.final_output:
            store_final_output(acc, out, ni=ni, si=si, mi=mi, split_k=cfg.split_k,
                               interpret=interpret)
            return
        o_smem = a_scratch[-1]
        o_smem[...] = acc
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, out.at[si, pl.ds(ni * bn, bn), pl.ds(mi * bm, bm)])
        # Shared memory must outlive the store's reads; its writes land before the kernel ends.
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    scratch = [plgpu.SMEM((bn, K_CHUNK), xs.dtype)] if interpret else []
    if not cfg.final_output:   # the partial's staging buffer (final_output brings its own)
        scratch.append(plgpu.SMEM((bn, bm), jnp.float32))
    return launch_kernel(body, xs, packed, cfg, scratch=scratch, interpret=interpret, bias=bias)


def kernel_x(x2: jax.Array, packed: PackedW4NK) -> jax.Array:
    """``x2`` ``[M, K]`` as the kernel reads it: columns in stored (act-order) order, rows padded
    to ``x_rows``; K is padded to K_pad only where it is not a multiple of 64, which the x
    tile's swizzle tiling needs of the array (else the copy zero-fills the columns past K), so
    without act-order, at M < 8 or a multiple of 8, x goes to the kernel with no XLA op."""
    k_cols = packed.k if packed.k % K_CHUNK == 0 else packed.k_pad
    return gather_pad(x2, packed, x_rows(x2.shape[0]), k_cols)


def x_rows(m: int) -> int:
    """Rows x is padded to for the kernel: none below 8 (the copy zero-fills the tile), else a
    multiple of 8 (the TMA copy's row tiling)."""
    return m if m < 8 else _round_up(m, 8)


def _step_with_acc(step, acc_ref, idx, *refs):
    step(idx, *refs, acc_ref=acc_ref)


def prepack_nk(q, scale, zero=None, *, group_size, lut="int4", global_scale=None, g_idx=None,
               pad_k: int = K_CHUNK, pad_n: int = 128, word_order: bool = True) -> PackedW4NK:
    """Lays 4-bit codes ``q`` ``[K, N]`` (0..15) out for the Mosaic GPU kernel: ``[N_pad, K_pad]``
    signed int4, scales and zeros ``[K_pad / G, N_pad]``. ``lut``: ``"int4"`` (value ``code − 8``,
    or ``code − zero``), ``"e2m1"`` (FP4; optional ``global_scale``) or a table (``"nf4"``,
    ``"fp4_bnb"``; both without zeros). Padded columns have scale 0, so they are exactly 0;
    padded rows meet the zero columns ``gather_pad`` appends to x. ``word_order``: K permuted
    within blocks of 32 codes (``to_word_order``) so the kernel reads a word per thread and row."""
    lut = canonical_lut(lut)
    q = jnp.asarray(q)
    if q.ndim != 2 or 0 in q.shape or not jnp.issubdtype(q.dtype, jnp.integer):
        raise ValueError(f"q must be a non-empty [K, N] array of integer codes, got shape "
                         f"{tuple(q.shape)} and dtype {q.dtype}")
    k, n = q.shape
    g = k if group_size in (None, -1) or group_size >= k else int(group_size)
    if not nk_compatible(group_size, k, lut):
        raise ValueError(f"prepack_nk takes group_size 16, 32, a multiple of 64 or -1 (per "
                         f"channel); got lut={lut!r}, group_size={group_size}: use prepack (the "
                         "Triton kernels' layout) for it")
    if zero is not None and lut != "int4":
        raise ValueError(f"zero points apply to lut='int4' only, got lut={lut!r}")
    n_groups = -(-k // g)
    if jnp.shape(scale) != (n_groups, n):
        raise ValueError(f"scale has shape {tuple(jnp.shape(scale))}; expected ({n_groups}, {n}) "
                         f"for q of shape ({k}, {n}) and group_size {group_size}")
    perm = None
    if g_idx is not None:
        perm, q = _sort_act_order(g_idx, q, g, -(-k // g))
    k_pad = _round_up(k, math.lcm(pad_k, g) if g < k else pad_k)
    group = g if g < k else k_pad
    n_pad = _round_up(n, pad_n)
    codes = q.astype(jnp.int32).T
    pad = ((0, n_pad - n), (0, k_pad - k))   # padded codes decode to 0
    if lut == "int4":
        data = jnp.pad(codes - 8, pad).astype(jnp.int4)
    elif lut == "e2m1":
        data = pack_e2m1_pairs(jnp.pad(codes, pad))
    else:   # a table (NF4, bnb FP4): the codes as they are
        zero_code = int(np.flatnonzero(lut_values(lut) == 0)[0])
        data = signed_int4(jnp.pad(codes & 0xF, pad, constant_values=zero_code))
    if word_order:
        data = to_word_order(data, lut)

    def per_group(values, dtype):
        rows = k_pad // group
        return jnp.pad(jnp.asarray(values).astype(dtype),
                       ((0, rows - values.shape[0]), (0, n_pad - n)))

    scale = jnp.asarray(scale)
    # e4m3 / e8m0 scales are exact in bf16 (8 exponent bits); fp16 / bf16 stay; the rest fp32.
    s_dtype = (jnp.bfloat16 if scale.dtype in (jnp.float8_e4m3fn, jnp.float8_e8m0fnu)
               else scale.dtype if scale.dtype in (jnp.bfloat16, jnp.float16) else jnp.float32)
    if lut == "e2m1":
        scale, global_scale = _e2m1_prescale(scale, global_scale)
        s_dtype = jnp.float32 if s_dtype == jnp.float16 else s_dtype   # fp16 cannot hold them
    zz = None
    if zero is not None:
        zz = per_group(jnp.asarray(zero, jnp.float32) - 8, jnp.bfloat16)
    gs = None if global_scale is None else jnp.asarray(global_scale, jnp.float32).reshape(1)
    return PackedW4NK(data=data, scale=per_group(scale, s_dtype), zero=zz, perm=perm,
                      global_scale=gs, lut=lut, k=k, n=n, group_size=group,
                      word_order=word_order)


def _e2m1_prescale(scale, global_scale):
    """E2M1 scales times 2^(126 − k), the global scale times 2^k (both exact), with k ≥ 0 the
    least that keeps the largest scale ≤ 2^127, inside bf16: the kernel's FP4 decode then skips
    its own × 2^126 and multiplies the codes' placed bits by the scale (``_e2m1_ptx``)."""
    s = jnp.asarray(scale, jnp.float32)
    top = jnp.max(jnp.abs(s))
    k = jnp.maximum(jnp.ceil(jnp.log2(top)) - 1, 0).astype(jnp.int32)   # 0 for all-zero scales
    gs = jnp.ones((1,), jnp.float32) if global_scale is None else global_scale
    return (jnp.ldexp(s, E2M1_SCALE_EXP - k),
            jnp.ldexp(jnp.asarray(gs, jnp.float32).reshape(1), k))


def default_mgpu_config(m: int, packed: PackedW4NK) -> MgpuConfig:
    """The launch for ``m`` rows, from the H200 sweeps and A/Bs (bench/NOTES.md): decode
    (M ≤ 16) wants narrow 64-row tiles, 256-code steps 4 deep and split-K 2 (many small CTAs
    keep the TMA engines busy); larger M wants 128-row tiles of 128 K (so 3 stages of a 128-row
    x tile fit in shared memory) and split-K 2 only while there are fewer CTAs than ~2 per SM.
    Every default launch writes the final output itself."""
    block_m = min(_round_up(m, 8), 128)
    if block_m >= 64 and packed.n_pad % 256 == 0 and packed.n_pad // 256 >= 100:
        # Two warpgroups × 128 rows share each x tile: half the x traffic from L2, which bounds
        # M ≥ 64 on wide weights (interleaved H200 A/B, bench/NOTES.md "Warp-specialized").
        return MgpuConfig(block_n=256, block_k=K_CHUNK, block_m=block_m, split_k=1,
                          max_concurrent_steps=6 if block_m <= 64 else 4, compute_wgs=2,
                          final_output=True)
    if block_m <= 16:
        # Split-K 2 in a cluster, 4 stages, the kernel's own output: one op per call, even with
        # split-K 4 and XLA-summed partials on the large shapes and 2-4 µs faster on the small
        # ones, where a second op costs most (H200 A/B timed past the host's pace, session 11).
        bn, bk, stages, split = 64, 256, 4, 2
    elif block_m <= 64:   # 128-row tiles once they still give ~1 CTA per SM (A/B run, NOTES.md)
        bn, bk, stages, split = (128 if packed.n_pad // 128 >= 132 else 64), 128, 3, 2
    else:
        bn, bk, stages, split = 128, 128, 3, 2
    if packed.n_pad % bn:
        bn = 64
    g = packed.group_size
    while bk > K_CHUNK and (g % bk if g >= bk else bk % g):   # a step meets whole groups
        bk //= 2
    tiles = packed.n_pad // bn * -(-m // block_m)
    # Split-K 1 from ~1.5 tiles per SM, or ~1 of 128 × 128 (H200 A/B, session 9 in NOTES.md:
    # 28672×8192 M = 32, 224 tiles: 64 vs 82 µs; 8192×8192 M = 256, 128 tiles: 57 vs 69; but
    # 64 tiles, or 128 of 64 × 32, still want split-K 2).
    if split > 1 and block_m > 16 and (tiles >= 200 or block_m >= 128 and tiles >= 128):
        split = 1
    while split > 1 and (packed.k_pad % (split * bk) or packed.k_pad // (split * bk) < 2):
        split //= 2
    while packed.k_pad % bk:   # K_pad is a multiple of 64
        bk //= 2
    # Scales on a per-group fp32 accumulator while it is small (M ≤ 16): as fast as scaling
    # each decoded weight in bf16 (H200 A/B, ±4 %) and closer to the fp32 reference; at 32+
    # columns the second accumulator costs registers (8192×28672 M = 128: 301 vs 167 µs).
    # 128-byte weight rows: the TMA engine moves 32-byte rows at ~3 TB/s and 128-byte rows at
    # the byte floor (H200 copy probe; kernel 5-10 % faster, bench/NOTES.md "Session 5").
    # The kernel's own final output (split-K ≤ 2): one op per call, no fp32 partials (H200
    # A/B, session 9: never slower, 1536×576 −2 µs of 20, 8192×28672 M = 64 −8 of 90;
    # session 11 at M ≤ 16).
    return MgpuConfig(block_n=bn, block_k=bk, block_m=block_m, split_k=split,
                      max_concurrent_steps=stages,
                      group_acc=block_m <= 16 and group_acc_fits(g, bk, 1), wide_rows=True,
                      final_output=True)


def w4a16_mgpu_matmul(x2: jax.Array, packed: PackedW4NK, bias=None, *,
                      config: MgpuConfig | None = None, interpret: bool = False) -> jax.Array:
    """``x2 @ W`` (``[M, K]`` bf16/fp16 → ``[M, N]`` in x's dtype) with the Mosaic GPU kernel."""
    m = x2.shape[0]
    cfg = config or default_mgpu_config(m, packed)
    xs = kernel_x(x2, packed)
    if cfg.final_output:
        if bias is not None and not jnp.issubdtype(bias.dtype, jnp.floating):
            bias = bias.astype(jnp.float32)
        out = w4a16_mgpu(xs, packed, config=cfg, bias=bias, interpret=interpret)
        # A no-op unless x was padded (``x_rows``) or N's rows break the TMA stride rule.
        return out[:m, :packed.n]
    parts = w4a16_mgpu(xs, packed, config=cfg, interpret=interpret)
    out = jnp.sum(parts, axis=0)[:packed.n, :m].T
    if packed.global_scale is not None:
        out = out * packed.global_scale[0]
    if bias is not None:
        out = out + bias.astype(jnp.float32)
    return out.astype(x2.dtype)


def nk_compatible(group_size: int, k: int, lut: str = "int4") -> bool:
    """Whether a weight fits the kernel: any code book (``LUTS``), per-channel or groups of 16, 32
    or multiples of 64."""
    canonical_lut(lut)   # raises for an unknown code book; every known one fits
    return (group_size in (None, -1) or group_size >= k or group_size % K_CHUNK == 0
            or group_size in SUB_CHUNK_GROUPS)


def dequantize_nk(packed: PackedW4NK, dtype=jnp.float32) -> jax.Array:
    """The float weight ``[K_pad, N_pad]`` in stored row order, in fp32 math (padding is 0)."""
    data = from_word_order(packed.data, packed.lut) if packed.word_order else packed.data
    if packed.lut == "int4":
        values = data.astype(jnp.float32).T
    else:
        codes = (unpack_e2m1_pairs(data) if packed.lut == "e2m1"
                 else data.astype(jnp.int32) & 0xF)
        values = jnp.asarray(lut_values(packed.lut))[codes].T
    rows = lambda t: jnp.repeat(t.astype(jnp.float32), packed.group_size, axis=0)
    if packed.zero is not None:
        values = values - rows(packed.zero)
    scale = packed.scale
    if packed.lut == "e2m1":   # its scales carry 2^E2M1_SCALE_EXP
        scale = jnp.ldexp(scale.astype(jnp.float32), -E2M1_SCALE_EXP)
    w = values * rows(scale)
    if packed.global_scale is not None:
        w = w * packed.global_scale[0]
    return w.astype(dtype)


def reference_nk(x2: jax.Array, packed: PackedW4NK, bias=None, dtype=jnp.float32) -> jax.Array:
    """The kernel's pure-JAX twin: dequantize in fp32 (then ``dtype``), dot with fp32 accumulation."""
    xs = gather_pad(x2, packed, x2.shape[0]).astype(dtype)
    out = jnp.dot(xs, dequantize_nk(packed, dtype)[:, :packed.n],
                  preferred_element_type=jnp.float32)
    if bias is not None:
        out = out + bias.astype(jnp.float32)
    return out.astype(x2.dtype)
