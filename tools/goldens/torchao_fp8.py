"""torchao 0.18 FP8 goldens: Float8Tensor.from_hp per row, per tensor and per 128×128 block.

The inputs are stored once (float32, or bfloat16 as uint16 bits); each case stores the float8
codes as uint8 and the float32 scales torchao computes (its torch kernel: ``amax / max`` in the input dtype, then
``clamp(x_fp32 / scale, ±max).to(float8)``).
"""

from __future__ import annotations

import torch
from torchao.quantization.granularity import PerBlock, PerRow, PerTensor
from torchao.quantization.quant_primitives import _choose_scale_float8, _quantize_affine_float8
from torchao.quantization.quantize_.common.kernel_preference import KernelPreference
from torchao.quantization.quantize_.workflows.float8.float8_tensor import Float8Tensor
from torchao.quantization.utils import get_block_size

from goldens import _common

VENV = "ref"


def _weights(generator, rows, cols, dtype):
    # Rows of different magnitudes so per-row scales differ by orders of magnitude.
    magnitude = torch.logspace(-3, 2, rows, dtype=torch.float32)[:, None]
    return (torch.randn(rows, cols, generator=generator) * magnitude).to(dtype)


def _quantize(x, granularity, float8_dtype):
    qt = Float8Tensor.from_hp(x, float8_dtype=float8_dtype, granularity=granularity,
                              kernel_preference=KernelPreference.TORCH)
    # The tensor subclass is the documented path; check it agrees with the primitives it wraps.
    block_size = list(get_block_size(x.shape, granularity))
    scale = _choose_scale_float8(x, block_size=block_size, float8_dtype=float8_dtype)
    data = _quantize_affine_float8(x, scale, float8_dtype)
    assert torch.equal(qt.qdata.view(torch.uint8), data.view(torch.uint8))
    assert torch.equal(qt.scale, scale)
    return qt.qdata.view(torch.uint8).numpy(), qt.scale.to(torch.float32).numpy()


def _bits(x):
    return x.view(torch.uint16).numpy() if x.dtype == torch.bfloat16 else x.numpy()


def make(out_dir):
    generator = torch.Generator().manual_seed(20240518)
    inputs = {
        "x_f32": _weights(generator, 16, 256, torch.float32),
        "x_bf16": _weights(generator, 16, 256, torch.bfloat16),
        "x_block_bf16": _weights(generator, 128, 256, torch.bfloat16),
    }
    cases = {
        "row_e4m3": ("x_f32", PerRow(), torch.float8_e4m3fn),
        "row_e5m2": ("x_f32", PerRow(), torch.float8_e5m2),
        "tensor_e4m3": ("x_f32", PerTensor(), torch.float8_e4m3fn),
        "row_bf16_e4m3": ("x_bf16", PerRow(), torch.float8_e4m3fn),
        "block_bf16_e4m3": ("x_block_bf16", PerBlock((128, 128)), torch.float8_e4m3fn),
    }
    arrays = {name: _bits(x) for name, x in inputs.items()}
    for name, (input_name, granularity, float8_dtype) in cases.items():
        codes, scale = _quantize(inputs[input_name], granularity, float8_dtype)
        arrays[f"{name}_codes"] = codes
        arrays[f"{name}_scale"] = scale
    return [_common.save(out_dir, "torchao_fp8", ("torch", "torchao"), **arrays)]
