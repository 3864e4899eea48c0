"""gptqmodel 7.6.0 AWQ goldens: the AWQ GEMM QuantLinear's ``pack`` and ``dequantize_gemm``.

``AwqGEMMLinear`` refuses to construct without CUDA, so its ``pack`` runs on an ``AwqTorchLinear``
(same buffers; the torch class's own ``pack`` goes through ``pack_awq`` and is checked to agree).
Inputs are built as in ``gptqmodel_gptq`` but without outliers: AWQ's pack does not clamp, so an
out-of-range code would spill into its neighbour. Stored per case: ``weight`` (float32 [N, K]),
``scales`` (float32 [N, K/G]), ``zeros`` (int32 [N, K/G]), ``group_size``; outputs ``qweight`` (int32
[K, N/8]), ``qzeros`` (int32 [K/G, N/8]), ``scales_fp16`` ([K/G, N]) and ``dequant`` (float16 [N, K]).
"""

from __future__ import annotations

import numpy as np

from goldens import _common

VENV = "gptq"

CASES = {"asym4_g32": (32, 64), "asym4_g64": (64, 128)}  # name: (group_size, K)
N = 32


def make(out_dir):
    import torch
    from gptqmodel.nn_modules.qlinear.gemm_awq import AwqGEMMLinear
    from gptqmodel.nn_modules.qlinear.torch_awq import AwqTorchLinear
    from gptqmodel.quantization.awq.utils.packing_utils import dequantize_gemm

    rng = np.random.default_rng(20250602)
    arrays = {}
    for name, (group, k) in CASES.items():
        groups = k // group
        scales = rng.uniform(0.002, 0.02, (N, groups)).astype(np.float16).astype(np.float32)
        zeros = rng.integers(0, 16, (N, groups)).astype(np.int32)
        codes = rng.integers(0, 16, (N, k))
        g = np.arange(k) // group
        weight = (scales[:, g] * (codes - zeros[:, g] + rng.uniform(-0.3, 0.3, (N, k)))).astype(np.float32)
        linear = torch.nn.Linear(k, N, bias=False)
        linear.weight.data = torch.from_numpy(weight)
        packed = []
        for pack in (AwqGEMMLinear.pack, AwqTorchLinear.pack):
            module = AwqTorchLinear(bits=4, group_size=group, sym=False, desc_act=False, in_features=k,
                                    out_features=N, register_buffers=True)
            pack(module, linear, torch.from_numpy(scales), torch.from_numpy(zeros).float())
            packed.append(module)
        gemm, torch_pack = packed
        assert torch.equal(gemm.qweight, torch_pack.qweight) and torch.equal(gemm.qzeros, torch_pack.qzeros)
        dequant = dequantize_gemm(gemm.qweight, gemm.qzeros, gemm.scales, 4, group).T.contiguous()
        arrays.update({
            f"{name}_weight": weight, f"{name}_scales": scales, f"{name}_zeros": zeros,
            f"{name}_group_size": np.array(group), f"{name}_qweight": gemm.qweight.numpy(),
            f"{name}_qzeros": gemm.qzeros.numpy(), f"{name}_scales_fp16": gemm.scales.numpy(),
            f"{name}_dequant": dequant.numpy(),
        })
    return [_common.save(out_dir, "gptqmodel_awq", ("gptqmodel", "torch"), **arrays)]
