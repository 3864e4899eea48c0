"""compressed-tensors 0.20.1 MXFP8 goldens: the ``mxfp8-quantized`` weight path of the MXFP8A16 / MXFP8
presets (what llm-compressor writes and vLLM's ``CompressedTensorsW8A8Mxfp8`` reads, weight-only on
Hopper: Marlin or a bfloat16 dequantization).

Per-32 group min/max through ``calculate_qparams`` give the power-of-two scales (``generate_mx_scales``
with 8 bits: the group amax rounded to one mantissa bit, E2M1's width, so up from 1.75 · 2^e, then
``floor(log2) - 8``);
``MXFP8QuantizationCompressor.compress`` divides, clamps to ±448, casts to float8_e4m3fn and stores
the scales as biased exponents; ``decompress`` dequantizes. Inputs (float32 and bfloat16): the NVFP4
goldens' rows (1e-3..1e2, an all-zero group, a tiny group, -0.0) in groups of 32, a group of 1e-30,
e4m3 midpoints under scale 2^0, group amaxes at 1.5 · 2^k and just below, at and above 1.75 · 2^k, and
two rows of groups at random magnitudes from 2^-140 to 2^120.
"""

from __future__ import annotations

import torch
from compressed_tensors.compressors.mxfp8 import MXFP8QuantizationCompressor
from compressed_tensors.quantization import QuantizationScheme
from compressed_tensors.quantization.quant_scheme import MXFP8A16

from goldens.compressed_tensors_mxfp4 import GROUP, ct_mx_case, save_cases, wide_range_rows
from goldens.compressed_tensors_nvfp4 import nvfp4_inputs

VENV = "ref"


def _inputs(generator, rows=12, cols=256):
    x = nvfp4_inputs(generator, rows, cols, group=GROUP)
    x[1, GROUP:2 * GROUP] *= 1e-30
    # e4m3 midpoints under scale 2^0 (group amax 384 rounds to 256 at one mantissa bit: 2^8 - 8 = 0).
    mids = torch.tensor([1.0625, 1.1875, 2.125, 2.375, 0.0009765625, 0.0029296875, 13.0, 15.0, 208.0, 240.0])
    x[2, GROUP:2 * GROUP] = 0.0
    x[2, GROUP] = 384.0
    x[2, GROUP + 1:GROUP + 1 + len(mids)] = mids
    x[2, GROUP + 1 + len(mids):GROUP + 1 + 2 * len(mids)] = -mids
    # Group amaxes around the one-bit round-up point 1.75 · 2^k, and at 1.5 · 2^k (kept).
    for i, amax in enumerate([1.5, 1.4999999, 1.5000001, 1.75, 1.7421875, 3.0, 0.75]):
        x[4, (i + 1) * GROUP] = amax
    wide_range_rows(x, generator)
    return x


def _case(x, scheme):
    return ct_mx_case(x, scheme, MXFP8QuantizationCompressor, "weight")


def make(out_dir):
    generator = torch.Generator().manual_seed(3233)
    x = _inputs(generator)
    return save_cases(out_dir, "compressed_tensors_mxfp8", x, QuantizationScheme(targets=["Linear"], **MXFP8A16), _case)
