"""torchao 0.18 MX goldens: ``to_mx`` for MXFP4 / MXFP8 (E4M3, E5M2) under every ScaleCalculationMode.

Each case stores the E8M0 scale bytes and the element bytes (MXFP4 packed two per byte, low nibble
first; MXFP8 as uint8 views) and, for a few, ``to_dtype``'s bfloat16 dequantization (uint16 bits).
Inputs: rows spanning 1e-4..1e4 with a zero block, a tiny block, block amaxes exactly on powers of
two (and just above them, clear of float32 ``log2``'s rounding window) and values that clip; a
float32 "special" input holds NaN, ±Inf and all-zero blocks.
"""

from __future__ import annotations

import numpy as np
import torch
from torchao.prototype.mx_formats.config import ScaleCalculationMode
from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx

from goldens import _common

VENV = "ref"
BLOCK = 32
ELEMENTS = {"mxfp4": torch.float4_e2m1fn_x2, "mxfp8_e4m3": torch.float8_e4m3fn,
            "mxfp8_e5m2": torch.float8_e5m2}
MODES = ("floor", "ceil", "even", "rceil")


def _weights(generator):
    rows, cols = 16, 128
    magnitude = torch.logspace(-4, 4, rows, dtype=torch.float64)[:, None]
    x = (torch.randn(rows, cols, generator=generator, dtype=torch.float64) * magnitude).float()
    x[0, :BLOCK] = 0.0  # an all-zero block
    x[1, :BLOCK] *= 1e-26  # a tiny (still normal) block
    # Block amaxes exactly on 2^k, on max·2^k (rceil's boundary), and one float32 step above them.
    edges = [2.0 ** -3, 2.0 ** 5, 6.0 * 2.0 ** -2, 448.0 * 2.0 ** -9, 57344.0 * 2.0 ** -14]
    for row, edge in enumerate(edges, start=2):
        for block, bump in enumerate((0.0, 2.0 ** -20)):
            span = slice(block * BLOCK, (block + 1) * BLOCK)
            x[row, span] = x[row, span] / x[row, span].abs().max() * 0.9 * edge
            x[row, block * BLOCK + 3] = -edge * (1 + bump)
    return x


def _special():
    x = torch.linspace(-3, 3, 2 * 128, dtype=torch.float32).reshape(2, 128)
    x[0, 5] = float("nan")
    x[0, BLOCK + 7] = float("inf")
    x[0, 2 * BLOCK + 1] = -float("inf")
    x[1, :BLOCK] = 0.0
    x[1, BLOCK + 2] = -0.0
    return x


def _case(x, fmt, mode):
    scale, data = to_mx(x, ELEMENTS[fmt], BLOCK, ScaleCalculationMode(mode))
    return scale.view(torch.uint8).numpy(), data.view(torch.uint8).numpy(), (scale, data)


def _bits(x):
    return x.view(torch.uint16).numpy() if x.dtype == torch.bfloat16 else x.numpy()


def _check_rceil_window():
    """torchao's eager rceil takes ceil(float32 log2): one ulp above 2^-10·max it rounds down."""
    amax = torch.nextafter(torch.tensor(6.0 * 2.0 ** -10), torch.tensor(1.0))
    x = torch.full((1, BLOCK), 0.5 * float(amax))
    x[0, 0] = amax
    scale, _ = to_mx(x, ELEMENTS["mxfp4"], BLOCK, ScaleCalculationMode.RCEIL)
    return int(scale.view(torch.uint8)[0, 0])


def make(out_dir):
    generator = torch.Generator().manual_seed(1170)
    x = _weights(generator)
    inputs = {"x_f32": x, "x_bf16": x.to(torch.bfloat16), "x_special": _special()}
    arrays = {name: _bits(value) for name, value in inputs.items()}
    cases = [("x_f32", fmt, mode) for fmt in ELEMENTS for mode in MODES]
    cases += [("x_bf16", "mxfp4", mode) for mode in ("floor", "rceil")]
    cases += [("x_special", fmt, mode) for fmt in ("mxfp4", "mxfp8_e4m3") for mode in MODES]
    for input_name, fmt, mode in cases:
        scale, data, (scale_t, data_t) = _case(inputs[input_name], fmt, mode)
        key = f"{input_name}_{fmt}_{mode}"
        arrays[f"{key}_scale"] = scale
        arrays[f"{key}_data"] = data
        if input_name != "x_bf16" and mode in ("floor", "rceil"):
            deq = to_dtype(data_t, scale_t, ELEMENTS[fmt], BLOCK, torch.bfloat16)
            arrays[f"{key}_dequant_bf16"] = _bits(deq)
    # Exact ceil would give byte 118 (2^-9); torchao's eager fallback gives 117 (documented in mx.py).
    arrays["rceil_log2_window_scale"] = np.array(_check_rceil_window(), np.uint8)
    return [_common.save(out_dir, "torchao_mx", ("torch", "torchao"), **arrays)]
