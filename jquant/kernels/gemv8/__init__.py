"""Pallas kernel: the 8-bit GEMV (a few rows of x times int8 or e4m3 weight codes) with the Triton
backend, run by ``w8a16_matmul`` and ``fp8_gemm`` at decode-sized M.

Importing this package loads no GPU backend: Pallas is imported when the kernel first runs.
"""

from jquant.kernels.gemv8.config import GemvConfig, default_gemv_config

__all__ = ["GemvConfig", "default_gemv_config"]
