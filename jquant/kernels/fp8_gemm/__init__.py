"""Pallas kernels: the FP8 W8A8 GEMM (e4m3 × e4m3, per-token × per-channel or DeepSeek block scales)
on Hopper GPUs, with Mosaic GPU.

Importing this package loads no GPU backend: the kernel's module is imported when it first runs.
"""

from jquant.kernels.fp8_gemm.api import fp8_gemm, resolve_fp8_impl
from jquant.kernels.fp8_gemm.config import Fp8GemmConfig, default_fp8_config
from jquant.kernels.fp8_gemm.layout import PackedFp8, prepack_fp8, reference_fp8

__all__ = ["Fp8GemmConfig", "PackedFp8", "default_fp8_config", "fp8_gemm", "prepack_fp8",
           "reference_fp8", "resolve_fp8_impl"]
