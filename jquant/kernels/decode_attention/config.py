"""Launch configuration of the paged decode-attention kernel (Triton-backend Pallas).

The defaults are what ships: ``jquant bench attention --sweep`` on the H200 (B=8, 32/8 heads, d=128,
ctx 32k, page 16; bench/results/h200/attention_sweep.md) found no launch of block_tokens 64/128/256 ×
4/8 warps × 2-4 stages faster than 128 tokens, 4 warps, 2 stages beyond the cells' noise.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jquant.kernels.triton_launch import check_num_warps, check_power_of_two


@dataclasses.dataclass(frozen=True)
class TuningConfig:
    """How one program walks its share of the context.

    block_tokens: tokens per loop step (a multiple of the page size, at least 16: Triton's dot
      needs 16 on every side).
    num_splits: programs per (sequence, KV head) along the context (split-K); None picks enough to
      fill the chip (``splits_for``).
    num_warps, num_stages: Triton's warps per program and software-pipelining depth.
    kv_heads_per_program: KV heads one program attends together (a power of two dividing the KV
      heads). With more than one, q is block-diagonal over the heads (``heads × group`` rows ×
      ``heads × head_dim`` columns), so the 16-row dot carries several GQA groups instead of
      padding (Llama-3's group of 4: 4 heads fill the 16 rows that now hold 12 rows of zeros),
      each token's heads are read as one contiguous run, and a program has that many times more
      bytes in flight per step. A non-finite K or V value of one head then also reaches the
      sibling heads of its program (NaN in, NaN out: o_proj mixes all heads anyway).
    operand_dtype: "bfloat16" or "float16", what K, V, q and the probabilities are widened to for
      the tensor cores; None: ``operand_dtype_for`` the pages (float16 for FP8 and float16 pages).

    Examples:
      >>> from jquant.kernels.decode_attention import TuningConfig
      >>> config = TuningConfig(block_tokens=64, num_splits=4)
      >>> config.block_tokens, config.num_splits, config.num_warps, config.num_stages
      (64, 4, 4, 2)
      >>> TuningConfig(block_tokens=48)
      Traceback (most recent call last):
          ...
      ValueError: block_tokens must be a power of two ≥ 16, got 48
    """

    block_tokens: int = 128
    num_splits: int | None = None
    num_warps: int = 4
    num_stages: int = 2
    kv_heads_per_program: int = 1
    operand_dtype: str | None = None

    def __post_init__(self):
        check_power_of_two("block_tokens", self.block_tokens, minimum=16)
        if self.num_splits is not None and self.num_splits < 1:
            raise ValueError(f"num_splits must be ≥ 1 or None, got {self.num_splits}")
        check_num_warps(self.num_warps)
        if self.num_stages < 1:
            raise ValueError(f"num_stages must be ≥ 1, got {self.num_stages}")
        h = self.kv_heads_per_program
        if not isinstance(h, int) or h < 1 or h & (h - 1):
            raise ValueError(f"kv_heads_per_program must be a power of two ≥ 1, got {h!r}")
        if self.operand_dtype not in (None, *OPERAND_DTYPES):
            raise ValueError(f"operand_dtype must be None or one of {OPERAND_DTYPES}, got {self.operand_dtype!r}")


OPERAND_DTYPES = ("bfloat16", "float16")
# Pages whose codes widen to float16 exactly and in one instruction per pair: e4m3 and e5m2 codes are
# float16 values, and sm_90 converts a pair in one F2FP where bfloat16 takes a detour through float32
# (a fifth of the fp8 loop's instructions). On the H100, B=8, ctx 32k, that made fp8 pages 2.5-5 %
# faster (bench/results/h100/attention_operands.md). int8 codes keep bfloat16: their integer-to-bfloat16
# conversion is already short, and float16 saves nothing there.
_FLOAT16_PAGES = ("float8_e4m3fn", "float8_e5m2", "float16")


def operand_dtype_for(config: TuningConfig, page_dtype) -> str:
    """What the kernel widens codes and q to: ``config.operand_dtype``, else float16 for FP8 and float16
    pages, bfloat16 for the rest.

    Examples:
      >>> import jax.numpy as jnp
      >>> from jquant.kernels.decode_attention.config import TuningConfig, operand_dtype_for
      >>> operand_dtype_for(TuningConfig(), jnp.float8_e4m3fn), operand_dtype_for(TuningConfig(), jnp.bfloat16)
      ('float16', 'bfloat16')
      >>> operand_dtype_for(TuningConfig(operand_dtype="bfloat16"), jnp.float8_e4m3fn)
      'bfloat16'
    """
    if config.operand_dtype is not None:
        return config.operand_dtype
    return "float16" if np.dtype(page_dtype).name in _FLOAT16_PAGES else "bfloat16"


# sm_90's shared memory per program (227 KB opt-in), as the H100 reports it when a launch asks for more.
SHARED_BYTES = 232448
# Triton's buffers beside the pipelined K/V tiles: 2 KB (bf16 pages) to 24 KB (FP8 pages with per-token
# scales), from the requests of launches that did not fit on the H100 (264192 and 286720 bytes).
SHARED_RESERVE = 24 * 1024


def shared_bytes(config: TuningConfig, head_dim: int, code_bytes: int) -> int:
    """Shared memory a launch takes, estimated: ``num_stages`` K and V tiles of ``block_tokens`` tokens ×
    ``kv_heads_per_program`` heads × ``head_dim`` codes of ``code_bytes``, plus ``SHARED_RESERVE``.

    Examples:
      >>> from jquant.kernels.decode_attention.config import TuningConfig, shared_bytes
      >>> shared_bytes(TuningConfig(), head_dim=128, code_bytes=2)  # 2 stages × 128 tokens × (K + V)
      155648
    """
    tile = config.block_tokens * config.kv_heads_per_program * head_dim * code_bytes
    return config.num_stages * 2 * tile + SHARED_RESERVE


def fit_launch(config: TuningConfig | None, head_dim: int, code_bytes: int, page_size: int) -> TuningConfig:
    """The launch to run: ``config`` if its tiles fit in shared memory (else a ValueError naming the bytes);
    None: the default, its ``block_tokens`` halved (not below 16 or the page) until it fits, then its
    stages (head_dim 256 in bf16 takes 64-token steps).

    Examples:
      >>> from jquant.kernels.decode_attention.config import TuningConfig, fit_launch
      >>> fit_launch(None, head_dim=128, code_bytes=2, page_size=16).block_tokens
      128
      >>> fit_launch(None, head_dim=256, code_bytes=2, page_size=16).block_tokens
      64
      >>> fit_launch(TuningConfig(block_tokens=128, kv_heads_per_program=4), 128, 1, 16)
      Traceback (most recent call last):
          ...
      ValueError: decode attention launch TuningConfig(block_tokens=128, num_splits=None, num_warps=4, num_stages=2, kv_heads_per_program=4, operand_dtype=None) needs ~286720 bytes of shared memory for head_dim 128 and 1-byte codes; sm_90 has 232448: fewer block_tokens, kv_heads_per_program or num_stages
    """
    if config is not None:
        need = shared_bytes(config, head_dim, code_bytes)
        if need > SHARED_BYTES:
            raise ValueError(f"decode attention launch {config} needs ~{need} bytes of shared memory for head_dim "
                             f"{head_dim} and {code_bytes}-byte codes; sm_90 has {SHARED_BYTES}: fewer "
                             "block_tokens, kv_heads_per_program or num_stages")
        return config
    config = TuningConfig()
    while shared_bytes(config, head_dim, code_bytes) > SHARED_BYTES and config.block_tokens > max(16, page_size):
        config = dataclasses.replace(config, block_tokens=config.block_tokens // 2)
    while shared_bytes(config, head_dim, code_bytes) > SHARED_BYTES and config.num_stages > 1:
        config = dataclasses.replace(config, num_stages=config.num_stages - 1)
    return config


# Programs wanted over a call: 132 SMs × 16, so the last wave of programs is small whether 2 or 3 fit
# an SM at once (the fp8 kernel's 198 or 168 registers a thread). With 132 × 4 (the first default: 576
# programs at B = 8, 8 KV heads) 2 or 3 fit an SM, 1.5-2.2 waves, and the last wave idled most of the
# chip: on the H200 (bench/results/h200/attention_sweep.md, B = 8, ctx 32k) 32 splits (2048 programs)
# took 289 µs against the default's 314 for fp8 per token-head, and 64 splits of 64-token steps 567
# against 705 for turboquant_3bit_nc.
TARGET_PROGRAMS = 2112


def splits_for(batch: int, kv_heads: int, max_tokens: int, block_tokens: int) -> int:
    """Split-K factor: enough (sequence, head, split) programs to fill the chip, never a split
    shorter than one loop step."""
    want = -(-TARGET_PROGRAMS // max(batch * kv_heads, 1))
    most = max(1, -(-max_tokens // block_tokens))
    return int(max(1, min(want, most)))


def split_plan(batch: int, kv_heads: int, max_tokens: int, config: TuningConfig) -> tuple[int, int]:
    """(splits, tokens per split): ``config.num_splits`` or ``splits_for``, each split a whole number
    of loop steps and none of them empty of table slots.

    Examples:
      B = 8 sequences × 8 KV heads over 32k tokens: 32 splits of 1024 (2048 programs); one sequence of
      1k tokens: one 128-token step a split.

      >>> from jquant.kernels.decode_attention.config import TuningConfig, split_plan
      >>> split_plan(8, 8, 32768, TuningConfig()), split_plan(1, 8, 1024, TuningConfig())
      ((32, 1024), (8, 128))
    """
    block = config.block_tokens
    splits = config.num_splits or splits_for(batch, kv_heads, max_tokens, block)
    split_tokens = -(-(-(-max_tokens // splits)) // block) * block
    return -(-max_tokens // split_tokens), split_tokens
