"""The FP8 (e4m3 × e4m3) GEMM on Hopper with Mosaic GPU: fp32 wgmma accumulation, per-row scales of
both operands, and DeepSeek's block scales promoted per K block.

``acc[i, j] = Σ_k a[i, k] · b[j, k]`` with both operands K-major in shared memory (what FP8 wgmma
takes), so the weight ``[N, K]`` and the activations ``[M, K]`` go to the kernel as stored, either
one as A (``Fp8GemmConfig.swap_ab``: the weight is A for small M, as in the W4A16 kernel). Grid
(A rows / block_a, B rows / block_b); each CTA streams K through a TMA pipeline of 128-wide steps.

Scales: with one K block (per-token × per-channel, per tensor) the wgmmas of all steps go into one
accumulator, scaled once in the epilogue; with block scales (``K / 128`` blocks) every step's
wgmmas go into a fresh accumulator that is scaled by the step's scales of both sides and added to
the fp32 sum (promotion, as DeepGEMM does: FP8 wgmma accumulates in reduced precision over long
K). The epilogue adds the bias, casts and stores the tile with TMA (transposed under swap AB).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jquant.kernels.fp8_gemm.config import BLOCK_K, MIN_SCALE_ROWS, Fp8GemmConfig
from jquant.kernels.lowered_once import lowered_once


def _tiles(cols: int, bits: int):
    swizzle = plgpu.find_swizzle(cols * bits, "fp8_gemm")
    return (plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle))


def promoted_step(a_tile, b_tile, a_scales, b_scales, total):
    """One K step with block scales: the step's wgmmas of ``a_tile`` ``[rows_a, BLOCK_K]`` and
    ``b_tile`` ``[rows_b, BLOCK_K]`` into a fresh fp32 accumulator, scaled by the step's scale rows
    (``a_scales`` ``[rows_a]``, ``b_scales`` ``[rows_b]`` in shared memory) and added to ``total``
    (promotion, as DeepGEMM does). The scales are read before the wgmmas are issued, so their latency
    hides under them."""
    shape = total.shape
    sa = plgpu.load(a_scales, layout=plgpu.Layout.WGMMA.reduce(1))
    sb = plgpu.load(b_scales, layout=plgpu.Layout.WGMMA.reduce(0))

    def block_dot(acc_ref):
        plgpu.wgmma(acc_ref, a_tile, b_tile.T)
        plgpu.wgmma_wait(0)
        return acc_ref[...]

    part = pl.run_scoped(block_dot, plgpu.ACC(shape, jnp.float32))
    return total + (part * jax.lax.broadcast_in_dim(sa, shape, (0,)) * jax.lax.broadcast_in_dim(sb, shape, (1,)))


@lowered_once("out_dtype", "config", "interpret")
def fp8_gemm_mgpu(a, a_scale, b, b_scale, bias, *, out_dtype, config: Fp8GemmConfig,
                  interpret: bool = False, slots=None) -> jax.Array:
    """``acc`` scaled: ``[A rows, B rows]`` (or transposed, ``swap_ab``: ``[B rows, A rows]``, so
    the result is always ``[M_pad, N_pad]``) in ``out_dtype``. ``a`` ``[Ra, K_pad]``, ``b`` ``[Rb,
    K_pad]`` e4m3 with rows multiples of the blocks; ``a_scale`` ``[blocks, Ra]``, ``b_scale``
    ``[blocks, Rb]`` fp32; ``bias`` ``[N_pad]`` fp32 or None (along the weight's rows: A's under
    swap AB, else B's).

    ``slots`` (MoE experts, A = x, not swap AB): int32 ``(expert_ids, counts)``, one entry per
    ``block_a · compute_wgs`` rows of ``a``; ``b``, ``b_scale`` and ``bias`` are stacked per expert (``[E, …]``)
    and row tile ``i`` multiplies by expert ``expert_ids[i]``'s; a tile of count 0 does nothing."""
    cfg = config
    if jnp.dtype(out_dtype).itemsize > 2 and (cfg.swap_ab or cfg.compute_wgs > 1):
        raise ValueError(f"fp8 gemm: a {jnp.dtype(out_dtype).name} output needs x as A and one compute warpgroup "
                         f"(swap_ab=False, compute_wgs=1), got {cfg}")
    if a_scale.shape[0] > 1 and min(cfg.block_a, cfg.block_b) < MIN_SCALE_ROWS:
        raise ValueError(f"fp8 gemm: block scales need tiles of at least {MIN_SCALE_ROWS} rows on each side (a "
                         f"scale row's TMA copy must land 128-byte aligned), got {cfg}")
    if cfg.compute_wgs > 1:
        from jquant.kernels.fp8_gemm.mosaic_gpu_ws import fp8_gemm_mgpu_ws
        return fp8_gemm_mgpu_ws(a, a_scale, b, b_scale, bias, out_dtype=out_dtype, config=cfg,
                                tiles=_tiles(BLOCK_K, 8), interpret=interpret, slots=slots)
    if slots is not None and cfg.swap_ab:
        raise ValueError("fp8 gemm: expert slots take x as A (Fp8GemmConfig.swap_ab=False)")
    ba, bb = cfg.block_a, cfg.block_b
    ra, k_pad = a.shape
    rb = b.shape[-2]
    blocks = a_scale.shape[0]
    steps = k_pad // BLOCK_K
    if ra % ba or rb % bb or k_pad % BLOCK_K or b.shape[-1] != k_pad or b_scale.shape[-2] != blocks:
        raise ValueError(f"fp8 gemm: a {a.shape} / b {b.shape} must tile by ({ba}, {BLOCK_K}) / ({bb}, "
                         f"{BLOCK_K}); scales {a_scale.shape} / {b_scale.shape} need the same blocks")
    if blocks not in (1, steps):
        raise ValueError(f"fp8 gemm: {blocks} scale blocks for {steps} K steps; expected 1 or {steps}")
    blocked = blocks > 1
    out_rows, out_cols = (rb, ra) if cfg.swap_ab else (ra, rb)
    out_tile = (bb, ba) if cfg.swap_ab else (ba, bb)
    has_bias = bias is not None

    n_in = 4 + int(has_bias) + (2 if slots is not None else 0)

    def kernel(*refs):
        a_gmem, as_gmem, b_gmem, bs_gmem = refs[:4]
        bias_gmem = refs[4] if has_bias else None
        rest = refs[n_in:]   # out_gmem, vec_smem, vec_barrier, out_smem
        if slots is None:
            return body(a_gmem, as_gmem, b_gmem, bs_gmem, bias_gmem, *rest)
        ids_gmem, counts_gmem = refs[n_in - 2:n_in]
        ia = jax.lax.axis_index("a")
        e = ids_gmem[ia]   # this row tile's expert: its slice of every per-expert input
        bias_e = None if bias_gmem is None else bias_gmem.at[e]
        pl.when(counts_gmem[ia] > 0)(
            lambda: body(a_gmem, as_gmem, b_gmem.at[e], bs_gmem.at[e], bias_e, *rest))

    def body(a_gmem, as_gmem, b_gmem, bs_gmem, bias_gmem, out_gmem, vec_smem, vec_barrier, out_smem):
        ia, ib = jax.lax.axis_index("a"), jax.lax.axis_index("b")

        # The epilogue's per-row vectors: both sides' scales (one K block) and the bias.
        vectors = []
        if not blocked:
            vectors += [(as_gmem.at[0, pl.ds(ia * ba, ba)], 0), (bs_gmem.at[0, pl.ds(ib * bb, bb)], 1)]
        if has_bias:
            w_rows = (pl.ds(ia * ba, ba), 0) if cfg.swap_ab else (pl.ds(ib * bb, bb), 1)
            vectors.append((bias_gmem.at[w_rows[0]], w_rows[1]))
        for i, (src, _) in enumerate(vectors):
            plgpu.copy_gmem_to_smem(src, vec_smem[i], vec_barrier.at[i])

        in_specs = [plgpu.BlockSpec((ba, BLOCK_K), lambda t: (ia, t), transforms=_tiles(BLOCK_K, 8),
                                    delay_release=0 if blocked else 1),
                    plgpu.BlockSpec((bb, BLOCK_K), lambda t: (ib, t), transforms=_tiles(BLOCK_K, 8),
                                    delay_release=0 if blocked else 1)]
        operands = [a_gmem, b_gmem]
        if blocked:
            in_specs += [plgpu.BlockSpec((1, ba), lambda t: (t, ia)), plgpu.BlockSpec((1, bb), lambda t: (t, ib))]
            operands += [as_gmem, bs_gmem]
        pipeline_kw = dict(grid=(steps,), in_specs=in_specs,
                           max_concurrent_steps=max(2, min(cfg.max_concurrent_steps, steps)))

        if blocked:
            def step(_, a_smem, b_smem, as_smem, bs_smem, total):
                return promoted_step(a_smem, b_smem, as_smem.at[0], bs_smem.at[0], total)

            zeros = plgpu.layout_cast(jnp.zeros((ba, bb), jnp.float32), plgpu.Layout.WGMMA)
            acc = plgpu.emit_pipeline(step, init_carry=zeros, **pipeline_kw)(*operands)
        else:
            def step(_, a_smem, b_smem, acc_ref):
                plgpu.wgmma(acc_ref, a_smem, b_smem.T)
                plgpu.wgmma_wait(1)   # one wgmma in flight; its tiles are released a step late

            def run(acc_ref):
                plgpu.emit_pipeline(lambda idx, a_s, b_s: step(idx, a_s, b_s, acc_ref), **pipeline_kw)(*operands)
                plgpu.wgmma_wait(0)
                return acc_ref[...]

            acc = pl.run_scoped(run, plgpu.ACC((ba, bb), jnp.float32))

        for i, (_, dim) in enumerate(vectors):
            plgpu.barrier_wait(vec_barrier.at[i])
            v = plgpu.load(vec_smem[i], layout=plgpu.Layout.WGMMA.reduce(1 - dim))
            v = jax.lax.broadcast_in_dim(v.astype(jnp.float32), (ba, bb), (dim,))
            is_bias = has_bias and i == len(vectors) - 1
            acc = acc + v if is_bias else acc * v
        if cfg.swap_ab:
            out_smem.transpose((1, 0))[...] = acc.astype(out_dtype)
            dst = out_gmem.at[pl.ds(ib * bb, bb), pl.ds(ia * ba, ba)]
        else:
            out_smem[...] = acc.astype(out_dtype)
            dst = out_gmem.at[pl.ds(ia * ba, ba), pl.ds(ib * bb, bb)]
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem, dst)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    # One smem vector per epilogue operand, each as long as its side's block.
    vec_lens = ([ba, bb] if not blocked else []) + ([ba if cfg.swap_ab else bb] if has_bias else [])
    n_vectors = len(vec_lens)
    scratch = [[plgpu.SMEM((length,), jnp.float32) for length in vec_lens],
               plgpu.Barrier(num_barriers=max(n_vectors, 1)),
               plgpu.SMEM(out_tile, out_dtype)]
    call = plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct((out_rows, out_cols), out_dtype),
                        grid=(ra // ba, rb // bb), grid_names=("a", "b"), scratch_types=scratch)
    args = [a, a_scale, b, b_scale] + ([bias] if has_bias else []) + (list(slots) if slots is not None else [])
    if interpret:
        with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams(uninitialized_memory="nan")):
            return call(*args)
    return call(*args)
