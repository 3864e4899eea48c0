"""The one place that reads the accelerator (platform, device kind, CUDA compute capability) and
decides which implementation runs, by architecture and, for the 4-bit GEMM, by the rows M of x.

Policy per architecture:

* Hopper (sm_90, capability 9.0): the Mosaic GPU wgmma kernels run the 4-bit weight-only GEMM
  (``w4a16_impl``: up to ``MGPU_MAX_M`` rows, ``MGPU_MAX_M_SMALL_WEIGHT`` for weights under
  8192×8192; XLA above); the Triton-backend Pallas kernels run decode attention.
* Other CUDA GPUs of capability 8.0 and up (Ampere sm_80/86, Ada sm_89, Blackwell sm_100/sm_120):
  no wgmma (an sm_90a instruction; Blackwell has tcgen05 instead), so XLA runs the 4-bit GEMM;
  the Triton-backend Pallas kernels run decode attention (Triton's bf16 dot needs sm_80's mma).
* CUDA GPUs below 8.0: XLA for everything.
  The 8-bit weight-only GEMM (``w8a16_impl``) runs the same pipeline with 8-bit tiles up to
  ``W8A16_MGPU_MAX_M`` rows on Hopper, the Triton-backend 8-bit GEMV at one row (``GEMV_MAX_M``);
  MoE experts, laid out by ``prepare_experts``, the grouped W4A16 kernel (4-bit weight-only) or the
  grouped FP8 GEMM (W8A8 FP8) (``moe_experts_impl``).
* Every GPU: W8A8 FP8 schemes use XLA's native FP8 dot (``native_fp8_dot``; block scales: one
  batched FP8 dot per K group); on Hopper they lay their weights out for the Mosaic GPU FP8 GEMM,
  which runs block scales from ``FP8_BLOCK_MGPU_MIN_M`` rows, per-token scales at every M past the
  GEMV's and per-tensor ones up to ``FP8_GEMM_MGPU_MAX_M`` rows and from ``FP8_GEMM_MGPU_MIN_LARGE_M``
  (``fp8_gemm_impl``), XLA's FP8 dot on that layout otherwise.
* CPU and other platforms: XLA; the 4-bit GEMM's "auto" runs the fp32 reference there (``cc == 0``),
  and a Pallas kernel runs only when asked for in interpret mode.

Functions take an optional device (default: ``jax.devices()[0]``); anything with ``platform``,
``device_kind`` and ``compute_capability`` attributes will do, so the policy is testable without
the hardware.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

# Above these M, the 4-bit GEMM's "auto" runs XLA: the kernel decodes W once per 128 rows of x. On
# the H200 it beat XLA dequant + dot up to M = 1024 for weights of 8192×8192 and up (917 vs 1371 µs
# at 28672×8192) but not for 4096×4096 (131 vs 104 µs) or SmolLM2's 1536×576 past M = 128
# (docs/design/w4a16.md, "Launch heuristic").
MGPU_MAX_M = 1024
MGPU_MAX_M_SMALL_WEIGHT = 128
MGPU_LARGE_WEIGHT = 8192 * 8192

# The W8A16 kernel runs by default up to this M on Hopper: on the H200 it beat XLA's dequantize +
# dot of the same weight at every M timed from 1 to 1024 (28672×8192: 71 vs 415 µs at M = 1, 924 vs
# 1025 µs at M = 1024) and lost at M = 8192 (8192³: 2886 vs 1700 µs; bench/results/h200/gemm8.md);
# M between 1024 and 8192 has not been timed.
W8A16_MGPU_MAX_M = 1024
# ... and the 8-bit GEMV (``jquant.kernels.gemv8``, Triton backend) runs up to this many rows, before the
# W8A16 kernel; also one-K-block W8A8 FP8 (``fp8_gemm_impl``). On the H100 at M = 1
# (bench/results/h100/gemm8_gemv_sweep.md; medians of spreads up to ±50 % below 50 µs) int8 per channel
# took 93.8 / 33.3 / 20.6 µs at 28672×8192 / 8192² / 6144×4096 against the W8A16 kernel's 94.8 / 38.1 /
# 26.8; W8A8 FP8 per token × channel, quantizing x included, 92.2-95.0 / 38.9 / 32.3-34.9 against the FP8
# GEMM's 95.0 / 50.1 / 42.0. From M = 2 it lost everywhere (133-560 µs against 94 at 28672×8192: each row
# of x takes its own fp32 tile of registers). Block FP8 stays on XLA's path at M = 1 (96.7 µs against the
# GEMV's 106.3 at 28672×8192: a reduction every 128 codes).
GEMV_MAX_M = 1
# ... for weights without group scales or with groups of at least this many codes along K: MXFP8's groups of
# 32 took 464.7 µs on the GEMV against the W8A16 kernel's 102.3 (H100, 28672×8192, M = 1, gemm8 run of
# commit 1fbfc90; block FP8's 128 took 108.2 against 101.7 in gemm8_gemv_sweep.md).
GEMV_MIN_GROUP = 128
# The FP8 W8A8 GEMM kernel with one K block (per-token × per-channel or per-tensor scales) runs up to
# this many rows, XLA's FP8 dot above: on the H100 the kernel took 43.0-46.3 µs at M = 2, 4, 8 on
# 8192×8192 against 43.4-62.0 (57.9 against 76.8 at M = 1), and 99.3-109.9 µs at M = 1-16 on
# 28672×8192 against 106.3-114.8; XLA's dot won at M = 32 and 256 on 8192×8192 (51.5 against 56.9,
# 74.8 against 81.1) (bench/results/h100/gemm8*.md). On the H200 XLA's FP8 dot reaches 1090 TFLOP/s
# at 1024×28672×8192 (docs/design/gemm8.md).
FP8_GEMM_MGPU_MAX_M = 16
# ... and again from this many rows: on the H100 (bench/results/h100/gemm8_fp8_dispatch.md,
# gemm8_28672_sweep.md) its two-warpgroup 64 × 256 launch on the snake grid took, per token × channel /
# per tensor, 124.3 / 134.3 µs at 1024 × 8192² against XLA's FP8 dot's 175.6 / 148.1, 392.2 / 403.9 at
# 1024 × 28672 × 8192 against 505.9 / 441.4 and 492.8 / 506.0 at 4096 × 8192² against 624.5 / 534.3
# (1116 against 880 TFLOP/s per token); at M = 256 it tied or lost on 8192² (60.0 / 65.3 against 59.9 /
# 60.4) and won on 28672 × 8192 (131.5 / 132.9 against 157.6 / 138.8). XLA's dot stays from 17 to 1023
# for per-tensor activation scales.
FP8_GEMM_MGPU_MIN_LARGE_M = 1024
# Per-token activation scales (× per-channel or per-tensor weight scales) take the kernel at every M past
# the GEMV's, with no XLA window: on the H100 with the activation pass (bench/results/h100/
# gemm8_mid_m.md, gemm8_act_quant_small_m.md) the kernel took 37.5 / 38.7 / 42.0 µs at M = 32 / 64 / 128
# on 8192² against XLA's FP8 dot's 46.5 / 46.4 / 46.1, and 93.2 / 101.6 / 101.7 on 28672 × 8192 against
# 102.6 / 112.1 / 126.9; at M = 256 on 8192² they tied (55.1 against 54.9). Per-tensor scales keep the
# window: there XLA's dot won on 8192² (48.2 / 46.6 / 46.6 against 52.2 / 52.8 / 53.7).
FP8_GEMM_MGPU_PER_TOKEN_EVERY_M = True
# Block FP8 (DeepSeek's 128 × 128 weight blocks) runs the kernel from this many rows: on the H100 it was
# as fast as or faster than XLA's path (one FP8 dot per K group) at every M from 2 to 8192 measured on
# 8192×8192, 28672×8192 and the four DeepSeek-V3 shapes (1.08-1.34× at M = 2-8, 1.8× at 16, 2.2-2.6×
# at 32, 1.18-6× from 64), and ~10 % slower at M = 1 (bench/results/h100/gemm8*.md).
FP8_BLOCK_MGPU_MIN_M = 2

# 4-bit MoE experts run the grouped W4A16 kernel on Hopper once laid out (``prepare_experts``): on the
# H200 the gpt-oss-20b layer took 609 / 533 / 13198 µs at 1 / 64 / 4096 tokens against 2858 / 3387 /
# 37413 µs dequantizing the experts into ragged_dot (bench/results/h200/moe.md).
MOE_W4A16_MGPU = True
# A MoE layer's gate/up stack (``gate_up_proj``, 2I rows with I a multiple of 64) is laid out for the
# grouped W4A16 kernel to apply the bias and activation in its epilogue, so the [rows, 2I] product is
# never written (``prepare_experts``): on the H100 the gpt-oss-20b MXFP4 layer took 199.5 against
# 212.6 µs of GPU time a call at 8 tokens and 4014 against 4047 µs at 4096 (bench/results/h100/
# moe_slots_profile.md, moe_slots.md).
MOE_W4A16_ACTIVATION_IN_EPILOGUE = True
# W8A8 FP8 experts run the grouped FP8 GEMM on Hopper once laid out. XLA's path dequantizes the whole
# stack to float32 on every call: at DeepSeek-V3's 256 experts (7168 x 2048) that is a 28 GiB buffer,
# out of memory on an 80 GB H100, where the grouped kernel ran the layer in 4.9 ms at 64 tokens and
# 11.7 ms at 4096 (bench/results/h100/moe.md).
MOE_FP8_MGPU = True
# Dynamic e4m3 activations (per token, per 1 × 128 group) of the W8A8 FP8 GEMMs are quantized by the
# Triton-backend pass (``jquant.kernels.act_quant``) from this many rows, by XLA below. On the H100 the
# pass won at every M timed: 4096 × 8192 alone in 63 µs against XLA's 142 (bench/results/h100/
# act_quant.md); per-token GEMMs on 8192² at M = 16 / 64 / 256 / 1024 / 4096 / 8192 took 34.1 / 40.4 /
# 54.9 / 119.2 / 461.9 / 980.2 µs against 36.8 / 43.4 / 63.5 / 144.8 / 559.4 / 1117.8 with XLA's
# quantization, and a decode step (8 layers, B = 1 / 16) 1067.5 / 1479.9 against 1082.1 / 1522.6 µs
# (gemm8_act_quant*.md, decode_act_quant*.md).
ACT_QUANT_KERNEL_MIN_ROWS = 1
# Triton casts float32 to float8_e4m3fn from sm_89 (Ada, Hopper) on; e5m2 casts need no minimum.
E4M3_CAST_MIN_CAPABILITY = 89

TRITON_MIN_CAPABILITY = 80


def _device(device=None):
    return device if device is not None else jax.devices()[0]


@functools.cache
def compute_capability(device: jax.Device | None = None) -> int:
    """CUDA compute capability as an int (90 for sm_90), or 0 for CPU and other platforms."""
    device = _device(device)
    if device.platform != "gpu":
        return 0
    cc = getattr(device, "compute_capability", None)
    if not cc:
        return 0
    major, _, minor = str(cc).partition(".")
    if not (major.isdigit() and (minor or "0").isdigit()):
        return 0  # not a CUDA capability (a ROCm gfx name): no CUDA kernel runs
    return int(major) * 10 + int(minor or 0)


def sm_count(device: jax.Device | None = None) -> int:
    """The GPU's streaming multiprocessors (132 on the H100 SXM and the H200), or 0 where unknown."""
    device = _device(device)
    return int(getattr(device, "core_count", 0) or 0) if device.platform == "gpu" else 0


def platform(device: jax.Device | None = None) -> str:
    """``"gpu"``, ``"cpu"``, ``"tpu"``, ..."""
    return _device(device).platform


def device_kind(device: jax.Device | None = None) -> str:
    """The vendor's model name (``"NVIDIA H200"``, ``"cpu"``)."""
    return str(getattr(_device(device), "device_kind", ""))


def device_name(device: jax.Device | None = None) -> str:
    """``"{platform}:{device_kind}"``, e.g. ``"gpu:NVIDIA H200"``: how benchmarks label results."""
    return f"{platform(device)}:{device_kind(device)}"


def is_gpu(device: jax.Device | None = None) -> bool:
    return platform(device) == "gpu"


def is_cpu(device: jax.Device | None = None) -> bool:
    return platform(device) == "cpu"


def has_wgmma(capability: int) -> bool:
    """Whether a device of this capability runs the Mosaic GPU wgmma kernels: sm_90 (Hopper) only.

    wgmma is an sm_90a instruction; Blackwell (sm_100, sm_120) has none, so those run the XLA path.
    """
    return capability // 10 == 9


def runs_mosaic_gpu(device: jax.Device | None = None) -> bool:
    """Whether the Mosaic GPU (wgmma) kernels run on ``device``."""
    return is_gpu(device) and has_wgmma(compute_capability(device))


def runs_triton_pallas(device: jax.Device | None = None) -> bool:
    """Whether the Triton-backend Pallas kernels run on ``device``: a CUDA GPU of capability ≥ 8.0."""
    return is_gpu(device) and compute_capability(device) >= TRITON_MIN_CAPABILITY


def native_fp8_dot(device: jax.Device | None = None) -> bool:
    """Whether W8A8 FP8 schemes feed FP8 codes to XLA's dot (any GPU) instead of dequantizing first."""
    return is_gpu(device)


def decode_attention_impl(device: jax.Device | None = None, query_dtype=jnp.bfloat16) -> str:
    """``"pallas"`` (the Triton-backend kernel) or ``"xla"``: where the kernel would run interpreted,
    and for a float32 query. The kernel's tensor-core operands are 16-bit: it would round a float32
    query and its probabilities to 8 mantissa bits, 2-4e-3 relative per layer (CPU, interpreted),
    which a 5-layer random network amplified to logits 0.05-2 apart from the float32 prefill
    (tests/models/test_llama_paged.py on the H100, and interpreted on CPU)."""
    return "pallas" if runs_triton_pallas(device) and jnp.dtype(query_dtype).itemsize <= 2 else "xla"


def w4a16_impl(m: int, capability: int, weight_elems: int = MGPU_LARGE_WEIGHT) -> str:
    """The 4-bit weight-only GEMM's "auto" choice for ``m`` rows of x on a device of ``capability``
    (``compute_capability``) and a weight of ``weight_elems`` = N·K values: ``"mgpu"``, ``"xla"`` or,
    off CUDA GPUs, ``"reference"``."""
    if capability == 0:
        return w4a16_fallback(capability)
    max_m = MGPU_MAX_M if weight_elems >= MGPU_LARGE_WEIGHT else MGPU_MAX_M_SMALL_WEIGHT
    return "mgpu" if has_wgmma(capability) and m <= max_m else "xla"


def w4a16_fallback(capability: int) -> str:
    """What runs the 4-bit GEMM where the kernel cannot: the fp32 reference off CUDA GPUs, XLA's
    dequantize + dot on them."""
    return "reference" if capability == 0 else "xla"


def w8a16_impl(m: int, capability: int, group_size: int | None = None) -> str:
    """The 8-bit weight-only GEMM's "auto" choice for ``m`` rows of x: on Hopper ``"triton"`` (the
    GEMV) up to ``GEMV_MAX_M`` rows for weights without group scales (``group_size`` None) or with
    groups of at least ``GEMV_MIN_GROUP``, ``"mgpu"`` up to ``W8A16_MGPU_MAX_M``, else ``"xla"``;
    ``"reference"`` off CUDA GPUs."""
    if capability == 0:
        return w4a16_fallback(capability)
    if not has_wgmma(capability) or m > W8A16_MGPU_MAX_M:
        return "xla"
    gemv_groups = group_size is None or group_size >= GEMV_MIN_GROUP
    return "triton" if m <= GEMV_MAX_M and gemv_groups else "mgpu"


def moe_experts_impl(scheme, capability: int) -> str:
    """What runs a stack of experts quantized with ``scheme`` (a ``Scheme``) on a device of
    ``capability``: ``"mgpu"`` on Hopper for 4-bit weight-only experts (the grouped W4A16 kernel) and
    W8A8 FP8 experts (the grouped FP8 GEMM), else ``"xla"`` (dequantize + ``jax.lax.ragged_dot``)."""
    if not has_wgmma(capability):
        return "xla"
    if scheme.weight_only:
        return "mgpu" if MOE_W4A16_MGPU and scheme.weight.bits == 4 else "xla"
    fp8 = scheme.weight.format == "fp8_e4m3" and scheme.activation.format == "fp8_e4m3"
    return "mgpu" if MOE_FP8_MGPU and fp8 else "xla"


def act_quant_impl(rows: int, capability: int) -> str:
    """Who quantizes ``rows`` rows of dynamic e4m3 activations on a CUDA device of ``capability``:
    ``"pallas"`` (the Triton-backend pass) from ``ACT_QUANT_KERNEL_MIN_ROWS`` rows on sm_89 and up,
    else ``"xla"``."""
    return "pallas" if capability >= E4M3_CAST_MIN_CAPABILITY and rows >= ACT_QUANT_KERNEL_MIN_ROWS else "xla"


def fp8_gemm_impl(m: int, capability: int, blocked: bool = False, per_token: bool = False) -> str:
    """The FP8 W8A8 GEMM's "auto" choice for ``m`` rows: on Hopper ``"mgpu"`` for block scales
    (``blocked``) from ``FP8_BLOCK_MGPU_MIN_M`` rows; for one K block ``"triton"`` (the GEMV) up to
    ``GEMV_MAX_M`` rows, then ``"mgpu"`` at every M for per-token activation scales (``per_token``,
    ``FP8_GEMM_MGPU_PER_TOKEN_EVERY_M``), else up to ``FP8_GEMM_MGPU_MAX_M`` rows and from
    ``FP8_GEMM_MGPU_MIN_LARGE_M``; else ``"xla"`` (XLA's FP8 dot on the same layout)."""
    if not has_wgmma(capability):
        return "xla"
    if blocked:
        return "mgpu" if m >= FP8_BLOCK_MGPU_MIN_M else "xla"
    if m <= GEMV_MAX_M:
        return "triton"
    if per_token and FP8_GEMM_MGPU_PER_TOKEN_EVERY_M:
        return "mgpu"
    return "mgpu" if m <= FP8_GEMM_MGPU_MAX_M or m >= FP8_GEMM_MGPU_MIN_LARGE_M else "xla"
