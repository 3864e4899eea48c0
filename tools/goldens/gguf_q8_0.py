"""gguf-py 0.19 Q8_0 goldens: ``gguf.quants.quantize(x, Q8_0)`` and ``dequantize``.

The input x (float32 [8, 128], blocks of 32 along rows) mixes magnitudes, holds an all-zero block
(d = 0) and a block of exact half-integers with amax 127 (d = 1, so ``x·(1/d)`` is an exact tie and
``np_roundf`` rounds it away from zero). Each 34-byte block (float16 d, then 32 int8) is stored split:
``d`` (float16 [8, 4]), ``qs`` (int8 [8, 128]); plus ``blocks`` (the raw uint8 [8, 136]) and
``dequant`` (float32).
"""

from __future__ import annotations

import numpy as np

from goldens import _common

VENV = "ref"


def make(out_dir):
    from gguf import GGMLQuantizationType, quants

    rng = np.random.default_rng(20250604)
    x = (rng.standard_normal((8, 128)) * np.logspace(-3, 2, 8)[:, None]).astype(np.float32)
    x[2, 32:64] = 0.0
    x[3, :32] = np.concatenate([[127.0, -126.5], np.arange(-15, 15) + 0.5]).astype(np.float32)
    blocks = quants.quantize(x, GGMLQuantizationType.Q8_0)
    split = blocks.reshape(8, 4, 34)
    d = np.ascontiguousarray(split[..., :2]).view(np.float16)[..., 0]
    qs = np.ascontiguousarray(split[..., 2:]).view(np.int8).reshape(8, 128)
    dequant = quants.dequantize(blocks, GGMLQuantizationType.Q8_0)
    return [_common.save(out_dir, "gguf_q8_0", ("gguf", "numpy"), x=x, blocks=blocks, d=d, qs=qs,
                         dequant=dequant)]
