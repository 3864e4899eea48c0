"""The warp-specialized Mosaic GPU W4A16 kernel: two compute warpgroups share each x tile.

Same math and layout as ``w4a16_mgpu`` (swap AB, int4 / E2M1 decoded into wgmma registers), but
a CTA has ``compute_wgs`` warpgroups that decode and multiply, each owning ``block_n /
compute_wgs`` weight rows, plus one warpgroup that only issues the TMA copies
(``emit_pipeline_warp_specialized``). Why: with one warpgroup per CTA, the x tile is fetched
from L2 once per 64 or 128 weight rows, which at M ≥ 64 moves more bytes than the int4 weight
itself (bench/NOTES.md); here one fetch feeds twice the rows, and the copies no longer sit in
the compute warps' instruction stream.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jquant.pallas_kernels.w4a16_mgpu_common import (K_CHUNK, MgpuConfig, decode_mma_step,
                                                     launch_kernel, step_specs,
                                                     weight_row_codes)

# Registers left to the copy-issuing warpgroup (the compute warpgroups get the rest).
_MEMORY_REGISTERS = 40
_EPILOGUE_ROWS = 64


def w4a16_mgpu_ws(xs: jax.Array, packed, *, config: MgpuConfig,
                  interpret: bool = False) -> jax.Array:
    """fp32 ``[split_k, N_pad, M_pad]`` partials of ``(xs @ W)ᵀ`` with ``config.compute_wgs``
    compute warpgroups per CTA; reached through ``w4a16_mgpu``, which checks the launch."""
    cfg = config
    bn, bk, bm, wgs = cfg.block_n, cfg.block_k, cfg.block_m, cfg.compute_wgs
    wg_rows = bn // wgs
    g = packed.group_size
    steps = packed.k_pad // cfg.split_k // bk
    has_zero = packed.zero is not None

    def body(ni, si, mi, x_gmem, w_gmem, s_gmem, z_gmem, out_gmem, o_smem, *a_scratch):
        wg = jax.lax.axis_index("wg")
        rows = pl.ds(wg * wg_rows, wg_rows)

        def step(idx, w_smem, x_smem, s_smem, *rest_refs):
            *z_smem, carry = rest_refs
            del idx
            decode_mma_step(w_smem, x_smem, s_smem, z_smem[0] if z_smem else None, carry,
                            rows=rows, group_size=g, dtype=xs.dtype, lut=packed.lut,
                            interpret=interpret, word_order=packed.word_order,
                            row_codes=weight_row_codes(cfg),
                            a_scratch=a_scratch[0].at[wg] if a_scratch else None)
            return carry

        def compute_context(eval_pipeline):
            def with_acc(acc_ref):
                eval_pipeline(acc_ref)
                plgpu.wgmma_wait(0)
                acc = acc_ref[...]
                # 64 rows at a time through shared memory, which the pipeline's stages fill.
                for r in range(0, wg_rows, _EPILOGUE_ROWS):
                    o_smem.at[wg][...] = acc[r:r + _EPILOGUE_ROWS]
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(
                        o_smem.at[wg], out_gmem.at[si, pl.ds(ni * bn + wg * wg_rows + r,
                                                             _EPILOGUE_ROWS), pl.ds(mi * bm, bm)])
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            pl.run_scoped(with_acc, plgpu.ACC((wg_rows, bm), jnp.float32))

        plgpu.emit_pipeline_warp_specialized(
            step, grid=(steps,), memory_registers=_MEMORY_REGISTERS,
            in_specs=step_specs(cfg, group_size=g, coords=lambda t: (ni, mi, si * steps + t),
                                has_zero=has_zero, delay_all=True),
            wg_axis="wg", num_compute_wgs=wgs,
            max_concurrent_steps=max(2, min(cfg.max_concurrent_steps, steps)),
            compute_context=compute_context,
        )(w_gmem, x_gmem, s_gmem, *([z_gmem] if has_zero else []))

    scratch = [plgpu.SMEM((wgs, _EPILOGUE_ROWS, bm), jnp.float32)]
    if interpret:
        scratch.append(plgpu.SMEM((wgs, wg_rows, K_CHUNK), xs.dtype))
    return launch_kernel(body, xs, packed, cfg, scratch=scratch, interpret=interpret,
                           num_threads=wgs + 1, thread_name="wg")
