"""compressed-tensors 0.20.1 MXFP4 goldens: the ``mxfp4-pack-quantized`` weight path of the MXFP4A16
preset (what llm-compressor writes and vLLM's ``CompressedTensorsW4A16Mxfp4`` reads).

Per-32 group min/max through ``calculate_qparams`` give the power-of-two scales (the group amax
rounded up to the next power of two from 1.75 · 2^e, as ``generate_mx_scales`` does, in the weight's
dtype); ``MXFP4PackedCompressor.compress`` quantizes, packs (even element in the low nibble) and
stores the scales as biased exponents; ``decompress`` dequantizes. Inputs (float32 and bfloat16):
the NVFP4 goldens' rows (1e-3..1e2, an all-zero group, a tiny group, every E2M1 midpoint, -0.0)
in groups of 32, a group of 1e-30, group amaxes just below, at and above 1.75 · 2^k, and two rows of
groups at random magnitudes from 2^-140 to 2^120.
"""

from __future__ import annotations

import torch
from compressed_tensors.compressors.mxfp4 import MXFP4PackedCompressor
from compressed_tensors.quantization import QuantizationScheme
from compressed_tensors.quantization.quant_scheme import MXFP4A16
from compressed_tensors.quantization.utils.helpers import calculate_qparams

from goldens import _common
from goldens.compressed_tensors_nvfp4 import nvfp4_inputs

VENV = "ref"
GROUP = 32


def _inputs(generator, rows=12, cols=256):
    x = nvfp4_inputs(generator, rows, cols, group=GROUP)
    x[1, GROUP:2 * GROUP] *= 1e-30
    x[2, GROUP:2 * GROUP] *= 4.0                 # the ties under scale 2^0 (group amax 24 → 4 · 6)
    # Group amaxes around 1.75 · 2^k: the scale's round-up point.
    for i, amax in enumerate([1.75, 1.7421875, 1.7578125, 3.5, 3.4999998, 0.875]):
        x[4, (i + 1) * GROUP] = amax
    wide_range_rows(x, generator)
    return x


def wide_range_rows(x, generator):
    """Rows 6 and 7: groups at random magnitudes from 2^-140 (subnormal) to 2^120, then in row 7 groups
    under scale byte 0 whose elements round to nonzero codes only under the divisor 2^-127 (not 2^-126)."""
    exponents = torch.randint(-140, 120, (2, x.shape[1] // GROUP), generator=generator).repeat_interleave(GROUP, -1)
    x[6:8] = torch.randn(2, x.shape[1], generator=generator) * torch.exp2(exponents.float())
    for i, e in enumerate((-124.5, -125.5, -118.5, -119.5)):
        x[7, i * GROUP:(i + 1) * GROUP] = torch.randn(GROUP, generator=generator) * 2.0 ** e


def _bits(x):
    return x.view(torch.uint16).numpy() if x.dtype == torch.bfloat16 else x.numpy()


def ct_mx_case(x, scheme, compressor, codes: str):
    """compressed-tensors' stored ``codes`` tensor (uint8 bytes) and ``weight_scale`` of weight x, and its
    decompressed weight (bits), the scales from per-32 group min/max through ``calculate_qparams``."""
    groups = x.unflatten(-1, (x.shape[-1] // GROUP, GROUP))
    scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights)
    compressed = compressor.compress({"weight": x, "weight_scale": scale.to(x.dtype)}, scheme)
    restored = compressor.decompress(dict(compressed), scheme)
    return {codes: compressed[codes].view(torch.uint8).numpy(), "weight_scale": compressed["weight_scale"].numpy(),
            "dequantized": _bits(restored["weight"])}


def _case(x, scheme):
    return ct_mx_case(x, scheme, MXFP4PackedCompressor, "weight_packed")


def save_cases(out_dir, name, x, scheme, case):
    """The golden ``name``: x in float32 and bfloat16 (``w_f32``, ``w_bf16``) and ``case`` of each."""
    inputs = {"w_f32": x, "w_bf16": x.to(torch.bfloat16)}
    arrays = {key: _bits(value) for key, value in inputs.items()}
    for key, value in inputs.items():
        arrays.update({f"{key}_{k}": v for k, v in case(value, scheme).items()})
    return [_common.save(out_dir, name, ("torch", "compressed-tensors"), **arrays)]


def make(out_dir):
    generator = torch.Generator().manual_seed(3232)
    x = _inputs(generator)
    return save_cases(out_dir, "compressed_tensors_mxfp4", x, QuantizationScheme(targets=["Linear"], **MXFP4A16), _case)
