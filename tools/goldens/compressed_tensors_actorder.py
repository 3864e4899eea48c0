"""compressed-tensors act-order (``actorder: "group"``) pack-quantized goldens: W4A16 weights whose
columns join groups by a permutation, with the column → group map stored as ``weight_g_idx``.

compressed-tensors 0.13 and later dropped ``actorder="group"`` (its ``quantize`` no longer takes
``g_idx``), while checkpoints written with it stay in use, so this module needs the last release that
quantizes with a ``g_idx`` on the path first:

    /tmp/ref/bin/pip install --no-deps --target /tmp/ct_actorder compressed-tensors==0.12.2
    PYTHONPATH=/tmp/ct_actorder /tmp/ref/bin/python tools/make_goldens.py compressed_tensors_actorder

The permutation is GPTQ's: columns sorted by a random Hessian diagonal, descending, so column
``perm[i]`` joins group ``i // G`` and ``g_idx = argsort(perm) // G``. Min/max qparams come from each
group's columns (``calculate_qparams``); the compressor (``compress_weight`` with ``g_idx``) packs the
codes in the original column order. Stored per case: the inputs ``weight`` float32 [N, K] and
``config`` (int [num_bits, group_size, symmetric]), the qparams ``scale`` float32 [N, K/G] and
``zero_point`` (signed int8), the checkpoint tensors ``weight_packed``, ``weight_shape``,
``weight_g_idx`` (int32 [K]) and, asymmetric only, ``weight_zero_point``, and ``dequant``: the
library's ``dequantize(codes, scale, zero_point, g_idx=...)`` (float32).
"""

from __future__ import annotations

import numpy as np

from goldens import _common

VENV = "ref"

# name: (num_bits, group_size, symmetric)
CASES = {
    "int4_g32_sym": (4, 32, True),
    "int4_g32_asym": (4, 32, False),
    "int4_g128_sym": (4, 128, True),
    "int4_g128_asym": (4, 128, False),
}
N, K = 16, 256


def make(out_dir):
    import torch
    from compressed_tensors.compressors.quantized_compressors.pack_quantized import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize, quantize
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    generator = torch.Generator().manual_seed(20261203)
    arrays = {}
    for name, (bits, group, symmetric) in CASES.items():
        weight = torch.randn(N, K, generator=generator)
        weight[:, :group] = weight[:, :group].abs()  # the all-positive columns spread over several groups
        hessian_diag = torch.rand(K, generator=generator)
        perm = torch.argsort(hessian_diag, descending=True)
        g_idx = (torch.argsort(perm) // group).to(torch.int32)
        args = QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric, strategy="group",
                                group_size=group, actorder="group")
        grouped = weight[:, perm].reshape(N, K // group, group)
        scale, zero_point = calculate_qparams(grouped.amin(-1), grouped.amax(-1), args)
        out = PackedQuantizationCompressor().compress_weight(weight, scale, args, zero_point=zero_point, g_idx=g_idx)
        codes = quantize(weight, scale, zero_point, args, dtype=torch.int8, g_idx=g_idx)
        dequant = dequantize(codes, scale, zero_point, args, dtype=torch.float32, g_idx=g_idx)
        arrays.update({f"{name}_weight": weight.numpy(), f"{name}_config": np.array([bits, group, symmetric]),
                       f"{name}_scale": scale.numpy(), f"{name}_zero_point": zero_point.numpy(),
                       f"{name}_weight_g_idx": g_idx.numpy(), f"{name}_dequant": dequant.numpy()})
        arrays.update({f"{name}_{key}": value.numpy() for key, value in out.items()})
    return [_common.save(out_dir, "compressed_tensors_actorder", ("compressed-tensors", "torch"), **arrays)]
