"""compressed-tensors 0.20.1 FP8 goldens: the "float-quantized" checkpoint tensors of a weight.

For each case the weight's min/max per tensor, per output channel or per (padded) block go through
``calculate_qparams`` and the FloatQuantizationCompressor, exactly as llm-compressor saves a model.
Stored per case: the checkpoint tensors (``<case>_weight`` as uint8 codes, ``<case>_weight_scale``
in its dtype, bfloat16 as uint16 bits) and their names; inputs are stored once.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from compressed_tensors.quantization.utils import calculate_qparams

from goldens import _common

VENV = "ref"


def _weights(generator, rows, cols, dtype):
    magnitude = torch.logspace(-2, 1, rows, dtype=torch.float32)[:, None]
    return (torch.randn(rows, cols, generator=generator) * magnitude).to(dtype)


def _min_max(x, args):
    if args.strategy == "tensor":
        return torch.aminmax(x)
    if args.strategy == "channel":
        return x.amin(dim=1, keepdim=True), x.amax(dim=1, keepdim=True)
    rows, cols = args.block_structure
    padded = F.pad(x, (0, -x.shape[1] % cols, 0, -x.shape[0] % rows))
    blocks = padded.reshape(padded.shape[0] // rows, rows, padded.shape[1] // cols, cols)
    return blocks.amin(dim=(1, 3)), blocks.amax(dim=(1, 3))


def _checkpoint(x, args):
    scale, zero_point = calculate_qparams(*_min_max(x, args), args)
    scheme = QuantizationScheme(targets=["Linear"], weights=args,
                                input_activations=QuantizationArgs(num_bits=8, type="float",
                                                                   strategy="token", dynamic=True))
    state = {"weight": x, "weight_scale": scale, "weight_zero_point": zero_point}
    out = FloatQuantizationCompressor.compress(state, scheme)
    if args.strategy == "block":
        rows, cols = args.block_structure
        assert out["weight_scale"].shape == (math.ceil(x.shape[0] / rows), math.ceil(x.shape[1] / cols))
    return out


def _numpy(t):
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return t.view(torch.uint8).numpy()
    if t.dtype == torch.bfloat16:
        return t.view(torch.uint16).numpy()
    return t.numpy()


def make(out_dir):
    generator = torch.Generator().manual_seed(7)
    inputs = {
        "x_f32": _weights(generator, 16, 256, torch.float32),
        "x_bf16": _weights(generator, 16, 256, torch.bfloat16),
        "x_block_bf16": _weights(generator, 130, 136, torch.bfloat16),  # pads to 256 × 256
        "x_block_f32": _weights(generator, 40, 72, torch.float32),  # pads to 64 × 96
    }
    fp8 = dict(num_bits=8, type="float", symmetric=True)
    cases = {
        "channel_f32": ("x_f32", QuantizationArgs(**fp8, strategy="channel")),
        "tensor_f32": ("x_f32", QuantizationArgs(**fp8, strategy="tensor")),
        "channel_bf16": ("x_bf16", QuantizationArgs(**fp8, strategy="channel")),
        "block128_bf16": ("x_block_bf16", QuantizationArgs(**fp8, strategy="block",
                                                           block_structure=[128, 128])),
        "block32_f32": ("x_block_f32", QuantizationArgs(**fp8, strategy="block",
                                                        block_structure=[32, 32])),
    }
    arrays = {name: _numpy(x) for name, x in inputs.items()}
    for name, (input_name, args) in cases.items():
        tensors = _checkpoint(inputs[input_name], args)
        arrays[f"{name}_names"] = np.array(sorted(tensors))
        for key, value in tensors.items():
            arrays[f"{name}_{key}"] = _numpy(value)
    return [_common.save(out_dir, "compressed_tensors_fp8", ("torch", "compressed-tensors"), **arrays)]
