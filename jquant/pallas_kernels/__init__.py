"""Pallas kernels: a fused dequant-GEMM for 4-bit weights (W4A16) on NVIDIA GPUs."""

from jquant.pallas_kernels.w4a16 import (IMPLS, MGPU_MAX_M, default_config, resolve_impl,
                                         w4a16_matmul)
from jquant.pallas_kernels.w4a16_mgpu import (MgpuConfig, PackedW4NK, default_mgpu_config,
                                              dequantize_nk, prepack_nk, reference_nk)
from jquant.pallas_kernels.w4a16_layout import (LUTS, PackedW4, dequantize_packed, lut_values,
                                                prepack)
from jquant.pallas_kernels.w4a16_triton import TuningConfig, reference

__all__ = ["IMPLS", "LUTS", "MGPU_MAX_M", "MgpuConfig", "PackedW4", "PackedW4NK", "TuningConfig",
           "default_config", "default_mgpu_config", "dequantize_nk", "dequantize_packed",
           "lut_values", "prepack", "prepack_nk", "reference", "reference_nk", "resolve_impl",
           "w4a16_matmul"]
