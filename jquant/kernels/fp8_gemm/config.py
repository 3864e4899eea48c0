"""The launch of the Mosaic GPU FP8 GEMM (``Fp8GemmConfig``) and the default one for a problem
(``default_fp8_config``). Plain Python: choosing a launch needs no GPU."""

from __future__ import annotations

import dataclasses

# K per pipeline step: one 128-byte swizzle row of e4m3 codes, and DeepSeek's scale block.
BLOCK_K = 128


@dataclasses.dataclass(frozen=True)
class Fp8GemmConfig:
    """Launch of the FP8 GEMM ``acc[i, j] = Σ_k a[i, k] · b[j, k]`` (both operands K-major e4m3).

    swap_ab: A is the weight (its rows are N) and B the activations (rows M), as the W4A16 kernel
      does for small M, so M is only wgmma's N dimension (≥ 8); else A is x and B the weight.
    block_a: A rows per CTA (a multiple of 64: wgmma's M).
    block_b: B rows per CTA (wgmma's N: a multiple of 8, at most 256).
    max_concurrent_steps: TMA pipeline depth (each step moves ``BLOCK_K`` of K).
    compute_wgs: 1, or 2 compute warpgroups each owning ``block_a`` rows of a ``2 · block_a``-row x tile
      plus a copy-issuing warpgroup (x as A; ``mosaic_gpu_ws``).
    grid_tile_width: 0 (the CTA grid in row-major order of its tiles), or with two compute warpgroups
      the number of x tiles a strip of the grid spans, walked in ``plgpu.planar_snake`` order: the CTAs
      resident at once then read a few x tiles and weight tiles that fit in L2, not all of x.
    persistent_ctas: 0 (a CTA per output tile), or with two compute warpgroups that many CTAs (the
      SMs: 132 on the H100 and H200), each looping over tiles with its pipeline allocated once, so the
      copy warpgroup loads a tile's first K steps while the compute ones store the last tile.

    Examples:
      >>> from jquant.kernels.fp8_gemm import Fp8GemmConfig
      >>> Fp8GemmConfig(swap_ab=True, block_a=64, block_b=8)
      Fp8GemmConfig(swap_ab=True, block_a=64, block_b=8, max_concurrent_steps=4, compute_wgs=1, grid_tile_width=0, persistent_ctas=0)
      >>> Fp8GemmConfig(swap_ab=False, block_a=64, block_b=128, compute_wgs=2).x_rows
      128
      >>> Fp8GemmConfig(swap_ab=False, block_a=96, block_b=128)
      Traceback (most recent call last):
          ...
      ValueError: Fp8GemmConfig.block_a must be a positive multiple of 64, got 96
    """

    swap_ab: bool
    block_a: int
    block_b: int
    max_concurrent_steps: int = 4
    compute_wgs: int = 1
    grid_tile_width: int = 0
    persistent_ctas: int = 0

    def __post_init__(self):
        if self.compute_wgs not in (1, 2) or self.compute_wgs == 2 and self.swap_ab:
            raise ValueError(f"Fp8GemmConfig.compute_wgs must be 1, or 2 with x as A (swap_ab=False), got "
                             f"{self.compute_wgs!r}")
        if not isinstance(self.block_a, int) or self.block_a < 64 or self.block_a % 64:
            raise ValueError(f"Fp8GemmConfig.block_a must be a positive multiple of 64, got {self.block_a!r}")
        if not isinstance(self.block_b, int) or not 8 <= self.block_b <= 256 or self.block_b % 8:
            raise ValueError(f"Fp8GemmConfig.block_b must be a multiple of 8 in [8, 256], got {self.block_b!r}")
        if not isinstance(self.grid_tile_width, int) or self.grid_tile_width < 0 or (
                self.grid_tile_width and self.compute_wgs == 1):
            raise ValueError(f"Fp8GemmConfig.grid_tile_width must be 0, or ≥ 1 with two compute warpgroups, got "
                             f"{self.grid_tile_width!r}")
        if not isinstance(self.persistent_ctas, int) or self.persistent_ctas < 0 or (
                self.persistent_ctas and self.compute_wgs == 1):
            raise ValueError(f"Fp8GemmConfig.persistent_ctas must be 0, or ≥ 1 with two compute warpgroups, got "
                             f"{self.persistent_ctas!r}")
        if not isinstance(self.max_concurrent_steps, int) or self.max_concurrent_steps < 2:
            raise ValueError(f"Fp8GemmConfig.max_concurrent_steps must be ≥ 2, got {self.max_concurrent_steps!r}")

    @property
    def x_rows(self) -> int:
        """Rows of x a CTA takes: ``block_b`` under swap AB, else ``block_a`` per compute warpgroup (a MoE
        expert slot's height)."""
        return self.block_b if self.swap_ab else self.block_a * self.compute_wgs


# Fewest x rows of a tile whose per-K-step scale row (fp32) one TMA copy can land: each pipeline
# stage's smem slot must start 128-byte aligned, and 8- or 16-row slots (32, 64 bytes) faulted with a
# misaligned address on the H200.
MIN_SCALE_ROWS = 32


def default_fp8_config(m: int, n_pad: int, blocked: bool = False, out_bytes: int = 2,
                       num_sms: int = 0) -> Fp8GemmConfig:
    """A launch for ``m`` rows of x, a weight of ``n_pad`` rows (a multiple of 256) and an output of
    ``out_bytes`` per value: swap AB up to 64 rows (the weight's bytes bound the step, as in the W4A16
    kernel; with block scales at least ``MIN_SCALE_ROWS`` x rows); above, 128 × 128 tiles 4 deep,
    whose fp32 accumulator takes 128 of a thread's 255 registers. From M = 256 two compute
    warpgroups share each weight tile beside a copy-issuing one: 64 × 256 each, 3 deep (208 KB of
    shared memory) with one K block; with block scales (``blocked``, from M = 128 on one warpgroup)
    64 × 128 each, since the promoted sum is a second accumulator, so one promotes while the other's
    wgmmas run. Both walk a snake grid in strips of 8 x tiles; block scales also on ``num_sms``
    persistent CTAs (the device's SMs, ``dispatch.sm_count``; 0: a CTA per tile). On the H100
    (bench/results/h100/gemm8_fp8_sweep*.md) the block launch took 1925 µs at 8192³ against 2913 with
    one warpgroup and 2049 in grid order, and persistent 944 against 1025 at M = 4096 (5-14 % on the
    DeepSeek-V3 shapes); with one K block the snake grid took 417 µs against 725 at 1024 × 28672 ×
    8192, and 64 × 256 took 1277 µs against 1363 for 128 × 128 at 8192³. An fp32 output
    (``out_bytes=4``) takes x as A with one warpgroup: its transposed store does not lower and its
    tiles overflow the two-warpgroup launch's shared memory.

    Examples:
      >>> from jquant.kernels.fp8_gemm import default_fp8_config
      >>> default_fp8_config(1, 4096)
      Fp8GemmConfig(swap_ab=True, block_a=64, block_b=8, max_concurrent_steps=4, compute_wgs=1, grid_tile_width=0, persistent_ctas=0)
      >>> default_fp8_config(1, 4096, blocked=True).block_b
      32
      >>> default_fp8_config(128, 4096)
      Fp8GemmConfig(swap_ab=False, block_a=128, block_b=128, max_concurrent_steps=4, compute_wgs=1, grid_tile_width=0, persistent_ctas=0)
      >>> default_fp8_config(4096, 4096)
      Fp8GemmConfig(swap_ab=False, block_a=64, block_b=256, max_concurrent_steps=3, compute_wgs=2, grid_tile_width=8, persistent_ctas=0)
      >>> default_fp8_config(4096, 4096, out_bytes=4).compute_wgs
      1
      >>> default_fp8_config(4096, 4096, blocked=True, num_sms=132)
      Fp8GemmConfig(swap_ab=False, block_a=64, block_b=128, max_concurrent_steps=4, compute_wgs=2, grid_tile_width=8, persistent_ctas=132)
    """
    del n_pad   # a multiple of 256: every block_b here divides it
    if out_bytes == 4:
        return Fp8GemmConfig(swap_ab=False, block_a=64 if blocked or m <= 64 else 128, block_b=128,
                             max_concurrent_steps=4)
    if m <= 64:
        rows = max(MIN_SCALE_ROWS if blocked else 8, -(-m // 8) * 8)
        return Fp8GemmConfig(swap_ab=True, block_a=64, block_b=rows, max_concurrent_steps=4)
    if blocked:
        if m >= 256:   # the kernel launches at most one persistent CTA a tile
            return Fp8GemmConfig(swap_ab=False, block_a=64, block_b=128, max_concurrent_steps=4, compute_wgs=2,
                                 grid_tile_width=8, persistent_ctas=num_sms)
        return Fp8GemmConfig(swap_ab=False, block_a=64, block_b=128, max_concurrent_steps=4)
    if m >= 256:
        return Fp8GemmConfig(swap_ab=False, block_a=64, block_b=256, max_concurrent_steps=3, compute_wgs=2,
                             grid_tile_width=8)
    return Fp8GemmConfig(swap_ab=False, block_a=128, block_b=128, max_concurrent_steps=4)
