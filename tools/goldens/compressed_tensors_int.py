"""compressed-tensors 0.20 pack-quantized goldens: min/max → ``calculate_qparams`` → the
``pack-quantized`` compressor (``quantize`` to int8 codes, ``pack_to_int32``).

Weights are [N, K] float32 or bfloat16 (rows of different magnitudes, some rows all positive so the
range's forced 0 matters); with bfloat16 weights compressed-tensors computes scales, zero points and
``x / scale + zp`` in bfloat16. Stored per case: the inputs ``weight`` and ``config`` (int [num_bits,
group_size (-1: channel), symmetric, bfloat16]), the qparams ``scale`` / ``zero_point`` (signed, int8)
and the compressor's output tensors under their checkpoint names (``weight_packed``, ``weight_scale``,
``weight_shape`` and, asymmetric only, ``weight_zero_point``). bfloat16 arrays are stored as their
uint16 bit patterns.
"""

from __future__ import annotations

import numpy as np

from goldens import _common

VENV = "ref"

# name: (num_bits, group_size or -1 for channel, symmetric, bfloat16 weights)
CASES = {
    "int4_g32_sym": (4, 32, True, False),
    "int4_g32_asym": (4, 32, False, False),
    "int4_channel_asym": (4, -1, False, False),
    "int8_channel_sym": (8, -1, True, False),
    "int8_g64_asym": (8, 64, False, False),
    "bf16_int4_g32_sym": (4, 32, True, True),
    "bf16_int4_g32_asym": (4, 32, False, True),
    "bf16_int8_channel_asym": (8, -1, False, True),
}
N, K = 32, 128


def _weight(generator):
    import torch

    magnitude = torch.logspace(-2, 1, N)[:, None]
    w = torch.randn(N, K, generator=generator) * magnitude
    w[::7] = w[::7].abs()  # all-positive rows: min is clamped to 0
    return w


def _numpy(t):
    import torch

    return t.view(torch.uint16).numpy() if t.dtype == torch.bfloat16 else t.numpy()


def make(out_dir):
    import torch
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    generator = torch.Generator().manual_seed(20250603)
    arrays = {}
    for name, (bits, group, symmetric, bf16) in CASES.items():
        weight = _weight(generator).to(torch.bfloat16 if bf16 else torch.float32)
        strategy = "channel" if group == -1 else "group"
        args = QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric, strategy=strategy,
                                group_size=None if group == -1 else group)
        grouped = weight.reshape(N, -1, K if group == -1 else group)
        scale, zero_point = calculate_qparams(grouped.amin(-1), grouped.amax(-1), args)
        state = {"weight": weight, "weight_scale": scale, "weight_zero_point": zero_point}
        scheme = QuantizationScheme(targets=["Linear"], weights=args)
        out = PackedQuantizationCompressor.compress(state, scheme)
        arrays.update({f"{name}_weight": _numpy(weight), f"{name}_scale": _numpy(scale),
                       f"{name}_config": np.array([bits, group, symmetric, bf16]),
                       f"{name}_zero_point": zero_point.numpy()})
        arrays.update({f"{name}_{key}": _numpy(value) for key, value in out.items()})
    return [_common.save(out_dir, "compressed_tensors_int", ("compressed-tensors", "torch"), **arrays)]
