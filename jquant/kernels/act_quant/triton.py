"""Dynamic e4m3 activation quantization, one scale per token or per 1 × G group, as one Triton-backend
Pallas kernel: x is read once and codes and scales written once.

Grid (row block, group). A program loads ``block_rows`` rows of one group (the whole row per token) into
registers, takes each row's max |x| and writes ``sat(x / s)`` as e4m3 and ``s``. It mirrors
``jquant.formats.fp8.quantize_fp8_per_token`` / ``quantize_fp8_per_token_group`` as XLA computes them, so
codes and scales are bit-identical: both divisions are correctly rounded (``ieee_divide``: PTX's
``div.rn.f32``, as vLLM's CUDA kernels divide), NaN is carried through the max as XLA's max carries it.

Why not XLA: its division on the GPU is ``div.full.f32`` (2 ulp), and the integer correction that
``exact_divide`` adds makes that fusion ALU-bound: the per-token W8A8 FP8 GEMM at 8192², activation
quantization included, went from 507.9 to 558.7 µs at M = 4096 with it (H100,
bench/results/h100/gemm8_exact_division*.md).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jquant.formats import fp8
from jquant.kernels.lowered_once import lowered_once
from jquant.kernels.triton_exact import clip_keep_nan, ieee_divide, max_keep_nan, row_abs_max
from jquant.kernels.triton_launch import check_num_warps, check_power_of_two

# The formats' constants: per token max(amax / 448, 1 / (448 · 512)) (vLLM), per group max(amax, 1e-10) / 448.
E4M3_MAX = fp8.fp8_max("fp8_e4m3")
TOKEN_MIN_SCALE = np.float32(fp8.dynamic_min_scale("fp8_e4m3"))
GROUP_AMAX_EPS = np.float32(fp8.GROUP_AMAX_EPS)
# Elements a program holds by default (≈ 32 float32 registers a thread at 8 warps).
TILE_ELEMENTS = 8192


@dataclasses.dataclass(frozen=True)
class ActQuantConfig:
    """block_rows: rows per program (a power of two); num_warps: Triton's warps per program.

    Examples:
      >>> from jquant.kernels.act_quant import ActQuantConfig
      >>> ActQuantConfig(block_rows=4, num_warps=8)
      ActQuantConfig(block_rows=4, num_warps=8)
      >>> ActQuantConfig(block_rows=3)
      Traceback (most recent call last):
          ...
      ValueError: block_rows must be a power of two, got 3
    """

    block_rows: int = 1
    num_warps: int = 4

    def __post_init__(self):
        check_power_of_two("block_rows", self.block_rows)
        check_num_warps(self.num_warps)


def default_config(rows: int, group: int) -> ActQuantConfig:
    """About ``TILE_ELEMENTS`` values a program: several rows of a narrow group, one row of a wide one."""
    from jax.experimental import pallas as pl

    width = pl.next_power_of_2(group)
    block_rows = max(1, min(TILE_ELEMENTS // width, pl.next_power_of_2(rows)))
    elements = block_rows * width
    return ActQuantConfig(block_rows=block_rows,
                          num_warps=16 if elements >= 4 * TILE_ELEMENTS else 8 if elements >= 2048 else 4)


def _kernel(x_ref, codes_ref, scale_ref, *, rows: int, k: int, group: int, width: int, block_rows: int,
            per_group: bool, ue8m0: bool, interpret: bool):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plt

    blk, g = pl.program_id(0), pl.program_id(1)
    row = blk * block_rows + lax.iota(jnp.int32, block_rows)
    live = row < rows
    src = jnp.minimum(row, rows - 1)          # rows past the end re-read the last one and store nothing:
    dst = jnp.where(live, row, rows)          # their stores point past the end (interpret mode drops them)
    lane = lax.iota(jnp.int32, width)
    shape = (block_rows, width)
    r = jnp.broadcast_to(src[:, None], shape)
    c = jnp.broadcast_to((g * group + lane)[None, :], shape)
    in_group = jnp.broadcast_to((lane < group)[None, :], shape)
    x = plt.load(x_ref.at[r, c], mask=in_group, other=0).astype(jnp.float32)
    amax = row_abs_max(x)                     # masked lanes read 0: no effect on the max
    if per_group:
        s = ieee_divide(max_keep_nan(amax, GROUP_AMAX_EPS), np.float32(E4M3_MAX), interpret)
        if ue8m0:
            s = fp8.round_scale_up_to_pow2(max_keep_nan(s, GROUP_AMAX_EPS))
    else:
        s = max_keep_nan(ieee_divide(amax, np.float32(E4M3_MAX), interpret), TOKEN_MIN_SCALE)
    codes = clip_keep_nan(ieee_divide(x, s[:, None], interpret), -E4M3_MAX, E4M3_MAX)
    plt.store(codes_ref.at[jnp.broadcast_to(dst[:, None], shape), c], codes.astype(codes_ref.dtype),
              mask=in_group & jnp.broadcast_to(live[:, None], shape))
    plt.store(scale_ref.at[dst * (k // group) + g], s, mask=live)


@lowered_once("group", "per_group", "ue8m0", "config", "interpret")
def quantize(x, group: int, *, per_group: bool, ue8m0: bool, config: ActQuantConfig, interpret: bool):
    """Codes ``[M, K]`` float8_e4m3fn and float32 scales ``[M, K / group]`` of a 2-D x (bf16, fp16 or
    float32) whose K ``group`` divides."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plt

    rows, k = x.shape
    width = pl.next_power_of_2(group)
    kernel = functools.partial(_kernel, rows=rows, k=k, group=group, width=width,
                               block_rows=config.block_rows, per_group=per_group, ue8m0=ue8m0,
                               interpret=interpret)
    whole = lambda shape: pl.BlockSpec(shape, lambda i, g, n=len(shape): (0,) * n)
    codes, scale = pl.pallas_call(
        kernel, grid=(pl.cdiv(rows, config.block_rows), k // group), in_specs=[whole(x.shape)],
        out_specs=[whole((rows, k)), whole((rows * (k // group),))],
        out_shape=[jax.ShapeDtypeStruct((rows, k), jnp.float8_e4m3fn),
                   jax.ShapeDtypeStruct((rows * (k // group),), jnp.float32)],
        interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=config.num_warps, num_stages=1),
        name="jquant_act_quant_fp8_" + ("group" if per_group else "token"),
    )(x)
    return codes, scale.reshape(rows, k // group)
