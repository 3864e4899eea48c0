"""Adversarial int / FP8 goldens: torchao 0.18, compressed-tensors 0.20.1 and gguf-py on inputs built to
break bit-exactness (quotients on rounding midpoints, amax a few ulps around powers of two, -0.0,
all-zero rows and groups, subnormals, magnitudes near float32's max, ±Inf, NaN).

One input ``x`` (float32 [R, 64], one adversarial class per row, ``row_names``) and its bfloat16
rounding ``x_bf16`` (uint16 bits). Per case ``<case>_codes`` (FP8 as uint8 bits; ints signed, int8),
``<case>_scale`` (float32 or, for bfloat16 inputs, uint16 bits) and, asymmetric ints,
``<case>_zero_point`` (signed int8, compressed-tensors' convention). ``tensor`` cases quantize each row
as its own tensor (a whole-input scale would be set by one row). ``config_<case>`` names the library,
the options and the input; the tests map each to a jquant preset.
"""

from __future__ import annotations

import numpy as np

from goldens import _common

VENV = "ref"
COLS = 64
E4M3_MAX, E5M2_MAX = 448.0, 57344.0


def _fp8_midpoints(rng, dtype, limit):
    """Values half-way between neighbouring finite FP8 numbers of one row whose amax is ``limit``
    (scale exactly 1), with random signs."""
    import torch

    codes = torch.arange(256, dtype=torch.uint8).view(dtype).to(torch.float32).numpy()
    grid = np.unique(codes[np.isfinite(codes) & (codes >= 0)])
    i = rng.integers(0, len(grid) - 1, COLS)
    mid = (grid[i] + grid[i + 1]) / 2
    mid *= rng.choice([-1.0, 1.0], COLS)
    mid[0] = limit
    return mid.astype(np.float32)


def _half_integers(rng, amax):
    row = (rng.integers(-int(amax), int(amax), COLS) + 0.5).astype(np.float32)
    row[0] = amax
    return row


def _rows():
    rng = np.random.default_rng(20261203)
    f32 = np.float32
    tiny = np.finfo(f32).smallest_subnormal
    rows = {}
    rows["normal"] = rng.standard_normal(COLS).astype(f32)
    rows["normal_1e3"] = (rng.standard_normal(COLS) * 1e3).astype(f32)
    rows["mid_fp8_e4m3"] = _fp8_midpoints(rng, __import__("torch").float8_e4m3fn, E4M3_MAX)
    rows["mid_fp8_e5m2"] = _fp8_midpoints(rng, __import__("torch").float8_e5m2, E5M2_MAX)
    for amax in (7.0, 7.5, 127.0, 127.5):
        rows[f"mid_int_amax{amax}"] = _half_integers(rng, amax)
    asym = (rng.integers(-8, 7, COLS) + 0.5).astype(f32)
    asym[:2] = -7.5, 7.5  # hi - lo = 15: scale 1, zero point -8 + 7.5 = -0.5, a tie
    rows["mid_int_asym"] = asym
    for e, ulps in ((0, 1), (0, -1), (-3, 2), (8, -3), (9, 3), (-20, 1)):
        row = (rng.uniform(-1, 1, COLS) * 2.0 ** e).astype(f32)
        row[5] = np.nextafter(f32(2.0 ** e), f32(np.inf) if ulps > 0 else f32(0))
        for _ in range(abs(ulps) - 1):
            row[5] = np.nextafter(row[5], f32(np.inf) if ulps > 0 else f32(0))
        rows[f"pow2_{e}_ulps{ulps:+d}"] = row
    neg_zero = rng.standard_normal(COLS).astype(f32)
    neg_zero[::2] = -0.0
    neg_zero[1:8:2] = -1e-9  # quotients that round to zero
    rows["neg_zero"] = neg_zero
    rows["all_zero"] = np.zeros(COLS, f32)
    rows["all_neg_zero"] = np.full(COLS, -0.0, f32)
    groups = rng.standard_normal(COLS).astype(f32)
    groups[:32] = 0.0
    groups[32:48] = -0.0
    rows["zero_group"] = groups
    rows["subnormal_only"] = (rng.integers(-2 ** 20, 2 ** 20, COLS) * tiny).astype(f32)
    rows["subnormal_smallest"] = (rng.integers(-3, 4, COLS) * tiny).astype(f32)
    rows["scale_subnormal"] = (rng.standard_normal(COLS) * 1e-37).astype(f32)
    mixed = (rng.standard_normal(COLS) * 2.0 ** -118).astype(f32)
    mixed[::3] = (rng.integers(-2 ** 22, 2 ** 22, len(mixed[::3])) * tiny).astype(f32)
    rows["mixed_subnormal"] = mixed
    rows["near_max"] = (rng.uniform(-1, 1, COLS) * 3.4e38).astype(f32)
    rows["near_max_positive"] = (rng.uniform(0.5, 1, COLS) * np.finfo(f32).max).astype(f32)
    rows["near_max_e4m3_saturate"] = (rng.uniform(-1, 1, COLS) * 3e38).astype(f32)
    rows["near_max_e4m3_saturate"][:2] = np.finfo(f32).max, -np.finfo(f32).max
    inf = rng.standard_normal(COLS).astype(f32)
    inf[3], inf[40] = np.inf, -np.inf
    rows["inf"] = inf
    nan = rng.standard_normal(COLS).astype(f32)
    nan[7] = np.nan
    rows["nan"] = nan
    return rows


def _np(t):
    import torch

    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return t.view(torch.uint8).numpy()
    if t.dtype == torch.bfloat16:
        return t.view(torch.uint16).numpy()
    return t.numpy()


def _torchao(x, granularity, dtype):
    import torch
    from torchao.quantization.granularity import PerRow, PerTensor
    from torchao.quantization.quantize_.common.kernel_preference import KernelPreference
    from torchao.quantization.quantize_.workflows.float8.float8_tensor import Float8Tensor

    float8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[dtype]
    rows = [x[i:i + 1] for i in range(x.shape[0])] if granularity == "tensor" else [x]
    codes, scales = [], []
    for part in rows:
        qt = Float8Tensor.from_hp(part, float8_dtype=float8, granularity=PerTensor() if granularity == "tensor"
                                  else PerRow(), kernel_preference=KernelPreference.TORCH)
        codes.append(_np(qt.qdata))
        scales.append(qt.scale.to(torch.float32).reshape(-1).numpy())
    return {"codes": np.concatenate(codes), "scale": np.concatenate(scales)}


def _ct_args(kind, strategy, bits=8, symmetric=True, group=None):
    from compressed_tensors.quantization import QuantizationArgs

    extra = {"group_size": group} if strategy == "group" else {}
    if strategy == "block":
        extra = {"block_structure": [group, group]}
    return QuantizationArgs(num_bits=bits, type=kind, symmetric=symmetric, strategy=strategy, **extra)


def _ct(x, args, strategy, group=None):
    import torch
    import torch.nn.functional as F
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    rows = [x[i:i + 1] for i in range(x.shape[0])] if strategy == "tensor" else [x]
    out = {"codes": [], "scale": [], "zero_point": []}
    for part in rows:
        if strategy == "tensor":
            lo, hi = torch.aminmax(part)
        elif strategy in ("channel", "token"):
            lo, hi = part.amin(1, keepdim=True), part.amax(1, keepdim=True)
        elif strategy == "group":
            grouped = part.reshape(part.shape[0], -1, group)
            lo, hi = grouped.amin(-1), grouped.amax(-1)
        else:  # block: pad to whole blocks as compressed-tensors does
            padded = F.pad(part, (0, -part.shape[1] % group, 0, -part.shape[0] % group))
            blocks = padded.reshape(padded.shape[0] // group, group, padded.shape[1] // group, group)
            lo, hi = blocks.amin(dim=(1, 3)), blocks.amax(dim=(1, 3))
        scale, zero_point = calculate_qparams(lo, hi, args)
        dtype = torch.float8_e4m3fn if args.type == "float" else torch.int8
        codes = quantize(part, scale, zero_point, args, dtype=dtype)
        out["codes"].append(_np(codes))
        out["scale"].append(_np(scale).reshape(-1))
        out["zero_point"].append(zero_point.to(torch.int8).reshape(-1).numpy())
    result = {k: np.concatenate(v) for k, v in out.items()}
    if args.type == "float" or args.symmetric:
        del result["zero_point"]
    return result


def _gguf_q8_0(x):
    from gguf import GGMLQuantizationType, quants

    with np.errstate(invalid="ignore", over="ignore"):
        blocks = quants.quantize(x, GGMLQuantizationType.Q8_0).reshape(x.shape[0], -1, 34)
    scale = np.ascontiguousarray(blocks[..., :2]).view(np.float16)[..., 0]
    codes = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(x.shape)
    return {"codes": codes, "scale": scale}


def make(out_dir):
    import torch

    rows = _rows()
    x = np.stack(list(rows.values()))
    x_t = torch.from_numpy(x)
    x_bf16 = x_t.to(torch.bfloat16)
    arrays = {"x": x, "x_bf16": _np(x_bf16), "row_names": np.array(list(rows))}
    cases = {}
    for dtype in ("e4m3", "e5m2"):
        for granularity in ("tensor", "row"):
            cases[f"torchao_{granularity}_{dtype}"] = (("torchao", f"fp8_{dtype}", granularity, "x"),
                                                        _torchao(x_t, granularity, dtype))
    cases["torchao_row_e4m3_bf16"] = (("torchao", "fp8_e4m3", "row", "x_bf16"), _torchao(x_bf16, "row", "e4m3"))
    for name, source in (("f32", x_t), ("bf16", x_bf16)):
        for strategy, group in (("tensor", None), ("channel", None), ("token", None), ("group", 32),
                                ("block", 32)):
            args = _ct_args("float", "channel" if strategy == "token" else strategy, group=group)
            cases[f"ct_fp8_{strategy}_{name}"] = (("compressed-tensors", "fp8_e4m3", strategy, f"x_{name}"
                                                   if name == "bf16" else "x"), _ct(source, args, strategy, group))
        for bits in (4, 8):
            for symmetric in (True, False):
                for strategy, group in (("channel", None), ("group", 32)):
                    fmt = f"{'int' if symmetric else 'uint'}{bits}"
                    args = _ct_args("int", strategy, bits, symmetric, group)
                    cases[f"ct_{fmt}_{strategy}_{name}"] = (
                        ("compressed-tensors", fmt, strategy, "x_bf16" if name == "bf16" else "x"),
                        _ct(source, args, strategy, group))
    cases["gguf_q8_0"] = (("gguf", "int8", "group", "x"), _gguf_q8_0(x))
    for case, (config, result) in cases.items():
        arrays[f"config_{case}"] = np.array(config)
        arrays.update({f"{case}_{key}": value for key, value in result.items()})
    return [_common.save(out_dir, "adversarial_int_fp8", ("torch", "torchao", "compressed-tensors", "gguf"),
                         **arrays)]
