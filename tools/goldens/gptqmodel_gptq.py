"""gptqmodel 7.6.0 GPTQ goldens: ``TorchLinear.pack_original`` (the default pack) and its dequantizer.

Each case draws integer codes, float16-representable scales and integer zero points, builds the
weight ``s·(q − z + noise)`` (|noise| ≤ 0.3 so rounding is exercised away from ties, plus a few
out-of-range outliers to exercise the clamp) and packs it. Stored per case ``<case>_*``: inputs
``weight`` (float32 [N, K]), ``scales`` (float32 [N, K/G]), ``zeros`` (int32 [N, K/G]), ``g_idx``
(int32 [K]), ``config`` (int32 [bits, group_size, sym, act_order]); outputs ``qweight``,
``qzeros_v2`` (what pack writes), ``qzeros_v1`` (after gptqmodel's
``convert_gptq_v2_to_v1_format_module``, what a v1 save writes), ``qzeros_v1_fields`` (its field-wise
conversion, ``_revert_gptq_v1_qzeros_correction``), ``scales_fp16`` and ``dequant`` (float16 [N, K],
``dequantize_weight().T``). The python pack path is forced (GPTQMODEL_DISABLE_PACK_EXT=1) so no C++
extension is compiled.
"""

from __future__ import annotations

import os

import numpy as np

from goldens import _common

VENV = "gptq"

# name: (bits, group_size, sym, act_order, K, smallest zero point)
CASES = {
    "sym4_g32": (4, 32, True, False, 64, None),
    "asym4_g64": (4, 64, False, False, 128, 1),
    "asym3_g32": (3, 32, False, False, 64, 1),
    "sym8_g32": (8, 32, True, False, 64, None),
    "asym2_g32": (2, 32, False, False, 64, 1),
    "act4_g32": (4, 32, False, True, 128, 1),
    "zero0_asym4_g32": (4, 32, False, False, 64, 0),
}
N = 32


def _inputs(rng, bits, group, sym, act_order, k, zero_min):
    groups, maxq = k // group, 2 ** bits - 1
    scales = rng.uniform(0.002, 0.02, (N, groups)).astype(np.float16).astype(np.float32)
    if sym:
        zeros = np.full((N, groups), 2 ** (bits - 1), np.int32)
    else:
        zeros = rng.integers(zero_min, maxq + 1, (N, groups)).astype(np.int32)
        zeros[0, 0] = zero_min
    if act_order:
        g_idx = (np.argsort(rng.permutation(k)) // group).astype(np.int32)  # GPTQ: g_idx[invperm]
    else:
        g_idx = (np.arange(k) // group).astype(np.int32)
    codes = rng.integers(0, maxq + 1, (N, k))
    noise = rng.uniform(-0.3, 0.3, (N, k))
    codes[1, :4] = [maxq + 3, -3, maxq + 1, -1]  # clamped by the packer
    weight = scales[:, g_idx] * (codes - zeros[:, g_idx] + noise)
    return weight.astype(np.float32), scales, zeros, g_idx


def make(out_dir):
    os.environ["GPTQMODEL_DISABLE_PACK_EXT"] = "1"
    import torch
    from gptqmodel.nn_modules.qlinear import PackableQuantLinear
    from gptqmodel.nn_modules.qlinear.torch import TorchLinear
    from gptqmodel.quantization import QuantizeConfig
    from gptqmodel.utils.model import convert_gptq_v2_to_v1_format_module
    from gptqmodel.utils.model_dequant import _revert_gptq_v1_qzeros_correction

    rng = np.random.default_rng(20250601)
    arrays = {}
    for name, (bits, group, sym, act_order, k, zero_min) in CASES.items():
        weight, scales, zeros, g_idx = _inputs(rng, bits, group, sym, act_order, k, zero_min)
        linear = torch.nn.Linear(k, N, bias=False)
        linear.weight.data = torch.from_numpy(weight)
        module = TorchLinear(bits=bits, group_size=group, sym=sym, desc_act=act_order, in_features=k,
                             out_features=N, register_buffers=True)
        module.pack_original(linear, torch.from_numpy(scales), torch.from_numpy(zeros).float(),
                             torch.from_numpy(g_idx))
        module._init_wf_unsqueeze_buffers()
        dequant = PackableQuantLinear.dequantize_weight(module).T.contiguous()
        qzeros_v2 = module.qzeros.clone()
        convert_gptq_v2_to_v1_format_module(module, QuantizeConfig(bits=bits))
        arrays.update({
            f"{name}_weight": weight, f"{name}_scales": scales, f"{name}_zeros": zeros, f"{name}_g_idx": g_idx,
            f"{name}_config": np.array([bits, group, sym, act_order], np.int32),
            f"{name}_qweight": module.qweight.numpy(), f"{name}_qzeros_v2": qzeros_v2.numpy(),
            f"{name}_qzeros_v1": module.qzeros.numpy(),
            f"{name}_qzeros_v1_fields": _revert_gptq_v1_qzeros_correction(qzeros_v2, bits).numpy(),
            f"{name}_scales_fp16": module.scales.numpy(), f"{name}_dequant": dequant.numpy(),
        })
    return [_common.save(out_dir, "gptqmodel_gptq", ("gptqmodel", "torch"), **arrays)]
