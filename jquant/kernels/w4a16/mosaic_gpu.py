"""W4A16 on Hopper with Mosaic GPU: TMA-pipelined weight tiles, int4 decoded into wgmma registers.

``y = x @ W`` is computed transposed, ``yᵀ = W_nk · xᵀ`` ("swap AB", as Marlin/Machete do for small
M): the weight, stored ``[N, K]`` as signed int4 (``code − 8``, K permuted into word order), is
wgmma's A operand, decoded from shared memory straight into registers (a 32-bit word of 8 codes
per thread and row, two codes per ``shr``/``lop3``/``sub.bf16x2``, ``w4a16_mgpu_decode``),
scaled per group, never written back; ``xᵀ`` is the B operand
in shared memory, so M only sets wgmma's N (8 … 256) and even M = 1 uses the tensor cores.
The TMA engine keeps ``max_concurrent_steps`` weight tiles in flight per CTA without spending
registers (Triton pipelines only loads that feed a dot: docs/design/w4a16.md).

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

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jquant.kernels.lowered_once import lowered_once
from jquant.kernels.w4a16.layout import K_CHUNK, PackedW4NK, gather_pad, round_up
from jquant.kernels.w4a16.mosaic_gpu_common import (check_launch, decode_mma_step,
                                                     launch_kernel, load_weight_spans,
                                                     step_specs, weight_row_codes)
from jquant.kernels.w4a16.config import MgpuConfig, default_mgpu_config
from jquant.kernels.w4a16.mosaic_gpu_decode import E2M1_SCALE_EXP
from jquant.kernels.w4a16.mosaic_gpu_epilogue import start_bias_copy, store_final_output
from jquant.kernels.w4a16.mosaic_gpu_ws import w4a16_mgpu_ws


@lowered_once("config", "interpret", "activation")
def w4a16_mgpu(xs: jax.Array, packed: PackedW4NK, *, config: MgpuConfig, bias=None,
               interpret: bool = False, slots=None, activation: str | None = None) -> jax.Array:
    """fp32 ``[split_k, N_pad, M_pad]`` partials of ``(xs @ W)ᵀ`` for ``xs`` ``[M, K_pad]``
    (columns in stored order, see ``gather_pad``), ``M_pad`` = M rounded up to ``block_m``; or,
    with ``config.final_output``, ``xs @ W · global_scale + bias`` itself, ``[M, N]`` (N_pad
    columns where N's rows would break the TMA's 16-byte stride, ``final_output_cols``) in x's
    dtype.
    The rows of the last x tile past M are never read: the TMA copy fills them with zeros
    (so at M = 1 the L2 serves one row of x per step, not ``block_m``). The copy's 8-row tiling
    needs M < 8 or a multiple of 8 (``x_rows``). Likewise ``xs`` may stop at K columns (not
    K_pad) where K is a multiple of 64 (the x tile's swizzle tiling): the copy fills the
    padded columns with zeros (``kernel_x``). ``slots``: MoE experts (``launch_kernel``), with
    ``packed`` and ``bias`` stacked per expert. ``activation``: the weight's rows are a MoE gate/up
    pair in ``gate_up_tiles`` order and the kernel writes ``activation(gate, up)``, ``[M, N / 2]``
    (``store_final_output``; one compute warpgroup, 128-row tiles, N a multiple of 128)."""
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
        lead = packed.data.shape[:-2]   # (E,) for stacked experts
        if bias.shape not in (lead + (packed.n,), lead + (packed.n_pad,)):
            raise ValueError(f"bias has shape {tuple(bias.shape)}; expected {lead + (packed.n,)} or "
                             f"{lead + (packed.n_pad,)} (N or N_pad)")
        if not jnp.issubdtype(bias.dtype, jnp.floating):
            raise TypeError(f"bias must be a float array, got {bias.dtype}")
    if activation is not None and (not cfg.final_output or cfg.compute_wgs != 1 or cfg.block_n != 128
                                   or packed.n % 128):
        raise ValueError(f"an activation in the epilogue needs the final output, one compute warpgroup, "
                         f"block_n=128 and N a multiple of 128; got {cfg} and N={packed.n}")
    m_pad = round_up(xs.shape[0], cfg.block_m)
    k_split = check_launch(packed.n_pad, packed.k_pad, m_pad, packed.group_size, cfg)
    if cfg.compute_wgs > 1:
        if slots is not None:
            raise ValueError("expert slots run with one compute warpgroup (MgpuConfig.compute_wgs=1)")
        return w4a16_mgpu_ws(xs, packed, config=cfg, bias=bias, interpret=interpret)
    bn, bm = cfg.block_n, cfg.block_m
    g = packed.group_size
    steps = k_split // cfg.block_k
    has_zero = packed.zero is not None
    # 8-bit weights without group scales: their scales multiply the sums in the epilogue.
    unit_scales = getattr(packed, "unit_scales", False)

    def body(ni, si, mi, x_gmem, w_gmem, s_gmem, z_gmem, out, *a_scratch):
        def mma(w_smem, x_smem, s_smem, z_smem, acc_ref, **kw):
            kw.setdefault("scaled", not unit_scales)
            decode_mma_step(w_smem, x_smem, s_smem, z_smem[0] if z_smem else None, acc_ref,
                            rows=slice(None), group_size=g, dtype=xs.dtype,
                            lut=packed.lut, word_order=packed.word_order,
                            interpret=interpret, row_codes=weight_row_codes(cfg, packed.lut),
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
            spans = load_weight_spans(w_smem, slice(None), weight_row_codes(cfg, packed.lut),
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
                              has_zero=has_zero, delay_all=False, lut=packed.lut)
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
                               interpret=interpret, activation=activation)
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
    return launch_kernel(body, xs, packed, cfg, scratch=scratch, interpret=interpret, bias=bias,
                         slots=slots, activation=activation)


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
    return m if m < 8 else round_up(m, 8)


def _step_with_acc(step, acc_ref, idx, *refs):
    step(idx, *refs, acc_ref=acc_ref)


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
