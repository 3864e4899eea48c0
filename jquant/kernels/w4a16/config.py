"""The launch of the Mosaic GPU W4A16 kernel (``MgpuConfig``) and the default one for a weight
and M (``default_mgpu_config``), as measured on the H200: docs/design/w4a16.md, "Launch
heuristic", and the table of record ``bench/results/h200/w4a16.md``. Plain Python: choosing a
launch needs no GPU."""

from __future__ import annotations

import dataclasses

from jquant.kernels.w4a16.layout import K_CHUNK, PackedW4NK, round_up


@dataclasses.dataclass(frozen=True)
class MgpuConfig:
    """Launch of the Mosaic GPU W4A16 kernel.

    block_n: weight rows per CTA (wgmma M; 64 per warpgroup instruction).
    block_k: K per pipeline step (a multiple of 64 dividing the per-split K range).
    block_m: activation rows per CTA (wgmma N: a multiple of 8, at most 256).
    split_k: K ranges run by separate CTAs, summed inside a cluster (``final_output``) or
      by XLA afterwards.
    max_concurrent_steps: TMA pipeline depth.
    wide_rows: stage the weight tile in shared memory with 128-byte swizzle rows (256 codes; a
      64-byte swizzle at block_k = 128) instead of one 32-byte row per 64-code chunk, so the TMA
      copy moves 128-byte rows, and load each 256-code span into registers at once.
    compute_wgs: warpgroups that decode and multiply, each owning ``block_n / compute_wgs`` rows
      and sharing the x tile. With 2, a third warpgroup only issues the TMA copies (warp
      specialization); with 1, the one warpgroup does both.
    group_acc: each group's wgmmas go into a fresh fp32 accumulator that is then scaled and
      added to the running sum, instead of scaling every decoded weight in bf16: one FMA per
      output element per group instead of one multiply per pair of codes (1 warpgroup; groups
      that are multiples of 64 and divide ``block_k``).
    final_output: the kernel writes the final ``[M, N]`` output in x's dtype (global scale and
      bias applied), the ``split_k`` partials of a tile summed inside a thread-block cluster
      (``w4a16_mgpu_epilogue``), instead of fp32 partials for XLA to sum (``split_k`` ≤ 8
      with one compute warpgroup, 1 with two).

    Examples:
      >>> from jquant.kernels.w4a16 import MgpuConfig
      >>> config = MgpuConfig(block_n=64, split_k=2)
      >>> config.block_n, config.block_k, config.block_m, config.split_k
      (64, 256, 8, 2)
      >>> MgpuConfig(block_m=0)
      Traceback (most recent call last):
          ...
      ValueError: MgpuConfig.block_m must be a positive int, got 0
    """

    block_n: int = 128
    block_k: int = 256
    block_m: int = 8
    split_k: int = 1
    max_concurrent_steps: int = 4
    wide_rows: bool = False
    compute_wgs: int = 1
    group_acc: bool = False
    final_output: bool = False

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name in ("wide_rows", "group_acc", "final_output"):
                continue
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"MgpuConfig.{f.name} must be a positive int, got {v!r}")


def group_acc_fits(group_size: int, block_k: int, compute_wgs: int) -> bool:
    """Whether ``MgpuConfig.group_acc`` can run: one compute warpgroup and whole groups of a
    multiple of 64 inside each step."""
    return compute_wgs == 1 and group_size % K_CHUNK == 0 and block_k % group_size == 0


def default_mgpu_config(m: int, packed: PackedW4NK) -> MgpuConfig:
    """The launch for ``m`` rows, from the H200 sweeps and A/Bs (docs/design/w4a16.md): decode
    (M ≤ 16) wants narrow 64-row tiles, 256-code steps 4 deep and split-K 2 (many small CTAs
    keep the TMA engines busy); larger M wants 128-row tiles of 128 K (so 3 stages of a 128-row
    x tile fit in shared memory) and split-K 2 only while there are fewer CTAs than ~2 per SM.
    Every default launch writes the final output itself.

    Examples:
      Choosing a launch needs no GPU; here for a small weight (K = 64, N = 8, groups of 32):

      >>> import numpy as np
      >>> from jquant.kernels.w4a16 import default_mgpu_config, prepack_nk
      >>> packed = prepack_nk(np.zeros((64, 8), np.int32), np.ones((2, 8), np.float32), group_size=32)
      >>> decode = default_mgpu_config(4, packed)  # decode: M <= 16
      >>> decode.block_n, decode.block_k, decode.block_m, decode.final_output
      (64, 64, 8, True)
      >>> default_mgpu_config(256, packed).block_m  # larger M: wider x tiles
      128
    """
    block_m = min(round_up(m, 8), 128)
    if block_m >= 64 and packed.n_pad % 256 == 0 and packed.n_pad // 256 >= 100:
        # Two warpgroups × 128 rows share each x tile: half the x traffic from L2, which bounds
        # M ≥ 64 on wide weights (interleaved H200 A/B; docs/design/w4a16.md, "Warp
        # specialization").
        return MgpuConfig(block_n=256, block_k=K_CHUNK, block_m=block_m, split_k=1,
                          max_concurrent_steps=6 if block_m <= 64 else 4, compute_wgs=2,
                          final_output=True)
    if block_m <= 16:
        # Split-K 2 in a cluster, 4 stages, the kernel's own output: one op per call, even with
        # split-K 4 and XLA-summed partials on the large shapes and 2-4 µs faster on the small
        # ones, where a second op costs most (H200 A/B timed past the host's pace).
        bn, bk, stages, split = 64, 256, 4, 2
    elif block_m <= 64:   # 128-row tiles once they still give ~1 CTA per SM (H200 A/B)
        bn, bk, stages, split = (128 if packed.n_pad // 128 >= 132 else 64), 128, 3, 2
    else:
        bn, bk, stages, split = 128, 128, 3, 2
    if packed.n_pad % bn:
        bn = 64
    g = packed.group_size
    while bk > K_CHUNK and (g % bk if g >= bk else bk % g):   # a step meets whole groups
        bk //= 2
    tiles = packed.n_pad // bn * -(-m // block_m)
    # Split-K 1 from ~1.5 tiles per SM, or ~1 of 128 × 128 (H200 A/B, docs/design/w4a16.md:
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
    # the byte floor (H200 copy probe; kernel 5-10 % faster, docs/design/w4a16.md).
    # The kernel's own final output (split-K ≤ 2): one op per call, no fp32 partials (H200
    # A/B: never slower, 1536×576 −2 µs of 20, 8192×28672 M = 64 −8 of 90; likewise at
    # M ≤ 16; docs/design/w4a16.md, "Split-K and epilogue").
    return MgpuConfig(block_n=bn, block_k=bk, block_m=block_m, split_k=split,
                      max_concurrent_steps=stages,
                      group_acc=block_m <= 16 and group_acc_fits(g, bk, 1), wide_rows=True,
                      final_output=True)
