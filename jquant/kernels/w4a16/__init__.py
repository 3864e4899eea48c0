"""Pallas kernels: a fused dequant-GEMM for 4-bit weights (W4A16) on Hopper GPUs, with Mosaic GPU.

Importing this package loads no GPU backend: the kernel's modules are imported when it first runs.
"""

from jquant.kernels.w4a16.api import IMPLS, MGPU_MAX_M, resolve_impl, w4a16_matmul
from jquant.kernels.w4a16.layout import (PackedW4NK, dequantize_nk, prepack_nk,
                                                reference_nk)
from jquant.kernels.w4a16.config import MgpuConfig, default_mgpu_config
from jquant.kernels.w4a16.mosaic_gpu_decode import LUTS, lut_values

__all__ = ["IMPLS", "LUTS", "MGPU_MAX_M", "MgpuConfig", "PackedW4NK", "default_mgpu_config",
           "dequantize_nk", "lut_values", "prepack_nk", "reference_nk", "resolve_impl",
           "w4a16_matmul"]
