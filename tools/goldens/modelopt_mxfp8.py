"""TensorRT Model Optimizer 0.47.0 MXFP8 goldens: ``MXFP8QTensor``'s export path (``get_weights_scaling_factor``,
then ``quantize_with_scale``; what a ``quant_algo: MXFP8`` checkpoint stores and vLLM's
``ModelOptMxFp8LinearMethod`` reads) and its ``dequantize``.

Needs the ``nvidia-modelopt`` package in the reference venv, installed without its GPU dependencies::

    /tmp/ref/bin/pip install --no-deps nvidia-modelopt==0.47.0 && /tmp/ref/bin/pip install omegaconf pulp scipy

Inputs: the adversarial FP4 / FP8 rows (float32 ``x``: block amaxes a few float32 steps around powers of two
and max · 2^k, midpoints, -0.0, zero and subnormal rows, near-float32-max rows) and rows of groups at random
magnitudes from 2^-140 to 2^120 (float32 ``w_f32`` and bfloat16 ``w_bf16``, the bits as uint16).
"""

from __future__ import annotations

import numpy as np
import torch
from modelopt.torch.quantization.qtensor.mxfp8_tensor import MXFP8QTensor

from goldens import _common
from goldens.adversarial_fp4 import adversarial_rows

VENV = "ref"


def _case(w):
    with np.errstate(all="ignore"):
        scale = MXFP8QTensor.get_weights_scaling_factor(w)
        codes = MXFP8QTensor.quantize_with_scale(w, scale)
    qtensor = MXFP8QTensor(w.shape, w.dtype, codes)
    dequantized = qtensor.dequantize(torch.float32, scale=scale)
    return {"scale": scale.numpy(), "codes": codes.view(torch.uint8).numpy(), "dequantized": dequantized.numpy()}


def make(out_dir):
    generator = torch.Generator().manual_seed(3234)
    exponents = torch.randint(-140, 120, (8, 8), generator=generator).repeat_interleave(32, -1)
    w = torch.randn(8, 256, generator=generator) * torch.exp2(exponents.float())
    inputs = {"x": torch.from_numpy(adversarial_rows()), "w_f32": w, "w_bf16": w.to(torch.bfloat16)}
    arrays = {}
    for name, value in inputs.items():
        arrays[name] = value.view(torch.uint16).numpy() if value.dtype == torch.bfloat16 else value.numpy()
        arrays.update({f"{name}_{key}": v for key, v in _case(value).items()})
    return [_common.save(out_dir, "modelopt_mxfp8", ("torch", "nvidia-modelopt"), **arrays)]
