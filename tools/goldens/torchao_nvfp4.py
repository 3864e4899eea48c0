"""torchao 0.18 NVFP4 goldens: ``NVFP4Tensor.to_nvfp4`` (its torch path, unswizzled scales) with and
without a per-tensor scale, and ``dequantize``.

Cases: the per-tensor scale from the tensor's own amax (``per_tensor_amax_to_scale``: weights, or
dynamic activations), from a smaller calibration amax (static activations, so values clip), and
none (block scales only); float32 and bfloat16 inputs. Each stores the packed codes, the E4M3 scale
bytes, the per-tensor scale and the bf16 / fp32 dequantization.
"""

from __future__ import annotations

import torch
from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale

from goldens import _common
from goldens.compressed_tensors_nvfp4 import nvfp4_inputs

VENV = "ref"


def _bits(x):
    return x.view(torch.uint16).numpy() if x.dtype == torch.bfloat16 else x.numpy()


def _case(x, per_tensor_scale):
    qt = NVFP4Tensor.to_nvfp4(x, per_tensor_scale=per_tensor_scale)
    out = {"packed": qt.qdata.view(torch.uint8).numpy(),
           "scale": qt.scale.view(torch.uint8).numpy(),
           "dequant_bf16": _bits(qt.dequantize(torch.bfloat16)),
           "dequant_f32": qt.dequantize(torch.float32).numpy()}
    if per_tensor_scale is not None:
        out["per_tensor_scale"] = per_tensor_scale.numpy()
    return out


def make(out_dir):
    generator = torch.Generator().manual_seed(8812)
    x = nvfp4_inputs(generator)
    inputs = {"x_f32": x, "x_bf16": x.to(torch.bfloat16)}
    arrays = {name: _bits(value) for name, value in inputs.items()}
    for name, value in inputs.items():
        amax = torch.max(torch.abs(value))
        cases = {"tensor": per_tensor_amax_to_scale(amax),
                 "static": per_tensor_amax_to_scale(amax * 0.5),
                 "none": None}
        for case, per_tensor_scale in cases.items():
            arrays.update({f"{name}_{case}_{key}": v for key, v in _case(value, per_tensor_scale).items()})
    return [_common.save(out_dir, "torchao_nvfp4", ("torch", "torchao"), **arrays)]
