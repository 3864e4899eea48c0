"""gguf-py 0.19 MXFP4 goldens: ``gguf.quants.quantize`` / ``dequantize`` for GGMLQuantizationType.MXFP4.

GGUF stores each block of 32 as 17 bytes: the E8M0 exponent, then 16 bytes whose low nibbles hold
elements 0-15 and high nibbles elements 16-31. Inputs: rows of varied magnitude, an all-zero block,
and a block of exact ties (midpoints between E2M1 values, under a scale of 1) and negative values that
round to zero, where GGML's nearest-value search differs from round-half-to-even.
"""

from __future__ import annotations

import numpy as np
from gguf.constants import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from goldens import _common

VENV = "ref"
BLOCK = 32


def _inputs():
    rng = np.random.default_rng(3290)
    magnitude = np.logspace(-3, 3, 8)[:, None]
    x = (rng.standard_normal((8, 4 * BLOCK)) * magnitude).astype(np.float32)
    x[0, :BLOCK] = 0.0
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0,
            -0.1, -0.0, 0.0, 4.0, 7.0, -7.5]
    block = np.zeros(BLOCK, np.float32)
    block[:len(ties)] = ties  # amax 7.5 → exponent floor(log2 7.5) - 2 = 0: scale 1
    x[1, BLOCK:2 * BLOCK] = block
    return x


def make(out_dir):
    x = _inputs()
    packed = quantize(x, GGMLQuantizationType.MXFP4)
    values = dequantize(packed, GGMLQuantizationType.MXFP4)
    return [_common.save(out_dir, "gguf_mxfp4", ("gguf", "numpy"), x=x, gguf_blocks=packed,
                         dequantized=values)]
