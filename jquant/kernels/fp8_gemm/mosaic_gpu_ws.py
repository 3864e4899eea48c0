"""The warp-specialized FP8 GEMM for large M (``Fp8GemmConfig.compute_wgs = 2``): two compute
warpgroups, each owning ``block_a`` rows of a ``2 · block_a``-row x tile and sharing the weight tile,
plus a warpgroup that only issues the TMA copies (``emit_pipeline_warp_specialized``), as the W4A16
kernel does for M ≥ 64. Same math as ``fp8_gemm_mgpu``: with one K block (per-token × per-channel or
per-tensor scales) one fp32 accumulator per warpgroup, both sides' scales in the epilogue; with block
scales every K step's wgmmas go into a fresh accumulator that is promoted into the warpgroup's fp32
sum by the step's scales. While one warpgroup promotes, the other's wgmmas keep the tensor cores
busy: the one-warpgroup block kernel idles them during each promotion (1.4-1.5× faster on the H100 at
M = 4096-8192, bench/results/h100/gemm8_fp8_sweep.md). The bias and the store come last, each
warpgroup storing its own rows. ``grid_tile_width`` walks the tiles in planar-snake strips (L2 reuse)
instead of grid order; MoE ``slots`` give each x tile its expert, as in ``fp8_gemm_mgpu``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jquant.kernels.fp8_gemm.config import BLOCK_K, Fp8GemmConfig
from jquant.kernels.fp8_gemm.mosaic_gpu import promoted_step

# Registers left to the copy-issuing warpgroup (the compute warpgroups get the rest).
_MEMORY_REGISTERS = 40


def fp8_gemm_mgpu_ws(a, a_scale, b, b_scale, bias, *, out_dtype, config: Fp8GemmConfig, tiles,
                     interpret: bool = False, slots=None) -> jax.Array:
    """``fp8_gemm_mgpu``'s result (x as A) with ``config.compute_wgs`` compute warpgroups; ``tiles``:
    the operand tiling transforms (``fp8_gemm_mgpu``'s); ``slots`` as ``fp8_gemm_mgpu``'s, one entry
    per ``compute_wgs · block_a`` rows of ``a``."""
    cfg = config
    wgs, ba, bb = cfg.compute_wgs, cfg.block_a, cfg.block_b
    cta_a = wgs * ba
    ra, k_pad = a.shape
    rb = b.shape[-2]
    steps = k_pad // BLOCK_K
    blocks = a_scale.shape[0]
    if cfg.swap_ab or blocks not in (1, steps) or ra % cta_a or rb % bb:
        raise ValueError(f"fp8 gemm (warp-specialized): x as A, 1 or {steps} scale blocks (got {blocks}), A rows "
                         f"{ra} a multiple of {cta_a} and B rows {rb} of {bb}")
    blocked = blocks > 1
    has_bias = bias is not None
    n_vec = (0 if blocked else 2) + int(has_bias)   # the epilogue's per-row vectors

    n_in = 4 + int(has_bias) + (2 if slots is not None else 0)

    def tile_index(lin):
        """(x tile, weight tile) of the ``lin``-th tile: planar-snake strips or grid order (x minor)."""
        if cfg.grid_tile_width:
            return plgpu.planar_snake(lin, grid, 0, cfg.grid_tile_width)
        return jax.lax.rem(lin, grid[0]), jax.lax.div(lin, grid[0])

    def kernel(*refs):
        a_gmem, as_gmem, b_gmem, bs_gmem = refs[:4]
        bias_gmem = refs[4] if has_bias else None
        ids_gmem, counts_gmem = refs[n_in - 2:n_in] if slots is not None else (None, None)

        def run_tile(ia, ib, allocations=None):
            if slots is None:
                return body(ia, ib, a_gmem, as_gmem, b_gmem, bs_gmem, bias_gmem, *refs[n_in:], allocations)
            e = ids_gmem[ia]   # this row tile's expert: its slice of every per-expert input
            bias_e = None if bias_gmem is None else bias_gmem.at[e]
            pl.when(counts_gmem[ia] > 0)(lambda: body(ia, ib, a_gmem, as_gmem, b_gmem.at[e], bs_gmem.at[e], bias_e,
                                                      *refs[n_in:], allocations))

        if not cfg.persistent_ctas:
            if cfg.grid_tile_width:
                return run_tile(*tile_index(jax.lax.axis_index("t")))
            return run_tile(jax.lax.axis_index("a"), jax.lax.axis_index("b"))

        # Persistent: each CTA loops over tiles with the pipeline's buffers and barriers allocated once,
        # so the copy warpgroup loads the next tile's first steps while the compute ones store this one's.
        b_one = b_gmem if slots is None else b_gmem.at[0]
        bs_one = bs_gmem if slots is None else bs_gmem.at[0]
        allocs = pipeline(0, 0, None).get_allocations(*pipeline_operands(a_gmem, as_gmem, b_one, bs_one))

        def loop(allocations):
            @plgpu.nd_loop((grid[0] * grid[1],), collective_axes="t")
            def _(info):
                run_tile(*tile_index(info.index[0]), allocations)

        pl.run_scoped(loop, allocs, collective_axes="wg")

    def pipeline_operands(a_gmem, as_gmem, b_gmem, bs_gmem):
        return [a_gmem, b_gmem] + ([as_gmem, bs_gmem] if blocked else [])

    def pipeline(ia, ib, compute_context):
        """The K-step pipeline of tile (``ia``, ``ib``)."""
        if blocked:
            def step(_, a_smem, b_smem, as_smem, bs_smem, total):
                rows = pl.ds(jax.lax.axis_index("wg") * ba, ba)   # this warpgroup's rows of the x tile
                return promoted_step(a_smem.at[rows], b_smem, as_smem.at[0, rows], bs_smem.at[0], total)
        else:
            def step(_, a_smem, b_smem, acc_ref):
                wg = jax.lax.axis_index("wg")
                plgpu.wgmma(acc_ref, a_smem.at[pl.ds(wg * ba, ba)], b_smem.T)
                plgpu.wgmma_wait(1)   # one wgmma in flight; both tiles are released a step late
                return acc_ref

        in_specs = [plgpu.BlockSpec((cta_a, BLOCK_K), lambda t: (ia, t), transforms=tiles,
                                    delay_release=0 if blocked else 1),
                    plgpu.BlockSpec((bb, BLOCK_K), lambda t: (ib, t), transforms=tiles,
                                    delay_release=0 if blocked else 1)]
        if blocked:
            in_specs += [plgpu.BlockSpec((1, cta_a), lambda t: (t, ia)), plgpu.BlockSpec((1, bb), lambda t: (t, ib))]
        return plgpu.emit_pipeline_warp_specialized(
            step, grid=(steps,), memory_registers=_MEMORY_REGISTERS, in_specs=in_specs,
            wg_axis="wg", num_compute_wgs=wgs, max_concurrent_steps=max(2, min(cfg.max_concurrent_steps, steps)),
            compute_context=compute_context)

    def body(ia, ib, a_gmem, as_gmem, b_gmem, bs_gmem, bias_gmem, out_gmem, vec_a, vec_b, vec_bias, vec_barrier,
             out_smem, allocations):
        def compute_context(eval_pipeline):
            wg = jax.lax.axis_index("wg")
            row0 = ia * cta_a + wg * ba
            cols = pl.ds(ib * bb, bb)
            # (source, smem, 0: along x's rows / 1: along the weight's); scales multiply, the bias adds
            vectors = [] if blocked else [(as_gmem.at[0, pl.ds(row0, ba)], vec_a, 0), (bs_gmem.at[0, cols], vec_b, 1)]
            if has_bias:
                vectors.append((bias_gmem.at[cols], vec_bias, 1))
            for i, (src, dst, _) in enumerate(vectors):
                plgpu.copy_gmem_to_smem(src, dst.at[wg], vec_barrier.at[i * wgs + wg])

            if blocked:
                acc = eval_pipeline(plgpu.layout_cast(jnp.zeros((ba, bb), jnp.float32), plgpu.Layout.WGMMA))
            else:
                def with_acc(acc_ref):
                    eval_pipeline(acc_ref)
                    plgpu.wgmma_wait(0)
                    return acc_ref[...]

                acc = pl.run_scoped(with_acc, plgpu.ACC((ba, bb), jnp.float32))
            for i, (_, dst, dim) in enumerate(vectors):
                plgpu.barrier_wait(vec_barrier.at[i * wgs + wg])
                v = plgpu.load(dst.at[wg], layout=plgpu.Layout.WGMMA.reduce(1 - dim))
                v = jax.lax.broadcast_in_dim(v, (ba, bb), (dim,))
                acc = acc + v if has_bias and i == len(vectors) - 1 else acc * v
            out_smem.at[wg][...] = acc.astype(out_dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out_smem.at[wg], out_gmem.at[pl.ds(row0, ba), cols])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        pipeline(ia, ib, compute_context)(*pipeline_operands(a_gmem, as_gmem, b_gmem, bs_gmem),
                                          allocations=allocations)

    scratch = [plgpu.SMEM((wgs, ba), jnp.float32), plgpu.SMEM((wgs, bb), jnp.float32),
               plgpu.SMEM((wgs, bb), jnp.float32), plgpu.Barrier(num_barriers=max(n_vec, 1) * wgs),
               plgpu.SMEM((wgs, ba, bb), out_dtype)]
    grid = (ra // cta_a, rb // bb)
    if cfg.persistent_ctas:
        launch = dict(grid=(min(cfg.persistent_ctas, grid[0] * grid[1]),), grid_names=("t",))
    elif cfg.grid_tile_width:
        launch = dict(grid=(grid[0] * grid[1],), grid_names=("t",))
    else:
        launch = dict(grid=grid, grid_names=("a", "b"))
    call = plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct((ra, rb), out_dtype), **launch,
                        num_threads=wgs + 1, thread_name="wg", scratch_types=scratch)
    args = [a, a_scale, b, b_scale] + ([bias] if has_bias else []) + (list(slots) if slots is not None else [])
    if interpret:
        with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams(uninitialized_memory="nan")):
            return call(*args)
    return call(*args)
