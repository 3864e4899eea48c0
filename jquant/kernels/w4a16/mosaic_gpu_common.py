"""What both Mosaic GPU weight-only kernels share: the launch checks, and one pipeline step (decode the
4-bit (int4, E2M1, table) or 8-bit (int8, e4m3: ``jquant.kernels.w8a16``) weight tile into wgmma
registers chunk by chunk, scale, issue the wgmma)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jquant.kernels.w4a16.layout import K_CHUNK, SUB_CHUNK_GROUPS, round_up
from jquant.kernels.w4a16.config import MgpuConfig, group_acc_fits
from jquant.kernels.w4a16.mosaic_gpu_epilogue import (MAX_CLUSTER, FinalOutputRefs,
                                                       final_output_scratch)
from jquant.kernels.w4a16.mosaic_gpu_decode import (E2M1_SCALE_EXP, UNSCALE_EXP, code_bits,
                                                     decode_bytes, decode_codes, decode_words)


def check_launch(n_pad: int, k_pad: int, m_pad: int, group_size: int, cfg: MgpuConfig) -> int:
    """Raises a ValueError naming every parameter of ``cfg`` that cannot tile the problem;
    returns the K range of one split."""
    g = group_size
    k_split = k_pad // cfg.split_k
    wg_rows = cfg.block_n // cfg.compute_wgs
    problems = []
    if cfg.compute_wgs not in (1, 2):
        problems.append(f"compute_wgs={cfg.compute_wgs} must be 1 or 2")
    if n_pad % cfg.block_n or cfg.block_n % cfg.compute_wgs or wg_rows % 64:
        problems.append(f"block_n={cfg.block_n} must be a multiple of 64·compute_wgs="
                        f"{64 * cfg.compute_wgs} dividing N_pad={n_pad}")
    if cfg.block_m % 8 or not 8 <= cfg.block_m <= 256 or m_pad % cfg.block_m:
        problems.append(f"block_m={cfg.block_m} must be a multiple of 8 in [8, 256] dividing "
                        f"M_pad={m_pad}")
    if k_pad % cfg.split_k or k_split % cfg.block_k or cfg.block_k % K_CHUNK:
        problems.append(f"block_k={cfg.block_k} (a multiple of {K_CHUNK}) and split_k="
                        f"{cfg.split_k} must tile K_pad={k_pad}")
    if (g % K_CHUNK and g not in SUB_CHUNK_GROUPS) or (g < cfg.block_k and cfg.block_k % g) or (
            g > cfg.block_k and g % cfg.block_k):
        problems.append(f"group_size={g} must be 16, 32 or a multiple of {K_CHUNK} that divides or "
                        f"is a multiple of block_k={cfg.block_k}")
    if cfg.group_acc and not group_acc_fits(g, cfg.block_k, cfg.compute_wgs):
        problems.append(f"group_acc needs one compute warpgroup and a group_size that is a "
                        f"multiple of {K_CHUNK} dividing block_k={cfg.block_k}, got group_size="
                        f"{g}, compute_wgs={cfg.compute_wgs}")
    if cfg.final_output and cfg.split_k > (MAX_CLUSTER if cfg.compute_wgs == 1 else 1):
        problems.append(f"final_output needs split_k ≤ {MAX_CLUSTER} (one cluster per output "
                        f"tile) with one compute warpgroup, split_k = 1 with two; got "
                        f"compute_wgs={cfg.compute_wgs}, split_k={cfg.split_k}")
    if cfg.max_concurrent_steps < 2:
        problems.append(f"max_concurrent_steps={cfg.max_concurrent_steps} must be ≥ 2")
    if problems:
        raise ValueError("w4a16 mgpu kernel: " + "; ".join(problems))
    return k_split


# Bytes per swizzle row of the weight tile with wide_rows: the largest swizzle.
WIDE_ROW_BYTES = 128


def weight_row_codes(cfg: MgpuConfig, lut: str = "int4") -> int:
    """Codes per shared-memory swizzle row of the weight tile: one 64-code chunk, or (wide_rows)
    up to 128 bytes of codes (256 4-bit or 128 8-bit codes)."""
    wide = WIDE_ROW_BYTES * 8 // code_bits(lut)
    return min(cfg.block_k, wide) if cfg.wide_rows else K_CHUNK


def swizzle_tiles(block_k: int, bits: int):
    swizzle = plgpu.find_swizzle(block_k * bits, "w4a16")
    return (plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle))


def scale_rows_per_step(block_k: int, group_size: int) -> int:
    """Scale rows one pipeline step reads: several groups per step, or one group over several."""
    return max(block_k // group_size, 1)


def decode_mma_step(w_smem, x_smem, s_smem, z_smem, acc_ref, *, rows, group_size: int, dtype,
                    lut: str, interpret: bool, a_scratch=None, chunks=None,
                    scaled: bool = True, row_codes: int = K_CHUNK, spans: dict | None = None,
                    word_order: bool = False):
    """One pipeline step of one warpgroup: ``acc += decode(W[rows, :]) · x_tileᵀ``.

    ``w_smem`` ``[bn, bk]`` int4, ``x_smem`` ``[bm, bk]``, ``s_smem`` / ``z_smem`` (or None)
    ``[s_rows, bn]``; ``rows`` (a slice or ``pl.ds``) picks the warpgroup's weight rows;
    ``lut``: the code book of ``w_smem`` (``decode_codes``: E2M1 and tables are decoded with
    inline PTX, or in interpret mode with XLA twins); ``chunks`` (default: all) the 64-wide K
    chunks of the step to run; ``scaled=False`` leaves the scales out (the caller applies them to
    a per-group accumulator). Each chunk is decoded
    into registers while the previous chunk's wgmma runs (``wgmma_wait(1)``), so the last wgmma
    is still in flight on return: the caller releases x's slot one step late. ``a_scratch``
    (interpret mode, whose wgmma reads A only from shared memory) routes each decoded chunk
    through shared memory and waits for each wgmma. ``row_codes``: codes per swizzle row of
    ``w_smem`` (``weight_row_codes``); wider rows are loaded a row's span at a time and sliced
    into chunks in registers; ``spans`` (``load_weight_spans``) passes them in already loaded,
    so that calls splitting one step by ``chunks`` read each span from shared memory once.
    ``word_order``: ``w_smem`` holds codes in word order (``to_word_order``), read a 32-bit word
    per thread and row at a time (UPCAST_4X) and decoded straight into wgmma's registers."""
    g = group_size
    w_ref = w_smem.at[rows]
    wg_rows = w_ref.shape[0]
    byte_codes = code_bits(lut) == 8
    bk = w_smem.shape[1]
    chunks = range(bk // K_CHUNK) if chunks is None else chunks

    # E2M1 scales carry 2^E2M1_SCALE_EXP (``prepack_nk``): the decode leaves its unscale to
    # them (one multiply per pair fewer) where a scale multiply follows, on the GPU; elsewhere
    # the scale rows drop the factor (in fp32, exactly).
    skip_unscale = lut == "e2m1" and scaled and not interpret
    scale_exp = 0
    if lut == "e2m1":
        scale_exp = (UNSCALE_EXP[jnp.dtype(dtype)] if skip_unscale else 0) - E2M1_SCALE_EXP

    def row_of(ref, r, exp=0):
        v = plgpu.load(ref.at[r].at[rows], layout=plgpu.Layout.WGMMA.reduce(1))
        if exp:
            v = v.astype(jnp.float32) * (2.0 ** exp)
        return jax.lax.broadcast_in_dim(v.astype(dtype), (wg_rows, K_CHUNK), (0,))

    def chunk_scale(row):
        """The chunk's scales as a [rows, 64] array: one row of scales, or (groups of 16 / 32)
        a row per group, picked by column."""
        if g >= K_CHUNK:
            return row_of(s_smem, row, scale_exp)
        col = plgpu.broadcasted_iota(jnp.int32, (wg_rows, K_CHUNK), 1, layout=plgpu.Layout.WGMMA)
        out = row_of(s_smem, row, scale_exp)
        for j in range(1, K_CHUNK // g):
            out = jnp.where(col >= j * g, row_of(s_smem, row + j, scale_exp), out)
        return out

    if len(chunks) == bk // K_CHUNK == 1:
        # The decoded registers of the previous step's wgmma get reused now.
        plgpu.wgmma_wait(0)
    # A copy: spans loaded here stay inside this call (it may run in an accumulator's scope).
    spans = {} if spans is None else dict(spans)
    for c in chunks:
        row = (c * K_CHUNK) // g if g < bk else 0
        ks = slice(c * K_CHUNK, (c + 1) * K_CHUNK)
        # Loaded chunk by chunk, or a row's span at a time (not the whole step's tile up front):
        # fewer live registers.
        if row_codes > K_CHUNK:
            span, offset = divmod(c * K_CHUNK, row_codes)
            if span not in spans:
                spans[span] = _load_codes(w_ref.at[:, pl.ds(span * row_codes, row_codes)],
                                          word_order)
            wc = spans[span][:, offset:offset + K_CHUNK]
        else:
            wc = _load_codes(w_ref.at[:, ks], word_order)
        if byte_codes:
            wc = decode_bytes(wc, dtype, lut=lut, interpret=interpret)
        else:
            decode = decode_words if word_order else decode_codes
            wc = decode(wc, dtype, lut=lut, interpret=interpret, unscale=not skip_unscale)
        if z_smem is not None:
            wc = wc - row_of(z_smem, row)
        if scaled:
            wc = wc * chunk_scale(row)
        if a_scratch is not None:
            a_scratch[...] = wc
            plgpu.commit_smem()
            plgpu.wgmma(acc_ref, a_scratch, x_smem.at[:, ks].T)
            plgpu.wgmma_wait(0)
        else:
            plgpu.wgmma(acc_ref, wc, x_smem.at[:, ks].T)
            # One wgmma stays in flight while the next chunk is decoded.
            plgpu.wgmma_wait(1)


def _load_codes(ref, word_order: bool):
    """A weight tile's codes in registers: wgmma's layout (a byte per register), or a word per
    register (word order)."""
    if word_order:
        return plgpu.load(ref, layout=plgpu.Layout.WGMMA_UPCAST_4X)
    return ref[...]


def load_weight_spans(w_smem, rows, row_codes: int, word_order: bool = False) -> dict:
    """The weight tile's wide swizzle rows as register arrays, by span index (none for one row
    per chunk), for ``decode_mma_step(spans=...)``."""
    if row_codes <= K_CHUNK:
        return {}
    w_ref = w_smem.at[rows]
    return {span: _load_codes(w_ref.at[:, pl.ds(span * row_codes, row_codes)], word_order)
            for span in range(w_smem.shape[1] // row_codes)}


def step_specs(cfg: MgpuConfig, *, group_size: int, coords, has_zero: bool, delay_all: bool,
               lut: str = "int4"):
    """The pipeline's BlockSpecs for step t, where ``coords(t)`` gives the step's (weight row
    block, x row block, K block): the weight tile ``[bn, bk]``, the x tile ``[bm, bk]``, and the
    scale (and zero) rows ``[s_rows, bn]`` that step meets. x is read by the wgmma still in flight
    when a step returns, so its slot is freed one step late (``delay_all``: every input's, as the
    warp-specialized pipeline requires). ``lut``: the weight's code book (its code width)."""
    bn, bk, bm, g = cfg.block_n, cfg.block_k, cfg.block_m, group_size
    s_rows = scale_rows_per_step(bk, g)
    late = 1 if delay_all else 0

    def w_index(t):
        n_idx, _, k_idx = coords(t)
        return n_idx, k_idx

    def x_index(t):
        _, m_idx, k_idx = coords(t)
        return m_idx, k_idx

    def s_index(t):
        n_idx, _, k_idx = coords(t)
        return k_idx * bk // g // s_rows, n_idx

    specs = [
        # Tiled per 64-wide chunk, so each chunk loads on its own (or per wide row).
        plgpu.BlockSpec((bn, bk), w_index, transforms=swizzle_tiles(weight_row_codes(cfg, lut), code_bits(lut)),
                        delay_release=late),
        plgpu.BlockSpec((bm, bk), x_index, transforms=swizzle_tiles(bk, 16), delay_release=1),
        plgpu.BlockSpec((s_rows, bn), s_index, delay_release=late),
    ]
    if has_zero:
        specs.append(plgpu.BlockSpec((s_rows, bn), s_index, delay_release=late))
    return specs


def launch_kernel(body, xs, packed, cfg: MgpuConfig, *, scratch, interpret: bool, bias=None,
                  final_scratch: dict | None = None, slots=None, activation: str | None = None,
                  **kernel_kw):
    """Runs ``body(ni, si, mi, x_gmem, w_gmem, s_gmem, z_gmem or None, out, *scratch)`` on the
    (N_pad / block_n, split_k, M_pad / block_m) grid (``M_pad``: x's rows rounded up to
    ``block_m``). ``out`` is the fp32 ``[split_k, N_pad, M_pad]`` partials' reference, which is
    returned; or, with ``cfg.final_output``, a ``FinalOutputRefs`` for ``store_final_output``,
    and the kernel returns ``[M, N]`` (M: x's rows) in x's dtype, global scale and
    ``bias`` applied; its split-K CTAs are one cluster (``final_scratch``: the body's own
    ``FinalOutputRefs`` scratch instead of ``final_output_scratch``'s). Interpret mode starts
    every buffer as NaN, so an unwritten tile shows.

    ``slots`` (MoE experts: ``packed`` holds a stack ``[E, N_pad, K_pad]``): int32 ``(expert_ids,
    counts)``, one entry per ``block_m`` rows of ``xs``; the CTAs of row tile ``i`` multiply by
    expert ``expert_ids[i]``'s weight, scales and bias, and do nothing where ``counts[i]`` is 0.

    ``activation`` (with ``cfg.final_output``): ``store_final_output`` writes the activation of each
    tile's gate and up halves, so the output has ``N / 2`` columns."""
    has_zero = packed.zero is not None
    m_pad = round_up(xs.shape[0], cfg.block_m)
    tiles = (packed.n_pad // cfg.block_n, m_pad // cfg.block_m)
    args = [xs, packed.data, packed.scale] + ([packed.zero] if has_zero else [])
    channel_scale = channel_scale_of(packed)
    has_cs = channel_scale is not None
    if has_cs and not cfg.final_output:
        raise ValueError("channel scales (8-bit weights) are applied by the kernel's own final "
                         "output only: MgpuConfig.final_output")
    if cfg.final_output:
        if final_scratch is None:
            final_scratch = final_output_scratch(cfg.block_n, cfg.block_m, xs.dtype,
                                                 None if bias is None else bias.dtype,
                                                 cfg.split_k, interpret, channel_scale=has_cs,
                                                 activation=activation)
        has_gs = packed.global_scale is not None
        args += (([packed.global_scale] if has_gs else []) + ([channel_scale] if has_cs else [])
                 + ([bias] if bias is not None else []))
        cols = packed.n // 2 if activation else final_output_cols(packed, xs.dtype)
        out_types = [jax.ShapeDtypeStruct((xs.shape[0], cols), xs.dtype)]
        if interpret and cfg.split_k > 1:   # the workspace
            out_types.append(jax.ShapeDtypeStruct((cfg.split_k, packed.n_pad, m_pad),
                                                 jnp.float32))
        mesh = dict(grid=tiles, grid_names=("n", "m"), cluster=(cfg.split_k,),
                    cluster_names=("s",))
    else:
        final_scratch, has_gs = {}, False
        out_types = [jax.ShapeDtypeStruct((cfg.split_k, packed.n_pad, m_pad), jnp.float32)]
        mesh = dict(grid=(tiles[0], cfg.split_k, tiles[1]), grid_names=("n", "s", "m"))

    if slots is not None:
        args += list(slots)

    def kernel(*refs):
        n_io = len(args) + len(out_types)
        inputs, outputs = refs[:len(args)], refs[len(args):n_io]
        scratch_refs, final_refs = refs[n_io:]
        if slots is not None:
            *inputs, ids_gmem, counts_gmem = inputs
        x_gmem, w_gmem, s_gmem, *extra = inputs
        z_gmem = extra.pop(0) if has_zero else None
        ni, si, mi = (jax.lax.axis_index(name) for name in ("n", "s", "m"))
        if slots is not None:   # this row tile's expert: its slice of every per-expert input
            e = ids_gmem[mi]
            w_gmem, s_gmem = w_gmem.at[e], s_gmem.at[e]
            z_gmem = None if z_gmem is None else z_gmem.at[e]
            extra = [ref.at[e] for ref in extra]
        out = outputs[0]
        if cfg.final_output:
            out = FinalOutputRefs(out_gmem=outputs[0],
                                  global_scale_gmem=extra.pop(0) if has_gs else None,
                                  channel_scale_gmem=extra.pop(0) if has_cs else None,
                                  bias_gmem=extra.pop(0) if bias is not None else None,
                                  workspace_gmem=outputs[1] if len(outputs) > 1 else None,
                                  **final_refs)
        if slots is None:
            body(ni, si, mi, x_gmem, w_gmem, s_gmem, z_gmem, out, *scratch_refs)
        else:   # an empty slot's CTAs (the whole cluster alike) skip its work
            pl.when(counts_gmem[mi] > 0)(
                lambda: body(ni, si, mi, x_gmem, w_gmem, s_gmem, z_gmem, out, *scratch_refs))

    call = plgpu.kernel(kernel, out_type=out_types,
                        scratch_types=(list(scratch), final_scratch), **mesh, **kernel_kw)
    if interpret:
        with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams(uninitialized_memory="nan")):
            return call(*args)[0]
    return call(*args)[0]


def channel_scale_of(packed):
    """The packed weight's fp32 per-channel scales (8-bit weights, ``PackedW8NK``), or None."""
    return getattr(packed, "channel_scale", None)


def final_output_cols(packed, dtype) -> int:
    """Columns of the final output: N where the output's TMA store can address it, else N_pad (the
    caller slices). Mosaic GPU splits the store into 128-byte column tiles and needs the array's
    columns to be a whole number of them (N = 200 bf16 failed to lower on the H200)."""
    tile = 128 // jnp.dtype(dtype).itemsize
    return packed.n if packed.n % tile == 0 else packed.n_pad
