"""transformers 5.24 gpt-oss MXFP4 goldens: ``convert_moe_packed_tensors`` (the function that turns a
checkpoint's ``*_blocks`` / ``*_scales`` into bf16 expert weights) on random expert tensors.

``blocks`` uint8 [E, N, K/32, 16] are random bytes (every E2M1 code); ``scales`` uint8 [E, N, K/32]
are biased exponents around 127 (2^-12..2^12). transformers returns the experts transposed to
[E, K, N]; the golden stores that output as bf16 bits.
"""

from __future__ import annotations

import numpy as np
import torch
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from goldens import _common

VENV = "ref"


def make(out_dir):
    rng = np.random.default_rng(5120)
    experts, rows, groups = 2, 24, 4  # K = 4 · 32 = 128
    blocks = rng.integers(0, 256, (experts, rows, groups, 16), dtype=np.uint8)
    scales = rng.integers(127 - 12, 127 + 13, (experts, rows, groups), dtype=np.uint8)
    out = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                     dtype=torch.bfloat16)
    assert out.shape == (experts, groups * 32, rows)
    return [_common.save(out_dir, "transformers_gptoss", ("transformers", "torch"), blocks=blocks,
                         scales=scales, dequantized_bf16=out.view(torch.uint16).numpy())]
