"""The warp-specialized FP8 GEMM for large M (``Fp8GemmConfig.compute_wgs = 2``): two compute
warpgroups, each owning ``block_a`` rows of a ``2 · block_a``-row x tile and sharing the weight tile,
plus a warpgroup that only issues the TMA copies (``emit_pipeline_warp_specialized``), as the W4A16
kernel does for M ≥ 64. Same math as ``fp8_gemm_mgpu`` with one K block (per-token × per-channel or
per-tensor scales): one fp32 accumulator per warpgroup, both sides' scales and the bias in the
epilogue, each warpgroup storing its own rows."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jquant.kernels.fp8_gemm.config import BLOCK_K, Fp8GemmConfig

# Registers left to the copy-issuing warpgroup (the compute warpgroups get the rest).
_MEMORY_REGISTERS = 40


def fp8_gemm_mgpu_ws(a, a_scale, b, b_scale, bias, *, out_dtype, config: Fp8GemmConfig, tiles,
                     interpret: bool = False) -> jax.Array:
    """``fp8_gemm_mgpu``'s result (x as A, one scale block) with ``config.compute_wgs`` compute
    warpgroups; ``tiles``: the operand tiling transforms (``fp8_gemm_mgpu``'s)."""
    cfg = config
    wgs, ba, bb = cfg.compute_wgs, cfg.block_a, cfg.block_b
    cta_a = wgs * ba
    ra, k_pad = a.shape
    rb = b.shape[0]
    if cfg.swap_ab or a_scale.shape[0] != 1 or ra % cta_a or rb % bb:
        raise ValueError(f"fp8 gemm (warp-specialized): x as A, one scale block, A rows {ra} a multiple of "
                         f"{cta_a} and B rows {rb} of {bb}")
    steps = k_pad // BLOCK_K
    has_bias = bias is not None
    n_vec = 3 if has_bias else 2

    def kernel(a_gmem, as_gmem, b_gmem, bs_gmem, *rest):
        bias_gmem = rest[0] if has_bias else None
        out_gmem, vec_a, vec_b, vec_bias, vec_barrier, out_smem = rest[-6:]
        ia, ib = jax.lax.axis_index("a"), jax.lax.axis_index("b")

        def step(_, a_smem, b_smem, acc_ref):
            wg = jax.lax.axis_index("wg")
            plgpu.wgmma(acc_ref, a_smem.at[pl.ds(wg * ba, ba)], b_smem.T)
            plgpu.wgmma_wait(1)   # one wgmma in flight; both tiles are released a step late
            return acc_ref

        def compute_context(eval_pipeline):
            wg = jax.lax.axis_index("wg")
            row0 = ia * cta_a + wg * ba
            cols = pl.ds(ib * bb, bb)
            copies = [(as_gmem.at[0, pl.ds(row0, ba)], vec_a), (bs_gmem.at[0, cols], vec_b)]
            if has_bias:
                copies.append((bias_gmem.at[cols], vec_bias))
            for i, (src, dst) in enumerate(copies):
                plgpu.copy_gmem_to_smem(src, dst.at[wg], vec_barrier.at[i * wgs + wg])

            def with_acc(acc_ref):
                eval_pipeline(acc_ref)
                plgpu.wgmma_wait(0)
                acc = acc_ref[...]
                for i, (_, dst) in enumerate(copies):
                    plgpu.barrier_wait(vec_barrier.at[i * wgs + wg])
                    dim = 0 if i == 0 else 1   # x's scales run along the rows, the rest along the columns
                    v = plgpu.load(dst.at[wg], layout=plgpu.Layout.WGMMA.reduce(1 - dim))
                    v = jax.lax.broadcast_in_dim(v.astype(jnp.float32), (ba, bb), (dim,))
                    acc = acc + v if i == 2 else acc * v
                out_smem.at[wg][...] = acc.astype(out_dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(out_smem.at[wg], out_gmem.at[pl.ds(row0, ba), cols])
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

            pl.run_scoped(with_acc, plgpu.ACC((ba, bb), jnp.float32))

        plgpu.emit_pipeline_warp_specialized(
            step, grid=(steps,), memory_registers=_MEMORY_REGISTERS,
            in_specs=[plgpu.BlockSpec((cta_a, BLOCK_K), lambda t: (ia, t), transforms=tiles, delay_release=1),
                      plgpu.BlockSpec((bb, BLOCK_K), lambda t: (ib, t), transforms=tiles, delay_release=1)],
            wg_axis="wg", num_compute_wgs=wgs, max_concurrent_steps=max(2, min(cfg.max_concurrent_steps, steps)),
            compute_context=compute_context,
        )(a_gmem, b_gmem)

    scratch = [plgpu.SMEM((wgs, ba), jnp.float32), plgpu.SMEM((wgs, bb), jnp.float32),
               plgpu.SMEM((wgs, bb), jnp.float32), plgpu.Barrier(num_barriers=n_vec * wgs),
               plgpu.SMEM((wgs, ba, bb), out_dtype)]
    call = plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct((ra, rb), out_dtype), grid=(ra // cta_a, rb // bb),
                        grid_names=("a", "b"), num_threads=wgs + 1, thread_name="wg", scratch_types=scratch)
    args = [a, a_scale, b, b_scale] + ([bias] if has_bias else [])
    if interpret:
        with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams(uninitialized_memory="nan")):
            return call(*args)
    return call(*args)
