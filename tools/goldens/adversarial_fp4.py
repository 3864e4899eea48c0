"""Adversarial FP4 / FP8 goldens: torchao 0.18 MX and NVFP4, compressed-tensors 0.20.1 NVFP4 and MX
(its MXFP4A16 / MXFP8A16 weights),
gguf-py MXFP4 and bitsandbytes 0.50.2 NF4 / FP4 (+ double quantization) on inputs chosen to hit
every rounding and range edge.

``x`` is float32 [rows, 64] (``adversarial_rows``): block amaxes 1-3 float32 steps either side of
powers of two (2^-126 .. 2^127) and of max·2^k (the rceil boundaries of E2M1, E4M3, E5M2, down to
the subnormal quotient range), E2M1 rounding midpoints, -0.0, an all-zero row, subnormal rows, a
normal amax over subnormal elements and near-float32-max rows. NVFP4 quantizes each row as its own
tensor (its per-tensor scale then sees that row's amax); MX, gguf and bnb quantize the whole array.

``big`` cases: the [256, 4096] ``hashed_input`` (rebuilt by the tests from its formula) with a NaN
in row 1 and an Inf in row 2; only rows 0-3 of each output are kept, plus per-tensor scales.
"""

from __future__ import annotations

import numpy as np
import torch
import bitsandbytes.functional as F
from compressed_tensors.compressors.nvfp4 import NVFP4PackedCompressor
from compressed_tensors.quantization import QuantizationScheme
from compressed_tensors.quantization.quant_scheme import MXFP4A16, MXFP8A16, NVFP4
from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam
from gguf.constants import GGMLQuantizationType
from gguf.quants import quantize as gguf_quantize
from torchao.prototype.mx_formats.config import ScaleCalculationMode
from torchao.prototype.mx_formats.mx_tensor import to_mx
from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale

from goldens import _common
from goldens.compressed_tensors_mxfp4 import _case as _ct_mxfp4
from goldens.compressed_tensors_mxfp8 import _case as _ct_mxfp8

VENV = "ref"
COLS = 64
MX_ELEMENTS = {"mxfp4": torch.float4_e2m1fn_x2, "mxfp8_e4m3": torch.float8_e4m3fn,
               "mxfp8_e5m2": torch.float8_e5m2}
MX_MODES = ("floor", "ceil", "even", "rceil")
BIG_SHAPE = (256, 4096)
KEEP_ROWS = 4


def _steps(value, steps):
    bits = np.array([value], np.float32).view(np.int32) + np.asarray(steps, np.int32)
    return bits.view(np.float32)


def adversarial_rows():
    rng = np.random.default_rng(7001)
    base = rng.uniform(-0.9, 0.9, COLS).astype(np.float32)
    rows = []

    def with_amax(amax):
        row = (base * np.float32(amax)).astype(np.float32)
        row[3] = -amax
        return row

    # Powers of two (MX floor/ceil/even, gguf's log2f window, bnb's 1/absmax past 2^126).
    for k in (-126, -125, -124, -100, -3, 1, 2, 3, 6, 7, 64, 100, 125, 126, 127):
        rows += [with_amax(a) for a in _steps(2.0 ** k, [-3, -2, -1, 0, 1])]
    # rceil boundaries max·2^k, including quotients in the float32 subnormal range.
    for element_max in (6.0, 448.0, 57344.0):
        for k in (-127, -126, -10):
            rows += [with_amax(a) for a in _steps(element_max * 2.0 ** k, [-1, 0, 1, 2, 3])]
    # NVFP4 block-scale boundaries: amax/6 on E4M3 midpoints (scale 1), global-scale rounding.
    for amax in (6.0 * 1.0625, 6.0 * 1.1875, 6.0 * 0.5, 2688.0, 1000.0, 3.0e-3):
        rows += [with_amax(a) for a in _steps(amax, [-1, 0, 1])]
    # E2M1 midpoints under amax 6 (scale 1), signed; -0.0 and exact zeros.
    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0], np.float32)
    row = np.zeros(COLS, np.float32)
    row[:32] = np.concatenate([ties, -ties, ties * 0.5, -ties * 0.5])
    row[32:40] = -0.0
    rows.append(row)
    rows.append(np.zeros(COLS, np.float32))
    signed_zero = np.zeros(COLS, np.float32)
    signed_zero[::2] = -0.0
    rows.append(signed_zero)
    # Subnormals: a block of them, and a normal amax over subnormal elements.
    tiny = (np.arange(1, COLS + 1, dtype=np.int32) * 97).view(np.float32) * np.where(base < 0, -1, 1)
    rows.append(tiny.astype(np.float32))
    over_tiny = tiny.astype(np.float32).copy()
    over_tiny[0] = np.float32(4.0 * 2.0 ** -126)
    over_tiny[32] = np.float32(1.5 * 2.0 ** -126)
    rows.append(over_tiny)
    # Near float32 max.
    rows.append(with_amax(np.finfo(np.float32).max))
    rows.append(with_amax(np.float32(3.0e38)))
    return np.stack(rows).astype(np.float32)


def hashed_input(shape=BIG_SHAPE):
    """Deterministic pseudo-random float32 in [-2, 2) from an integer hash (exact in numpy)."""
    i = np.arange(int(np.prod(shape)), dtype=np.uint64)
    h = (i * np.uint64(2654435761)) % np.uint64(2 ** 32)
    return ((h.astype(np.float64) / 2.0 ** 32 - 0.5) * 4).astype(np.float32).reshape(shape)


def big_input(kind):
    x = hashed_input()
    if kind in ("nan", "both"):
        x[1, 100] = np.nan
    if kind in ("inf", "both"):
        x[2, 2000] = np.inf
    return x


def _mx(x, fmt, mode):
    scale, data = to_mx(torch.from_numpy(x), MX_ELEMENTS[fmt], 32, ScaleCalculationMode(mode))
    return scale.view(torch.uint8).numpy(), data.view(torch.uint8).numpy()


def _torchao_nvfp4(x, dynamic):
    t = torch.from_numpy(x)
    scale = per_tensor_amax_to_scale(torch.max(torch.abs(t))) if dynamic else None
    qt = NVFP4Tensor.to_nvfp4(t, per_tensor_scale=scale)
    out = {"packed": qt.qdata.view(torch.uint8).numpy(), "scale": qt.scale.view(torch.uint8).numpy()}
    if dynamic:
        out["global"] = scale.reshape(1).numpy()
    return out


def bf16_big_rows():
    """float32 rows, exact in bfloat16, with amaxes 2^126 · (1 + k/128) and up to bf16's largest."""
    base = np.linspace(-0.9, 0.9, COLS, dtype=np.float32)
    amaxes = [2.0 ** 126 * (1 + k / 128) for k in (0, 1, 2, 3, 5, 64, 127)] + [2.0 ** 127 * (1 + k / 128) for k in (0, 1, 77, 127)]
    rows = [(base * np.float32(a)).astype(np.float32) for a in amaxes]
    for row, a in zip(rows, amaxes):
        row[7] = a
    return np.stack(rows)


def _ct_nvfp4_tensor(t, scheme):
    groups = t.unflatten(-1, (t.shape[-1] // 16, 16))
    global_scale = generate_gparam(t.min(), t.max())
    scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights, global_scale=global_scale)
    state = {"weight": t, "weight_scale": scale.to(t.dtype), "weight_global_scale": global_scale}
    compressed = NVFP4PackedCompressor.compress(state, scheme)
    return {"packed": compressed["weight_packed"].numpy(), "scale": compressed["weight_scale"].view(torch.uint8).numpy(),
            "global": global_scale.reshape(1).numpy()}


def _ct_nvfp4(x, scheme, with_global):
    t = torch.from_numpy(x)
    groups = t.unflatten(-1, (t.shape[-1] // 16, 16))
    global_scale = generate_gparam(t.min(), t.max()) if with_global else None
    scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights, global_scale=global_scale)
    state = {"weight": t, "weight_scale": scale}
    if with_global:
        state["weight_global_scale"] = global_scale
    compressed = NVFP4PackedCompressor.compress(state, scheme)
    out = {"packed": compressed["weight_packed"].numpy(), "scale": compressed["weight_scale"].view(torch.uint8).numpy()}
    if with_global:
        out["global"] = global_scale.reshape(1).numpy()
    return out


def _ct_mx(x):
    """compressed-tensors' MXFP4A16 and MXFP8A16 weights of x (one tensor): scales and codes as uint8."""
    t = torch.from_numpy(np.ascontiguousarray(x))
    with np.errstate(all="ignore"):
        mx4 = _ct_mxfp4(t, QuantizationScheme(targets=["Linear"], **MXFP4A16))
        mx8 = _ct_mxfp8(t, QuantizationScheme(targets=["Linear"], **MXFP8A16))
    return {"mxfp4_scale": mx4["weight_scale"], "mxfp4_data": mx4["weight_packed"],
            "mxfp8_e4m3_scale": mx8["weight_scale"], "mxfp8_e4m3_data": mx8["weight"]}


def _bnb(x, quant_type, dq):
    packed, state = F.quantize_4bit(torch.from_numpy(x), blocksize=64, compress_statistics=dq, quant_type=quant_type)
    out = {"packed": packed.numpy().reshape(-1)}
    if dq:
        out.update(absmax=state.absmax.numpy(), nested_absmax=state.state2.absmax.numpy(),
                   offset=state.offset.reshape(1).numpy())
    else:
        out["absmax"] = state.absmax.numpy()
    return out


def _per_row(x, fn):
    rows = [fn(row[None]) for row in x]
    return {key: np.stack([r[key] for r in rows]) for key in rows[0]}


def make(out_dir):
    torch.set_num_threads(1)  # bnb's double-quant offset is a float32 torch mean
    scheme = QuantizationScheme(targets=["Linear"], **NVFP4)
    x = adversarial_rows()
    arrays = {"x": x}
    for fmt in MX_ELEMENTS:
        for mode in MX_MODES:
            arrays[f"mx_{fmt}_{mode}_scale"], arrays[f"mx_{fmt}_{mode}_data"] = _mx(x, fmt, mode)
    for name, value in _ct_mx(x).items():
        arrays[f"ct_mx_{name}"] = value
    with np.errstate(all="ignore"):
        arrays["gguf_blocks"] = gguf_quantize(x, GGMLQuantizationType.MXFP4)
    for name, value in _per_row(x, lambda r: _torchao_nvfp4(r, True)).items():
        arrays[f"torchao_nvfp4_dynamic_{name}"] = value
    for name, value in _per_row(x, lambda r: _torchao_nvfp4(r, False)).items():
        arrays[f"torchao_nvfp4_none_{name}"] = value
    for name, value in _per_row(x, lambda r: _ct_nvfp4(r, scheme, True)).items():
        arrays[f"ct_nvfp4_dynamic_{name}"] = value
    for name, value in _per_row(x, lambda r: _ct_nvfp4(r, scheme, False)).items():
        arrays[f"ct_nvfp4_none_{name}"] = value
    # bfloat16 tensors with amax past 2^126: the reciprocal is rounded to bf16's subnormal grid.
    x_bf16 = torch.from_numpy(bf16_big_rows()).to(torch.bfloat16)
    arrays["x_bf16_big"] = x_bf16.view(torch.uint16).numpy()
    rows = [_ct_nvfp4_tensor(row[None], scheme) for row in x_bf16]
    for name in rows[0]:
        arrays[f"ct_nvfp4_bf16_big_{name}"] = np.stack([r[name] for r in rows])
    for quant_type in ("nf4", "fp4"):
        for dq in (False, True):
            for name, value in _bnb(x, quant_type, dq).items():
                arrays[f"bnb_{quant_type}_{'dq' if dq else 'plain'}_{name}"] = value
    # Realistic sizes with one NaN (row 1) and one Inf (row 2), each alone and together.
    for kind in ("nan", "inf", "both"):
        big = big_input(kind)
        for fmt, mode in (("mxfp4", "floor"), ("mxfp4", "rceil"), ("mxfp8_e4m3", "floor")):
            scale, data = _mx(big, fmt, mode)
            arrays[f"big_{kind}_mx_{fmt}_{mode}_scale"] = scale[:KEEP_ROWS]
            arrays[f"big_{kind}_mx_{fmt}_{mode}_data"] = data[:KEEP_ROWS]
        for name, value in _ct_mx(big).items():
            arrays[f"big_{kind}_ct_mx_{name}"] = value[:KEEP_ROWS]
        for name, value in _torchao_nvfp4(big, True).items():
            arrays[f"big_{kind}_torchao_nvfp4_{name}"] = value if name == "global" else value[:KEEP_ROWS]
        for name, value in _ct_nvfp4(big, scheme, True).items():
            arrays[f"big_{kind}_ct_nvfp4_{name}"] = value if name == "global" else value[:KEEP_ROWS]
        for quant_type in ("nf4", "fp4"):
            for dq in (False, True):
                out = _bnb(big, quant_type, dq)
                key = f"big_{kind}_bnb_{quant_type}_{'dq' if dq else 'plain'}"
                arrays[f"{key}_packed"] = out["packed"].reshape(BIG_SHAPE[0], -1)[:KEEP_ROWS]
                arrays[f"{key}_absmax"] = out["absmax"].reshape(BIG_SHAPE[0], -1)[:KEEP_ROWS]
                if dq:
                    arrays[f"{key}_nested_absmax"] = out["nested_absmax"]
                    arrays[f"{key}_offset"] = out["offset"]
    return [_common.save(out_dir, "adversarial_fp4", ("torch", "torchao", "compressed-tensors", "gguf",
                                                       "bitsandbytes"), **arrays)]
