"""The warp-specialized Mosaic GPU W4A16 kernel: two compute warpgroups share each x tile.

Same math and layout as ``w4a16_mgpu`` (swap AB, int4 / E2M1 decoded into wgmma registers), but
a CTA has ``compute_wgs`` warpgroups that decode and multiply, each owning ``block_n /
compute_wgs`` weight rows, plus one warpgroup that only issues the TMA copies
(``emit_pipeline_warp_specialized``). Why: with one warpgroup per CTA, the x tile is fetched
from L2 once per 64 or 128 weight rows, which at M ≥ 64 moves more bytes than the int4 weight
itself (H200 counts: docs/design/w4a16.md, "Warp specialization"); here one fetch feeds twice
the rows, and the copies no longer sit in the compute warps' instruction stream.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jquant.kernels.w4a16.layout import K_CHUNK
from jquant.kernels.w4a16.mosaic_gpu_common import (decode_mma_step, launch_kernel, step_specs,
                                                     weight_row_codes)
from jquant.kernels.w4a16.config import MgpuConfig
from jquant.kernels.w4a16.mosaic_gpu_epilogue import FinalOutputRefs

# Registers left to the copy-issuing warpgroup (the compute warpgroups get the rest).
_MEMORY_REGISTERS = 40
_EPILOGUE_ROWS = 64


def w4a16_mgpu_ws(xs: jax.Array, packed, *, config: MgpuConfig, bias=None,
                  interpret: bool = False) -> jax.Array:
    """fp32 ``[split_k, N_pad, M_pad]`` partials of ``(xs @ W)ᵀ`` with ``config.compute_wgs``
    compute warpgroups per CTA, or (``final_output``, split-K 1) ``xs @ W · global_scale +
    bias`` in x's dtype, as ``w4a16_mgpu`` returns it; reached through ``w4a16_mgpu``, which
    checks the launch and the bias."""
    cfg = config
    bn, bk, bm, wgs = cfg.block_n, cfg.block_k, cfg.block_m, cfg.compute_wgs
    wg_rows = bn // wgs
    g = packed.group_size
    steps = packed.k_pad // cfg.split_k // bk
    has_zero = packed.zero is not None

    def body(ni, si, mi, x_gmem, w_gmem, s_gmem, z_gmem, out, *a_scratch):
        wg = jax.lax.axis_index("wg")
        rows = pl.ds(wg * wg_rows, wg_rows)

        def step(idx, w_smem, x_smem, s_smem, *rest_refs):
            *z_smem, carry = rest_refs
            del idx
            decode_mma_step(w_smem, x_smem, s_smem, z_smem[0] if z_smem else None, carry,
                            rows=rows, group_size=g, dtype=xs.dtype, lut=packed.lut,
                            interpret=interpret, word_order=packed.word_order,
                            row_codes=weight_row_codes(cfg, packed.lut),
                            scaled=not getattr(packed, "unit_scales", False),
                            a_scratch=a_scratch[-1].at[wg] if interpret else None)
            return carry

        def compute_context(eval_pipeline):
            row0 = ni * bn + wg * wg_rows   # this warpgroup's first output column
            if cfg.final_output:
                for gmem, smem, barrier in (
                        (out.bias_gmem, out.bias_smem, out.bias_barrier),
                        (out.channel_scale_gmem, out.channel_scale_smem,
                         out.channel_scale_barrier)):
                    if gmem is not None:
                        plgpu.copy_gmem_to_smem(gmem.at[pl.ds(row0, wg_rows)], smem.at[wg],
                                                barrier.at[wg])

            def with_acc(acc_ref):
                eval_pipeline(acc_ref)
                plgpu.wgmma_wait(0)
                acc = acc_ref[...]
                if cfg.final_output:
                    store_final_rows(acc, out, wg=wg, row0=row0, mi=mi)
                    return
                # 64 rows at a time through shared memory, which the pipeline's stages fill.
                o_smem = a_scratch[0]
                for r in range(0, wg_rows, _EPILOGUE_ROWS):
                    o_smem.at[wg][...] = acc[r:r + _EPILOGUE_ROWS]
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(
                        o_smem.at[wg], out.at[si, pl.ds(row0 + r, _EPILOGUE_ROWS),
                                              pl.ds(mi * bm, bm)])
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            pl.run_scoped(with_acc, plgpu.ACC((wg_rows, bm), jnp.float32))

        plgpu.emit_pipeline_warp_specialized(
            step, grid=(steps,), memory_registers=_MEMORY_REGISTERS,
            in_specs=step_specs(cfg, group_size=g, coords=lambda t: (ni, mi, si * steps + t),
                                has_zero=has_zero, delay_all=True, lut=packed.lut),
            wg_axis="wg", num_compute_wgs=wgs,
            max_concurrent_steps=max(2, min(cfg.max_concurrent_steps, steps)),
            compute_context=compute_context,
        )(w_gmem, x_gmem, s_gmem, *([z_gmem] if has_zero else []))

    # The epilogue's staging buffer: fp32 partial rows, or (final_output, in final_scratch)
    # the transposed output columns in x's dtype; both 64 rows of W at a time.
    scratch = [] if cfg.final_output else [plgpu.SMEM((wgs, _EPILOGUE_ROWS, bm), jnp.float32)]
    if interpret:
        scratch.append(plgpu.SMEM((wgs, wg_rows, K_CHUNK), xs.dtype))
    final_scratch = None
    if cfg.final_output:
        final_scratch = {"out_smem": plgpu.SMEM((wgs, bm, _EPILOGUE_ROWS), xs.dtype)}
        if bias is not None:
            final_scratch.update(bias_smem=plgpu.SMEM((wgs, wg_rows), bias.dtype),
                                 bias_barrier=plgpu.Barrier(num_barriers=wgs))
        if getattr(packed, "channel_scale", None) is not None:
            final_scratch.update(channel_scale_smem=plgpu.SMEM((wgs, wg_rows), jnp.float32),
                                 channel_scale_barrier=plgpu.Barrier(num_barriers=wgs))
    return launch_kernel(body, xs, packed, cfg, scratch=scratch, interpret=interpret,
                         bias=bias, final_scratch=final_scratch, num_threads=wgs + 1,
                         thread_name="wg")


def store_final_rows(acc, refs: FinalOutputRefs, *, wg, row0, mi):
    """One compute warpgroup's ``[wg_rows, bm]`` tile of ``(xs @ W)ᵀ`` (split-K 1) as output
    columns ``row0 …``: global scale and bias applied, transposed into x's dtype 64 columns at
    a time, stored with TMA (rows past M and columns past N dropped)."""
    wg_rows, bm = acc.shape
    if refs.global_scale_gmem is not None:
        acc = acc * refs.global_scale_gmem[0]
    if refs.channel_scale_gmem is not None:
        plgpu.barrier_wait(refs.channel_scale_barrier.at[wg])
    if refs.bias_gmem is not None:
        plgpu.barrier_wait(refs.bias_barrier.at[wg])
    out_smem = refs.out_smem.at[wg]
    for r in range(0, wg_rows, _EPILOGUE_ROWS):
        tile = acc[r:r + _EPILOGUE_ROWS]
        if refs.channel_scale_gmem is not None:
            cs = plgpu.load(refs.channel_scale_smem.at[wg, pl.ds(r, _EPILOGUE_ROWS)],
                            layout=plgpu.Layout.WGMMA.reduce(1))
            tile = tile * jax.lax.broadcast_in_dim(cs, (_EPILOGUE_ROWS, bm), (0,))
        if refs.bias_gmem is not None:
            bias = plgpu.load(refs.bias_smem.at[wg, pl.ds(r, _EPILOGUE_ROWS)],
                              layout=plgpu.Layout.WGMMA.reduce(1))
            tile = tile + jax.lax.broadcast_in_dim(bias.astype(jnp.float32),
                                                   (_EPILOGUE_ROWS, bm), (0,))
        out_smem.transpose((1, 0))[...] = tile.astype(out_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem, refs.out_gmem.at[pl.ds(mi * bm, bm),
                                                           pl.ds(row0 + r, _EPILOGUE_ROWS)])
        # The next 64 columns reuse the buffer once the TMA engine has read it.
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
