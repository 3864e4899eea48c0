"""Pallas kernels: a fused dequant-GEMM for 4-bit weights (W4A16) on NVIDIA GPUs."""

from jquant.pallas_kernels.w4a16 import (IMPLS, default_config, resolve_impl,
                                         w4a16_matmul)
from jquant.pallas_kernels.w4a16_layout import (LUTS, PackedW4, dequantize_packed, lut_values,
                                                prepack)
from jquant.pallas_kernels.w4a16_triton import TuningConfig, reference

__all__ = ["IMPLS", "LUTS", "PackedW4", "TuningConfig", "default_config", "dequantize_packed",
           "lut_values", "prepack", "reference", "resolve_impl", "w4a16_matmul"]
