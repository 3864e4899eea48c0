"""The final output written by the Mosaic GPU W4A16 kernel itself (``MgpuConfig.final_output``).

Without it the kernel writes fp32 split-K partials ``[split_k, N_pad, M_pad]`` and XLA sums,
transposes, scales and casts them: a second kernel, which at M = 1 costs 3–8 µs of a ~45 µs call
on the H200 (docs/design/w4a16.md, "Split-K and epilogue"). Here the ``split_k`` CTAs of one
output tile form a thread-block cluster; each leaves its fp32 partial in its shared memory, and
after a cluster barrier the leader (split 0) reads its peers' partials through distributed shared
memory, sums them in a fixed order, applies the global and channel scales and bias, and stores the tile
transposed, in x's dtype, straight into the ``[M, N]`` output (the TMA store drops the rows past
M and the columns past N). A second cluster barrier keeps the peers' shared memory alive until the
leader has read it.

(The warp-specialized kernel writes its final output only at split-K 1, with its own
epilogue: ``w4a16_mgpu_ws.store_final_rows``.)

Interpret mode has no distributed shared memory and cannot run the barrier's PTX: there the
partials go through a global-memory workspace (an extra kernel output) and the cluster's
``ClusterBarrier``; the sum, its order and everything after it are the same code.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jquant.kernels.moe.activations import activation_fn

# Largest cluster every sm_90 launch can take (16 needs a non-portable opt-in).
MAX_CLUSTER = 8


@dataclasses.dataclass(frozen=True)
class FinalOutputRefs:
    """The references ``store_final_output`` works with; ``None`` where not used."""

    out_gmem: object                 # [M, N_out] in x's dtype
    out_smem: object                 # [bm, bn] x's dtype: the transposed tile
    part_smem: object = None         # [bn, bm] fp32: this CTA's partial
    global_scale_gmem: object = None  # [1] fp32
    channel_scale_gmem: object = None  # [N_pad] fp32 (8-bit weights' per-channel scales)
    channel_scale_smem: object = None  # [bn]
    channel_scale_barrier: object = None
    bias_gmem: object = None          # [N_out or N_pad] any float
    bias_smem: object = None          # [bn]
    bias_barrier: object = None
    cluster_barrier: object = None   # interpret mode, split_k > 1
    workspace_gmem: object = None    # interpret mode: [split_k, N_pad, M_pad] fp32
    peer_smem: object = None         # interpret mode: [bn, bm] fp32
    peer_barrier: object = None


def final_output_scratch(block_n: int, block_m: int, dtype, bias_dtype, split_k: int,
                         interpret: bool, channel_scale: bool = False, activation: str | None = None) -> dict:
    """Shared-memory scratch for ``FinalOutputRefs``, by field name."""
    out_cols = block_n // 2 if activation else block_n
    scratch = {"part_smem": plgpu.SMEM((block_n, block_m), jnp.float32),
               "out_smem": plgpu.SMEM((block_m, out_cols), dtype)}
    if channel_scale:
        scratch["channel_scale_smem"] = plgpu.SMEM((block_n,), jnp.float32)
        scratch["channel_scale_barrier"] = plgpu.Barrier()
    if bias_dtype is not None:
        scratch["bias_smem"] = plgpu.SMEM((block_n,), bias_dtype)
        scratch["bias_barrier"] = plgpu.Barrier()
    if interpret and split_k > 1:
        scratch["cluster_barrier"] = plgpu.ClusterBarrier(collective_axes=("s",))
        scratch["peer_smem"] = plgpu.SMEM((block_n, block_m), jnp.float32)
        scratch["peer_barrier"] = plgpu.Barrier()
    return scratch


def start_bias_copy(refs: FinalOutputRefs, ni, si, block_n: int):
    """Issues the copies of the tile's bias and channel scales at kernel start in the CTA that
    writes the tile (split 0), so its epilogue finds them there."""
    for gmem, smem, barrier in ((refs.bias_gmem, refs.bias_smem, refs.bias_barrier),
                                (refs.channel_scale_gmem, refs.channel_scale_smem,
                                 refs.channel_scale_barrier)):
        if gmem is not None:
            @pl.when(si == 0)
            def _(gmem=gmem, smem=smem, barrier=barrier):
                plgpu.copy_gmem_to_smem(gmem.at[pl.ds(ni * block_n, block_n)], smem, barrier)


def store_final_output(acc, refs: FinalOutputRefs, *, ni, si, mi, split_k: int,
                       interpret: bool, activation: str | None = None):
    """Sums the cluster's partials of the ``[bn, bm]`` tile (``acc``: this CTA's, in the WGMMA
    layout) and writes ``(Σ acc · global_scale + bias)ᵀ`` in the output's dtype (split 0 only).

    ``activation`` (a MoE gate/up product, ``jquant.kernels.moe.activations``): the tile's first
    ``bn / 2`` rows are gate features and the last ``bn / 2`` the up features of the same outputs
    (``gate_up_tiles``); the sum is rounded to the output's dtype, the bias added in fp32, and the
    ``[bm, bn / 2]`` activation written at output column ``ni · bn / 2``: the layer's own rounding
    steps (``MoE``: the GEMM's output, then bias and activation in fp32, rounded once)."""
    bn, bm = acc.shape
    if split_k > 1:
        refs.part_smem[...] = acc
        if interpret:
            tile = (pl.ds(ni * bn, bn), pl.ds(mi * bm, bm))
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(refs.part_smem, refs.workspace_gmem.at[(si, *tile)])
            plgpu.wait_smem_to_gmem(0)
        _cluster_sync(refs, interpret)

    @pl.when(si == 0)
    def _leader():
        total = acc
        if split_k > 1:   # every split's partial, its own included, in one fixed order
            total = _peer_partial(refs, 0, ni, mi, bn, bm, interpret)
            for j in range(1, split_k):
                total = total + _peer_partial(refs, j, ni, mi, bn, bm, interpret)
        if refs.global_scale_gmem is not None:
            total = total * refs.global_scale_gmem[0]
        if refs.channel_scale_gmem is not None:
            plgpu.barrier_wait(refs.channel_scale_barrier)
            cs = plgpu.load(refs.channel_scale_smem, layout=plgpu.Layout.WGMMA.reduce(1))
            total = total * jax.lax.broadcast_in_dim(cs, (bn, bm), (0,))
        if activation is not None:
            total = total.astype(refs.out_smem.dtype).astype(jnp.float32)
        if refs.bias_gmem is not None:
            plgpu.barrier_wait(refs.bias_barrier)
            bias = plgpu.load(refs.bias_smem, layout=plgpu.Layout.WGMMA.reduce(1))
            total = total + jax.lax.broadcast_in_dim(bias.astype(jnp.float32), (bn, bm), (0,))
        out_n = bn
        if activation is not None:
            out_n = bn // 2
            total = activation_fn(activation)(total[:out_n], total[out_n:])
        refs.out_smem.transpose((1, 0))[...] = total.astype(refs.out_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(refs.out_smem,
                                refs.out_gmem.at[pl.ds(mi * bm, bm), pl.ds(ni * out_n, out_n)])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    if split_k > 1:
        # The peers' shared memory must outlive the leader's reads.
        _cluster_sync(refs, interpret)


def _peer_partial(refs: FinalOutputRefs, j: int, ni, mi, bn: int, bm: int, interpret: bool):
    """The partial of split ``j``: from its CTA's shared memory, or (interpret) the workspace."""
    if not interpret:
        return plgpu.load(plgpu.cluster_ref(refs.part_smem, {"s": j}),
                          layout=plgpu.Layout.WGMMA)
    plgpu.copy_gmem_to_smem(
        refs.workspace_gmem.at[j, pl.ds(ni * bn, bn), pl.ds(mi * bm, bm)], refs.peer_smem,
        refs.peer_barrier)
    plgpu.barrier_wait(refs.peer_barrier)
    return plgpu.load(refs.peer_smem, layout=plgpu.Layout.WGMMA)


def _cluster_sync(refs: FinalOutputRefs, interpret: bool):
    """Every CTA of the cluster waits for all; shared-memory writes before it are visible to
    the cluster after it (``barrier.cluster`` arrives with release and waits with acquire)."""
    if interpret:
        plgpu.barrier_arrive(refs.cluster_barrier)
        plgpu.barrier_wait(refs.cluster_barrier)
        return

    from jax.experimental.mosaic.gpu import utils as mgpu_utils

    @plgpu.inline_mgpu()
    def sync(_):
        mgpu_utils.inline_ptx("barrier.cluster.arrive.aligned;\n\tbarrier.cluster.wait.aligned;",
                              has_side_effects=True)

    sync()
