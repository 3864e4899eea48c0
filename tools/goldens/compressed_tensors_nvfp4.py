"""compressed-tensors 0.20.1 NVFP4 goldens: the ``nvfp4-pack-quantized`` weight path and the dynamic
per-group activation path with a static ``input_global_scale``.

Weights: ``generate_gparam`` on the tensor's min/max gives ``weight_global_scale``; per-16 group
min/max through ``calculate_qparams`` (the NVFP4 preset's weight args) give the block scales, which
``NVFP4PackedCompressor.compress`` rounds to E4M3 while quantizing and packing; ``decompress``
dequantizes to bf16. A bf16 weight is also quantized without a global scale. Activations:
``input_global_scale`` from a calibration amax below the batch's (so values clip), then
``compute_dynamic_scales_and_zp`` + ``quantize`` + ``pack_fp4_to_uint8``.
"""

from __future__ import annotations

import torch
from compressed_tensors.compressors.nvfp4 import NVFP4PackedCompressor
from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8
from compressed_tensors.quantization import QuantizationScheme
from compressed_tensors.quantization.lifecycle.forward import quantize
from compressed_tensors.quantization.quant_scheme import NVFP4
from compressed_tensors.quantization.utils.helpers import (
    calculate_qparams,
    compute_dynamic_scales_and_zp,
    generate_gparam,
)

from goldens import _common

VENV = "ref"
GROUP = 16


def nvfp4_inputs(generator, rows=16, cols=128, group=GROUP):
    """Rows spanning 1e-3..1e2, an all-zero block, a tiny block, exact E2M1 ties and -0.0 entries
    (also the MXFP4 goldens' inputs, with ``group`` 32)."""
    magnitude = torch.logspace(-3, 2, rows, dtype=torch.float64)[:, None]
    x = (torch.randn(rows, cols, generator=generator, dtype=torch.float64) * magnitude).float()
    x[0, :group] = 0.0
    x[1, :group] *= 1e-12
    # Block amax 6 (scale 1 in the single-level case) with every E2M1 midpoint, signed.
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
    x[2, group:group + 32] = torch.cat([ties, -ties, ties * 0.5, -ties * 0.5])
    x[3, 5] = -0.0
    x[3, 40] = -0.0
    return x


def _bits(x):
    return x.view(torch.uint16).numpy() if x.dtype == torch.bfloat16 else x.numpy()


def _group_minmax(x):
    groups = x.unflatten(-1, (x.shape[-1] // GROUP, GROUP))
    return groups.amin(-1), groups.amax(-1)


def _weight_case(x, scheme, with_global):
    args = scheme.weights
    global_scale = generate_gparam(x.min(), x.max()) if with_global else None
    scale, _ = calculate_qparams(*_group_minmax(x), args, global_scale=global_scale)
    state = {"weight": x, "weight_scale": scale.to(x.dtype)}  # llm-compressor keeps scales in x's dtype
    if with_global:
        state["weight_global_scale"] = global_scale
    compressed = NVFP4PackedCompressor.compress(state, scheme)
    out = {"weight_packed": compressed["weight_packed"].numpy(),
           "weight_scale": compressed["weight_scale"].view(torch.uint8).numpy()}
    if with_global:
        out["weight_global_scale"] = global_scale.numpy()
        restored = NVFP4PackedCompressor.decompress(compressed, scheme)
        out["dequantized_bf16"] = _bits(restored["weight"].to(torch.bfloat16))
    return out


def _activation_case(x, scheme):
    args = scheme.input_activations
    calibration = x * 0.75
    input_global_scale = generate_gparam(calibration.min(), calibration.max())
    scale, zero_point = compute_dynamic_scales_and_zp(x, args, module=None, global_scale=input_global_scale)
    values = quantize(x, scale, zero_point, args, global_scale=input_global_scale)
    return {"input_global_scale": input_global_scale.numpy(),
            "scale": scale.to(torch.float8_e4m3fn).view(torch.uint8).numpy(),
            "packed": pack_fp4_to_uint8(values.float()).numpy()}


def make(out_dir):
    generator = torch.Generator().manual_seed(4416)
    scheme = QuantizationScheme(targets=["Linear"], **NVFP4)
    x = nvfp4_inputs(generator)
    inputs = {"w_f32": x, "w_bf16": x.to(torch.bfloat16), "act_f32": nvfp4_inputs(generator, 8, 64)}
    inputs["act_bf16"] = inputs["act_f32"].to(torch.bfloat16)
    arrays = {name: _bits(value) for name, value in inputs.items()}
    cases = {"w_f32": _weight_case(inputs["w_f32"], scheme, True),
             "w_bf16": _weight_case(inputs["w_bf16"], scheme, True),
             "w_bf16_noglobal": _weight_case(inputs["w_bf16"], scheme, False),
             "act_f32": _activation_case(inputs["act_f32"], scheme),
             "act_bf16": _activation_case(inputs["act_bf16"], scheme)}
    for case, values in cases.items():
        arrays.update({f"{case}_{key}": value for key, value in values.items()})
    return [_common.save(out_dir, "compressed_tensors_nvfp4", ("torch", "compressed-tensors"), **arrays)]
