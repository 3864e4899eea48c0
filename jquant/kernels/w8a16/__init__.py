"""Pallas kernels: W8A16 (int8 and FP8 e4m3 weights, bf16 / fp16 activations) on Hopper GPUs, with
the W4A16 kernel's Mosaic GPU pipeline reading 8-bit tiles.

Importing this package loads no GPU backend: the kernel's modules are imported when it first runs.
"""

from jquant.kernels.w8a16.api import default_w8_config, resolve_w8_impl, w8a16_matmul
from jquant.kernels.w8a16.from_qtensor import pack_w8_qtensor
from jquant.kernels.w8a16.layout import PackedW8NK, dequantize_w8, prepack_w8, reference_w8

__all__ = ["PackedW8NK", "default_w8_config", "dequantize_w8", "pack_w8_qtensor", "prepack_w8",
           "reference_w8", "resolve_w8_impl", "w8a16_matmul"]
