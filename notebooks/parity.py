# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Parity with the reference libraries
#
# jquant re-implements the quantizers and checkpoint layouts of torchao, compressed-tensors,
# bitsandbytes, gguf, GPTQModel and transformers in JAX. The claim is bit-exactness: the same codes,
# scales and zero points, byte for byte. This notebook checks it from the goldens those libraries
# wrote (`tests/goldens/*.npz`, produced by `tools/make_goldens.py` in a separate environment that has
# the libraries; the library versions below are read from each file's `meta_versions`). jquant's side
# is recomputed here, on this machine, from the goldens' own inputs, the way `tests/` does it.
#
# Each row of the table is one format and convention; it compares every stored value the golden holds
# for it (codes, scales, zero points, global scales, packed checkpoint tensors and, where the library
# wrote them, its dequantized values):
#
# * **bit-exact**: every compared value has the same bytes (NaN compared as NaN, where a golden
#   leaves a block's codes unspecified that block's codes are left out, as the tests do);
# * **max abs diff**: the largest difference, in each value's own units (codes as integers, scale
#   exponents as E8M0 bytes, floats as floats);
# * rows that are not bit-exact carry the documented reason (README "Parity", the format modules'
#   docstrings). A row that is not bit-exact without a documented reason fails the notebook.
#
# Every quantizer configuration compiles once (about a second on a CPU core), so this notebook takes a
# representative subset of each golden file, one or more cases per format and convention; `tests/`
# checks every case, NaN / Inf at 256×4096 and the real checkpoints the tools wrote
# (`tests/goldens/real/`). The rows say which golden files they read.

# %%
import json
import os
import pathlib

ROOT = next(p for p in (pathlib.Path.cwd(), *pathlib.Path.cwd().parents)
            if (p / "pyproject.toml").is_file() and (p / "jquant").is_dir())
os.chdir(ROOT)

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import ml_dtypes
import numpy as np
from IPython.display import Markdown, display

import jquant
from jquant.checkpoint import from_checkpoint, to_checkpoint
from jquant.formats import bnb, nvfp4
from jquant.formats.integer import int_codes, quantize_int_with_params
from jquant.formats.packing import unpack_bits

plt.rcParams.update({"figure.dpi": 80, "savefig.dpi": 80})
# GPTQ / AWQ / act-order qparams → QTensor, and dequantization, as one compiled program each (op by op,
# eager, they compile dozens of small kernels per shape).
from_qparams = jax.jit(quantize_int_with_params, static_argnums=(1,), static_argnames=("axis", "scale_dtype"))
dequantize = jax.jit(lambda qt, dtype: qt.dequantize(dtype), static_argnums=(1,))
GOLDENS = ROOT / "tests" / "goldens"
print(f"jquant on {jax.devices()[0].platform} ({jax.devices()[0].device_kind}), JAX {jax.__version__}")


def show_table(headers, rows):
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in rows]
    display(Markdown("\n".join(lines)))


# %% [markdown]
# ## How values are compared
#
# `Pair(got, expected)` holds jquant's array and the golden's. Integer arrays compare as integers;
# float arrays bit for bit in their own dtype (a golden stores bfloat16 and FP8 arrays as their
# `uint16` / `uint8` bit patterns, viewed back here). `record` adds one row of the table.

# %%
_loaded = {}


def golden(name):
    if name not in _loaded:
        _loaded[name] = np.load(GOLDENS / f"{name}.npz")
    return _loaded[name]


def library_version(name, library):
    """'torchao 0.18.0' from the golden's meta_versions ('torchao==0.18.0')."""
    for entry in golden(name)["meta_versions"]:
        lib, _, version = str(entry).partition("==")
        if lib == library:
            return f"{lib} {version}"
    raise KeyError(f"{name}.npz names no {library} version")


def bf16(a):
    return a.view(ml_dtypes.bfloat16) if a.dtype == np.uint16 else a


def u8(a):
    return np.asarray(a).view(np.uint8)


def nibbles(packed):
    """The two 4-bit fields of each byte, low first: codes compare as codes."""
    packed = np.asarray(packed).astype(np.uint8)
    return np.stack([packed & 15, packed >> 4], axis=-1)


class Pair:
    def __init__(self, got, expected):
        got, expected = np.asarray(got), np.asarray(expected)
        if got.size != expected.size:
            raise ValueError(f"sizes differ: {got.shape} vs {expected.shape}")
        got, expected = np.atleast_1d(got.reshape(expected.shape)), np.atleast_1d(expected)
        integer = np.issubdtype(got.dtype, np.integer) and np.issubdtype(expected.dtype, np.integer)
        if not integer and got.dtype != expected.dtype:
            # A golden's uint bit pattern of a float dtype (bfloat16, FP8): view it as that dtype.
            if np.issubdtype(expected.dtype, np.unsignedinteger) and expected.itemsize == got.itemsize:
                expected = expected.view(got.dtype)
            elif np.issubdtype(got.dtype, np.unsignedinteger) and expected.itemsize == got.itemsize:
                got = got.view(expected.dtype)
            else:
                raise TypeError(f"cannot compare {got.dtype} with {expected.dtype}")
        g, e = got.astype(np.float64), expected.astype(np.float64)
        if integer:
            same = got.astype(np.int64) == expected.astype(np.int64)
        else:
            raw = np.dtype(f"u{got.itemsize}")
            same = np.ascontiguousarray(got).view(raw) == np.ascontiguousarray(expected).view(raw)
            same |= np.isnan(g) & np.isnan(e)  # NaN is NaN, whatever its payload
        with np.errstate(invalid="ignore", over="ignore"):
            diff = np.abs(g - e)
        diff[g == e] = 0.0  # equal infinities
        diff[np.isnan(g) & np.isnan(e)] = 0.0
        diff[np.isnan(diff)] = np.inf
        self.size, self.differ = int(same.size), int((~same).sum())
        self.max_diff = float(diff.max()) if diff.size else 0.0


ROWS = []


def record(library, fmt, convention, files, pairs, note=""):
    ROWS.append(dict(library=library, format=fmt, convention=convention, goldens=", ".join(files),
                     values=sum(p.size for p in pairs), differ=sum(p.differ for p in pairs),
                     max_diff=max(p.max_diff for p in pairs), note=note))


# %% [markdown]
# ## torchao: FP8 (per tensor, per row, 128×128 blocks)
#
# `jquant.quantize(x, fmt, like="torchao", granularity=...)` on `torchao_fp8.npz` (random inputs) and on
# the adversarial rows of `adversarial_int_fp8.npz` (rounding midpoints, amax a few ulps around powers
# of two, ±0, subnormals, near-max magnitudes, NaN, ±Inf; one row per class, each row its own tensor
# for the per-tensor cases).

# %%
ADV = "adversarial_int_fp8"
FP8_OPTIONS = {"tensor": {"granularity": "tensor"}, "row": {"granularity": "channel"},
               "channel": {"granularity": "channel"}, "token": {"granularity": "channel"},
               "group": {"granularity": "block", "block_size": (1, 32)},  # compressed-tensors' fp8 group
               "block": {"granularity": "block", "block_size": (32, 32)}}
INT_OPTIONS = {"channel": {"granularity": "channel"}, "group": {"group_size": 32}}


def adversarial(case):
    """jquant's codes, scales (and zero points) for one case of the adversarial golden, against it."""
    g = golden(ADV)
    like, fmt, strategy, input_name = (str(v) for v in g[f"config_{case}"])
    x = bf16(g[input_name])
    options = {} if like == "gguf" else (FP8_OPTIONS if fmt.startswith("fp8") else INT_OPTIONS)[strategy]
    parts = ([jquant.quantize(x[i:i + 1], fmt, like=like, **options) for i in range(len(x))]
             if strategy == "tensor" else [jquant.quantize(x, fmt, like=like, **options)])
    offset = 2 ** (int(fmt[4:]) - 1) if fmt.startswith("uint") else 0
    if fmt.startswith("fp8"):
        codes = np.concatenate([np.asarray(q.data) for q in parts])
    else:
        codes = np.concatenate([np.asarray(int_codes(q)) for q in parts]) - offset
    pairs = [Pair(codes, g[f"{case}_codes"]),
             Pair(np.concatenate([np.asarray(q.scale).reshape(-1) for q in parts]), g[f"{case}_scale"].reshape(-1))]
    if f"{case}_zero_point" in g:
        zero = np.concatenate([np.asarray(q.zero).reshape(-1).astype(np.int32) for q in parts]) - offset
        pairs.append(Pair(zero, g[f"{case}_zero_point"]))
    return pairs


def torchao_fp8(case, input_name, fmt, **options):
    g = golden("torchao_fp8")
    qt = jquant.quantize(bf16(g[input_name]), fmt, like="torchao", **options)
    return [Pair(qt.data, g[f"{case}_codes"]), Pair(qt.scale, g[f"{case}_scale"])]


TAO = library_version("torchao_fp8", "torchao")
FILES = ["torchao_fp8", ADV]
record(TAO, "fp8_e4m3", "per row (channel), like='torchao'", FILES,
       torchao_fp8("row_e4m3", "x_f32", "fp8_e4m3", granularity="channel")
       + torchao_fp8("row_bf16_e4m3", "x_bf16", "fp8_e4m3", granularity="channel")
       + adversarial("torchao_row_e4m3"))
record(TAO, "fp8_e5m2", "per row (channel), like='torchao'", FILES,
       torchao_fp8("row_e5m2", "x_f32", "fp8_e5m2", granularity="channel"))
record(TAO, "fp8_e4m3", "per tensor, like='torchao'", FILES,
       torchao_fp8("tensor_e4m3", "x_f32", "fp8_e4m3", granularity="tensor") + adversarial("torchao_tensor_e4m3"))
record(TAO, "fp8_e4m3", "128×128 blocks, bf16 weight, like='torchao'", ["torchao_fp8"],
       torchao_fp8("block_bf16_e4m3", "x_block_bf16", "fp8_e4m3", granularity="block", block_size=(128, 128)))

# %% [markdown]
# ## torchao: MX (MXFP4, MXFP8) in every scale mode
#
# torchao's `to_mx` rounds the shared E8M0 exponent with `floor` (its default, `like="torchao"`),
# `ceil`, `even` or `rceil`; floor and rceil are shown here (ceil and even are in
# `tests/formats/test_mx.py`). torchao's eager `rceil` takes `ceil` of a float32 `log2`, which rounds
# onto an integer just above a power of two: jquant's `scale_mode="rceil_log2f"` reproduces those
# bytes, `scale_mode="rceil"` is the exact ceiling (one scale byte apart there, by design).
#
# MX blocks are independent, so the golden inputs of one element type (`torchao_mx.npz`: random,
# special values; `adversarial_fp4.npz`: subnormal and near-power-of-two blocks) are cut into blocks of
# 32 and quantized in one call. A block whose scale is NaN (byte 255) leaves its codes unspecified:
# those codes are not compared.

# %%
MX_INPUTS = {"mxfp4": ["x_f32", "x_special"], "mxfp8_e4m3": ["x_f32", "x_special"], "mxfp8_e5m2": ["x_f32"]}
MODES = {"mxfp4": ["floor", "rceil"], "mxfp8_e4m3": ["floor", "rceil"], "mxfp8_e5m2": ["floor", "rceil"]}


def mx_case(fmt, mode, scale_mode):
    """Stacked blocks of every golden input that has this (fmt, mode): jquant against torchao."""
    tao, adv = golden("torchao_mx"), golden("adversarial_fp4")
    keys = [(tao, f"{name}_{fmt}_{mode}", tao[name]) for name in MX_INPUTS[fmt]]
    keys.append((adv, f"mx_{fmt}_{mode}", adv["x"]))
    x = np.concatenate([src.reshape(-1, 32) for _, _, src in keys])
    options = {"like": "torchao"} if scale_mode == "floor" else {"scale_mode": scale_mode}
    qt = jquant.quantize(x, fmt, **options)
    scale = np.concatenate([g[f"{key}_scale"].reshape(-1) for g, key, _ in keys])
    data = np.concatenate([g[f"{key}_data"].reshape(g[f"{key}_scale"].size, -1) for g, key, _ in keys])
    finite = scale != 255
    got_data = u8(qt.data).reshape(scale.size, -1)
    if fmt == "mxfp4":
        pairs = [Pair(nibbles(got_data[finite]), nibbles(data[finite]))]
    else:
        element = jnp.dtype(qt.data.dtype)
        pairs = [Pair(got_data[finite].view(element), data[finite].view(element))]
    pairs.append(Pair(u8(qt.scale).reshape(-1), scale))
    out, start = np.asarray(qt.dequantize(jnp.bfloat16)), 0
    for g, key, src in keys:  # each input's blocks, back in its shape
        rows = src.size // 32
        if f"{key}_dequant_bf16" in g:
            pairs.append(Pair(out[start:start + rows].reshape(src.shape), g[f"{key}_dequant_bf16"]))
        start += rows
    return pairs


TAO = library_version("torchao_mx", "torchao")
FILES = ["torchao_mx", "adversarial_fp4"]
for fmt, modes in MODES.items():
    for mode in modes:
        scale_mode = "rceil_log2f" if mode == "rceil" else mode
        pairs = mx_case(fmt, mode, scale_mode)
        convention = ("scale floor, like='torchao'" if mode == "floor"
                      else f"scale {mode}" + (" (scale_mode='rceil_log2f': torchao's eager log2)"
                                              if mode == "rceil" else ""))
        record(TAO, fmt, convention, FILES, pairs)
for fmt in ("mxfp4",):
    record(TAO, fmt, "scale_mode='rceil' (exact ceiling) against torchao's eager rceil", FILES,
           mx_case(fmt, "rceil", "rceil"),
           note="by design: the exact ceil(log2); torchao's float32 log2 rounds onto an integer just above "
                "a power of two, one scale byte lower (and that block's codes follow)")

# %% [markdown]
# ## torchao / ModelOpt: NVFP4
#
# torchao's `NVFP4Tensor` follows NVIDIA ModelOpt's convention (`like="modelopt"`, also
# `like="torchao"`): a per-tensor FP32 scale computed from amax ("tensor"), given ("static") or none.
# On the adversarial rows, tensors whose amax is below 2688 · 2^-126 get a subnormal per-tensor scale
# in torchao; XLA flushes subnormals, so jquant uses 1 there (README, Parity).

# %%
def torchao_nvfp4(input_name, case):
    g = golden("torchao_nvfp4")
    key = f"{input_name}_{case}_"
    global_scale = {"tensor": "dynamic", "static": g.get(key + "per_tensor_scale"), "none": None}[case]
    qt = jquant.quantize(bf16(g[input_name]), "nvfp4", like="modelopt", global_scale=global_scale)
    pairs = [Pair(nibbles(qt.data), nibbles(g[key + "packed"])), Pair(qt.scale, g[key + "scale"]),
             Pair(qt.dequantize(jnp.bfloat16), g[key + "dequant_bf16"]),
             Pair(qt.dequantize(jnp.float32), g[key + "dequant_f32"])]
    if case != "none":
        pairs.append(Pair(qt.global_scale, g[key + "per_tensor_scale"]))
    return pairs


def nvfp4_rows(like, global_scale):
    """The adversarial golden quantizes each row as its own tensor."""
    x = golden("adversarial_fp4")["x"]
    quantize = jax.jit(lambda v: jquant.quantize(v, "nvfp4", like=like, global_scale=global_scale))
    qts = [quantize(x[r:r + 1]) for r in range(x.shape[0])]
    packed = np.stack([np.asarray(q.data) for q in qts])
    scale = np.stack([np.asarray(q.scale) for q in qts])
    glob = None if global_scale is None else np.stack([np.asarray(q.global_scale).reshape(1) for q in qts])
    return packed, scale, glob


TAO = library_version("torchao_nvfp4", "torchao")
adv = golden("adversarial_fp4")
packed, scale, _ = nvfp4_rows("torchao", None)
record(TAO, "nvfp4", "ModelOpt convention, like='modelopt' (global scale dynamic, static or none)",
       ["torchao_nvfp4", "adversarial_fp4"],
       [p for case in ("tensor", "static", "none") for p in torchao_nvfp4("x_f32", case)]
       + [Pair(nibbles(packed), nibbles(adv["torchao_nvfp4_none_packed"])),
          Pair(scale, adv["torchao_nvfp4_none_scale"])])
packed, scale, glob = nvfp4_rows("modelopt", "dynamic")
record(TAO, "nvfp4", "ModelOpt, dynamic global scale on the adversarial rows", ["adversarial_fp4"],
       [Pair(nibbles(packed), nibbles(adv["torchao_nvfp4_dynamic_packed"])),
        Pair(scale, adv["torchao_nvfp4_dynamic_scale"]), Pair(glob, adv["torchao_nvfp4_dynamic_global"])],
       note="documented: per-tensor scale amax / 2688 below 2^-126 (a float32 subnormal, flushed by XLA) "
            "becomes 1 in jquant; every other row is bit-exact")

# %% [markdown]
# ## compressed-tensors: integer pack-quantized, act-order, FP8, NVFP4
#
# `like="compressed-tensors"` replays its arithmetic (bfloat16 weights: every intermediate rounded to
# bfloat16), then `to_checkpoint(qt, "compressed-tensors")` writes the tensors its compressor writes
# (`weight_packed` int32 words, `weight_scale`, `weight_zero_point`, `weight_global_scale`): those are
# compared, on the library's goldens (float32 and bfloat16 weights) and on the float32 adversarial rows
# (their bfloat16 twins are left to the tests, to keep this notebook's compile count down). Act-order
# checkpoints (`weight_g_idx`, compressed-tensors 0.12.2) are read with `from_checkpoint` and
# dequantized against the library's own dequantization.

# %%
CT = library_version("compressed_tensors_int", "compressed-tensors")


def ct_int(case):
    g = golden("compressed_tensors_int")
    bits, group, symmetric, is_bf16 = (int(v) for v in g[f"{case}_config"])
    weight = bf16(g[f"{case}_weight"]) if is_bf16 else g[f"{case}_weight"]
    fmt = f"{'int' if symmetric else 'uint'}{bits}"
    qt = jquant.quantize(weight, fmt, like="compressed-tensors", group_size=None if group == -1 else group)
    tensors = to_checkpoint(qt, "compressed-tensors")
    names = ["weight_packed", "weight_scale"] + ([] if symmetric else ["weight_zero_point"])
    return fmt, [Pair(tensors[n], g[f"{case}_{n}"]) for n in names]


# Six of the golden's eight cases (int4_channel_asym and int8_g64_asym are in the tests).
CT_INT_CASES = ["int4_g32_sym", "int4_g32_asym", "int8_channel_sym", "bf16_int4_g32_sym", "bf16_int4_g32_asym",
                "bf16_int8_channel_asym"]
by_format = {}
for case in CT_INT_CASES:
    fmt, pairs = ct_int(case)
    by_format.setdefault(fmt, []).extend(pairs)
ADV_CASES = {"int4": "ct_int4_group_f32", "uint8": "ct_uint8_channel_f32"}  # the others: tests/
for fmt, pairs in by_format.items():
    if fmt in ADV_CASES:
        pairs = pairs + adversarial(ADV_CASES[fmt])
    record(CT, fmt, "pack-quantized (group, channel; f32 and bf16 weights), like='compressed-tensors'",
           ["compressed_tensors_int"] + ([ADV] if fmt in ADV_CASES else []), pairs)

g = golden("compressed_tensors_actorder")
pairs = []
# Two of the four cases (g32 symmetric, g128 asymmetric); the other two are in the tests.
for case in ["int4_g32_sym", "int4_g128_asym"]:
    bits, group, symmetric = (int(v) for v in g[f"{case}_config"])
    names = [n for n in ("weight_packed", "weight_shape", "weight_g_idx", "weight_zero_point") if f"{case}_{n}" in g]
    tensors = {n: g[f"{case}_{n}"] for n in names} | {"weight_scale": g[f"{case}_scale"]}
    pairs.append(Pair(dequantize(from_checkpoint(tensors, "compressed-tensors"), jnp.float32), g[f"{case}_dequant"]))
    zero = None if symmetric else g[f"{case}_zero_point"].astype(np.int32) + 2 ** (bits - 1)
    qt = from_qparams(g[f"{case}_weight"], bits, g[f"{case}_scale"], zero, g[f"{case}_weight_g_idx"], axis=1)
    written = to_checkpoint(qt, "compressed-tensors")
    pairs += [Pair(written[n], tensors[n]) for n in tensors]
record(library_version("compressed_tensors_actorder", "compressed-tensors"), "int4 / uint4",
       "group act-order (weight_g_idx): load → dequantize, qparams → export", ["compressed_tensors_actorder"],
       pairs)

# FP8: the golden's checkpoint tensors (compressed_tensors_fp8.npz) and the adversarial rows.
CT_FP8 = {"tensor": [("tensor_f32", "x_f32", {"granularity": "tensor"})],
          "channel": [("channel_f32", "x_f32", {"granularity": "channel"}),
                      ("channel_bf16", "x_bf16", {"granularity": "channel"})],
          "block": [("block128_bf16", "x_block_bf16", {"granularity": "block"}),
                    ("block32_f32", "x_block_f32", {"granularity": "block", "block_size": (32, 32)})]}
g = golden("compressed_tensors_fp8")
for strategy, cases in CT_FP8.items():
    pairs = []
    for case, input_name, options in cases:
        qt = jquant.quantize(bf16(g[input_name]), "fp8_e4m3", like="compressed-tensors", **options)
        tensors = to_checkpoint(qt, "compressed-tensors")
        pairs += [Pair(tensors[n], g[f"{case}_{n}"]) for n in ("weight", "weight_scale")]
    pairs += adversarial(f"ct_fp8_{strategy}_f32")
    if strategy == "channel":
        pairs += adversarial("ct_fp8_token_f32")
    label = {"group": "group of 32 (block 1×32)", "block": "blocks (128×128, 32×32)"}.get(strategy, strategy)
    record(CT, "fp8_e4m3", f"float-quantized, {label}", ["compressed_tensors_fp8", ADV] if cases else [ADV], pairs)

# NVFP4: weights (dynamic global scale), the golden's tensors read back, activations with a static
# input_global_scale, and per-row adversarial tensors.
g = golden("compressed_tensors_nvfp4")
pairs = []
for case in ("w_bf16",):  # bfloat16 weights, as checkpoints hold them (w_f32: in the tests)
    tensors = to_checkpoint(jquant.quantize(bf16(g[case]), "nvfp4", like="compressed-tensors"), "compressed-tensors")
    pairs += [Pair(tensors[n], g[f"{case}_{n}"]) for n in ("weight_packed", "weight_scale", "weight_global_scale")]
    stored = {"weight_packed": g[f"{case}_weight_packed"],
              "weight_scale": g[f"{case}_weight_scale"].view(ml_dtypes.float8_e4m3fn),
              "weight_global_scale": g[f"{case}_weight_global_scale"]}
    loaded = from_checkpoint(stored, "compressed-tensors", variant="nvfp4-pack-quantized")
    pairs.append(Pair(loaded.dequantize(jnp.bfloat16), g[f"{case}_dequantized_bf16"]))
for case, ng in (("dynamic", "dynamic"),):
    packed, scale, glob = nvfp4_rows("compressed-tensors", ng)
    pairs += [Pair(nibbles(packed), nibbles(adv[f"ct_nvfp4_{case}_packed"])),
              Pair(scale, adv[f"ct_nvfp4_{case}_scale"])]
    if glob is not None:
        pairs.append(Pair(glob, adv[f"ct_nvfp4_{case}_global"]))
record(CT, "nvfp4", "nvfp4-pack-quantized weights (dynamic global scale), like='compressed-tensors'",
       ["compressed_tensors_nvfp4", "adversarial_fp4"], pairs)
pairs = []
for case in ("act_bf16",):
    x = bf16(g[case])
    input_global_scale = nvfp4.global_scale_from_amax(np.abs(x * x.dtype.type(0.75)).max())
    qt = jquant.quantize(x, "nvfp4", like="compressed-tensors", global_scale=input_global_scale)
    pairs += [Pair(np.asarray(input_global_scale).reshape(1), g[f"{case}_input_global_scale"]),
              Pair(nibbles(qt.data), nibbles(g[f"{case}_packed"])), Pair(qt.scale, g[f"{case}_scale"])]
record(CT, "nvfp4", "activations, static input_global_scale (calibrated amax)", ["compressed_tensors_nvfp4"], pairs)

# %% [markdown]
# ## bitsandbytes: NF4, FP4, double quantization, dynamic 8-bit
#
# `jquant.quantize(x, "nf4" | "fp4_bnb", blocksize=..., compress_statistics=...)` (the bitsandbytes
# defaults are jquant's, `like="bitsandbytes"` sets nothing) on `bitsandbytes_4bit.npz` (float32 and
# bfloat16 inputs, block sizes 32 to 4096, special values) and the adversarial rows; each case is also
# exported with `to_checkpoint(qt, "bnb")` and compared with the tensors `Linear4bit` saves (`weight`,
# `absmax`, `quant_map`, nested statistics, the packed `quant_state` JSON).

# %%
g = golden("bitsandbytes_4bit")
BNB = library_version("bitsandbytes_4bit", "bitsandbytes")
CASES = json.loads(str(g["cases"]))
FMT = {"nf4": "nf4", "fp4": "fp4_bnb"}
# Four of the golden's nine cases (each quantizer compiles once per case): float32 and bfloat16 inputs,
# block sizes 64 and 4096, special values; the other five are in tests/formats/test_bnb.py.
SUBSET = ["nf4_small", "nf4_big_dq", "fp4_small_bs4096", "fp4_special_dq"]
ADV_BNB = {("nf4", False), ("fp4", True)}  # adversarial rows for these two; all four in the tests
rows, blocks = {}, {}
for case in SUBSET:
    params = CASES[case]
    x = g["input__" + params["input"]]
    x = x.view(ml_dtypes.bfloat16) if params["dtype"] == "bfloat16" else x
    qt = jquant.quantize(x, FMT[params["quant_type"]], blocksize=params["blocksize"],
                         compress_statistics=params["compress_statistics"])
    pairs = [Pair(nibbles(qt.data), nibbles(g[f"{case}__weight"].reshape(-1)))]
    if params["compress_statistics"]:
        offset = json.loads(g[f"{case}__quant_state"].tobytes())["nested_offset"]
        pairs += [Pair(qt.scale.data, g[f"{case}__absmax"]), Pair(qt.scale.scale, g[f"{case}__nested_absmax"]),
                  Pair(np.asarray(qt.scale.zero).reshape(1), np.float32([offset]))]
    else:
        pairs.append(Pair(qt.scale, g[f"{case}__absmax"]))
    pairs.append(Pair(qt.dequantize(qt.dtype), g[f"{case}__dequant"]))
    exported = to_checkpoint(qt, "bnb")
    short = {"weight": "weight", "weight.absmax": "absmax", "weight.quant_map": "quant_map",
             "weight.nested_absmax": "nested_absmax", "weight.nested_quant_map": "nested_quant_map",
             f"weight.quant_state.bitsandbytes__{params['quant_type']}": "quant_state"}
    pairs += [Pair(exported[name], g[f"{case}__{s}"]) for name, s in short.items() if f"{case}__{s}" in g]
    key = (params["quant_type"], params["compress_statistics"])
    rows.setdefault(key, []).extend(pairs)
    blocks.setdefault(key, set()).add(params["blocksize"])
for (quant_type, dq), pairs in sorted(rows.items()):
    files = ["bitsandbytes_4bit"]
    if (quant_type, dq) in ADV_BNB:
        qt = jquant.quantize(adv["x"], FMT[quant_type], like="bitsandbytes", compress_statistics=dq)
        key = f"bnb_{quant_type}_{'dq' if dq else 'plain'}_"
        pairs = pairs + [Pair(nibbles(qt.data), nibbles(adv[key + "packed"])),
                         Pair(qt.scale.data if dq else qt.scale, adv[key + "absmax"])]
        files.append("adversarial_fp4")
    sizes = ", ".join(str(b) for b in sorted(blocks[(quant_type, dq)] | {64}))
    record(BNB, FMT[quant_type], ("double quant (nested 8-bit absmax)" if dq else "float32 absmax")
           + f", blocks {sizes}, quantize + Linear4bit export", files, pairs)
qt = jquant.quantize(g["dynamic8__input"], "bnb_dynamic8", blocksize=256)
record(BNB, "bnb_dynamic8", "dynamic 8-bit map, blocks of 256", ["bitsandbytes_4bit"],
       [Pair(bnb.dynamic_map(), g["dynamic8__code"]), Pair(qt.data, g["dynamic8__codes"]),
        Pair(qt.scale, g["dynamic8__absmax"]), Pair(qt.dequantize(), g["dynamic8__dequant"])])

# %% [markdown]
# ## gguf: Q8_0 and MXFP4
#
# `like="gguf"`: Q8_0 is int8 in blocks of 32 with `d = amax / 127` stored as float16 and codes
# `roundf(x · (1/d))`; gguf's MXFP4 rounds E2M1 ties its own way (`element_rounding="ggml"`). Two
# documented deviations on adversarial rows: Q8_0 blocks with `d < 2^-128`, where gguf-py's `1/d`
# overflows and casts ±Inf to int8 (jquant keeps the exact codes; both store `d = 0`, so both
# dequantize to 0), and MXFP4 blocks whose amax is in [2^-126, 2^-125), where gguf's exponent byte
# wraps to 255 (NaN in E8M0; jquant stores 254, which codes the same zeros).

# %%
GGUF = library_version("gguf_q8_0", "gguf")
g = golden("gguf_q8_0")
qt = jquant.quantize(g["x"], "int8", like="gguf")
record(GGUF, "int8 (Q8_0)", "like='gguf'", ["gguf_q8_0"],
       [Pair(qt.scale, g["d"]), Pair(int_codes(qt), g["qs"]), Pair(qt.dequantize(jnp.float32), g["dequant"])])
record(GGUF, "int8 (Q8_0)", "like='gguf', adversarial rows", [ADV], adversarial("gguf_q8_0"),
       note="documented: blocks with d < 2^-128 (amax < ~4e-37): gguf-py casts ±Inf to int8, jquant keeps exact "
            "codes; both store d = 0")


def gguf_scales_codes(blocks, shape):
    blocks = blocks.reshape(*shape[:-1], -1, 17)
    nib = blocks[..., 1:]  # low nibbles: elements 0-15 of the block; high nibbles: 16-31
    return blocks[..., 0], np.concatenate([nib & 15, nib >> 4], axis=-1).reshape(shape)


g = golden("gguf_mxfp4")
qt = jquant.quantize(g["x"], "mxfp4", like="gguf")
scales, codes = gguf_scales_codes(g["gguf_blocks"], g["x"].shape)
record(GGUF, "mxfp4", "like='gguf' (GGML tie rounding)", ["gguf_mxfp4"],
       [Pair(u8(qt.scale), scales), Pair(unpack_bits(qt.data, 4), codes),
        Pair(qt.dequantize(jnp.float32), g["dequantized"])])
qt = jquant.quantize(adv["x"], "mxfp4", like="gguf")
scales, codes = gguf_scales_codes(adv["gguf_blocks"], adv["x"].shape)
record(GGUF, "mxfp4", "like='gguf', adversarial rows", ["adversarial_fp4"],
       [Pair(u8(qt.scale), scales), Pair(unpack_bits(qt.data, 4), codes)],
       note="documented: gguf's wrapped exponent byte 255 (NaN in E8M0) is stored as 254; both decode to zeros")

# %% [markdown]
# ## GPTQModel: GPTQ and AWQ packing
#
# GPTQ and AWQ scales come from their calibration algorithms, so the golden gives GPTQModel's scales,
# zero points and `g_idx`; jquant builds the QTensor from them (`quantize_int_with_params`) and packs it
# with `to_checkpoint(qt, "gptq", checkpoint_format=...)` / `to_checkpoint(qt, "awq")`, then reads the
# tensors back and dequantizes in float16 against GPTQModel's dequantization. GPTQ v1 stores zero
# points minus one: jquant subtracts per 4-bit field; GPTQModel subtracts from the whole int32 word,
# which borrows into the next field where a zero point is 0 (the `zero0` case) — equal otherwise.

# %%
g = golden("gptqmodel_gptq")
GPTQM = library_version("gptqmodel_gptq", "gptqmodel")
v2_pairs, v1_pairs = [], []
# Five of the seven cases: 3-, 4- and 8-bit, act-order, a zero point of 0 (int2 and g64 are in the tests).
for case in ["sym4_g32", "asym3_g32", "sym8_g32", "act4_g32", "zero0_asym4_g32"]:
    bits, _, sym, _ = (int(v) for v in g[f"{case}_config"])
    qt = from_qparams(g[f"{case}_weight"], bits, g[f"{case}_scales"], None if sym else g[f"{case}_zeros"],
                      g[f"{case}_g_idx"], axis=1, scale_dtype=jnp.float16)
    v2 = to_checkpoint(qt, "gptq", checkpoint_format="gptq_v2")
    back = from_checkpoint(v2, "gptq", checkpoint_format="gptq_v2", dtype=jnp.float32)
    v2_pairs += [Pair(v2["qweight"], g[f"{case}_qweight"]), Pair(v2["qzeros"], g[f"{case}_qzeros_v2"]),
                 Pair(v2["scales"], g[f"{case}_scales_fp16"]), Pair(v2["g_idx"], g[f"{case}_g_idx"]),
                 Pair(dequantize(back, jnp.float16), g[f"{case}_dequant"])]
    if g[f"{case}_zeros"].min() > 0:   # v1 (zero - 1) cannot hold a zero point of 0: jquant refuses to write one
        v1 = to_checkpoint(qt, "gptq", checkpoint_format="gptq")
        v1_pairs += [Pair(v1["qweight"], g[f"{case}_qweight"]), Pair(v1["qzeros"], g[f"{case}_qzeros_v1"])]
record(GPTQM, "int3–int8 (GPTQ)", "checkpoint_format='gptq_v2' (act-order g_idx included)", ["gptqmodel_gptq"],
       v2_pairs)
record(GPTQM, "int3–int8 (GPTQ)", "checkpoint_format='gptq' (v1 zero points)", ["gptqmodel_gptq"], v1_pairs,
       note="a zero point of 0 is refused in v1 (vLLM's decoder would read it back as 16; GPTQModel's "
            "word-wide '- 1' borrows into the next field): write gptq_v2")

g = golden("gptqmodel_awq")
pairs = []
for case in sorted({k[:-len("_weight")] for k in g.files if k.endswith("_weight")}):
    qt = from_qparams(g[f"{case}_weight"], 4, g[f"{case}_scales"], g[f"{case}_zeros"], axis=1,
                      scale_dtype=jnp.float16)
    tensors = to_checkpoint(qt, "awq")
    back = from_checkpoint(tensors, "awq", sym=False, dtype=jnp.float32)
    pairs += [Pair(tensors["qweight"], g[f"{case}_qweight"]), Pair(tensors["qzeros"], g[f"{case}_qzeros"]),
              Pair(tensors["scales"], g[f"{case}_scales_fp16"]),
              Pair(dequantize(back, jnp.float16), g[f"{case}_dequant"])]
record(library_version("gptqmodel_awq", "gptqmodel"), "uint4 (AWQ)", "GEMM packing, g32 / g64", ["gptqmodel_awq"],
       pairs)

# %% [markdown]
# ## transformers: gpt-oss MXFP4 experts
#
# gpt-oss stores its MoE experts as MXFP4 `_blocks` / `_scales`; transformers' dequantization returns
# them as `[E, K, N]` bfloat16 (transposed back here). The model-level checks against transformers (its
# forward of SmolLM2 and of all-MiniLM-L6-v2, within a tolerance, and their tokenizers, exact) load
# whole models, so they stay in `tests/models/test_llama.py` and `tests/test_bert.py`.

# %%
g = golden("transformers_gptoss")
TRANSFORMERS = library_version("transformers_gptoss", "transformers")
qt = from_checkpoint({"blocks": g["blocks"], "scales": g["scales"]}, "gpt-oss", dtype=jnp.bfloat16)
expected = g["dequantized_bf16"].view(ml_dtypes.bfloat16).transpose(0, 2, 1)
tensors = to_checkpoint(qt, "gpt-oss")
record(TRANSFORMERS, "mxfp4 (gpt-oss)", "MoE experts _blocks / _scales: load → dequantize → export",
       ["transformers_gptoss"], [Pair(qt.dequantize(qt.dtype), expected), Pair(tensors["blocks"], g["blocks"]),
                                 Pair(tensors["scales"], g["scales"])])

# %% [markdown]
# ## The table

# %%
undocumented = [r for r in ROWS if r["differ"] and not r["note"]]
assert not undocumented, f"not bit-exact without a documented reason: {undocumented}"


def fmt_diff(v):
    return "0" if v == 0 else f"{v:.3g}"


def exact(r):
    return "yes" if not r["differ"] else "no"


show_table(["library", "format", "convention", "values compared", "bit-exact", "values differing", "max abs diff",
            "goldens", "note"],
           [[r["library"], r["format"], r["convention"], f"{r['values']:,}",
             exact(r), f"{r['differ']:,}", fmt_diff(r["max_diff"]), r["goldens"], r["note"]]
            for r in ROWS])
print(f"{len(ROWS)} rows, {sum(r['values'] for r in ROWS):,} values compared; "
      f"{sum(not r['differ'] for r in ROWS)} bit-exact, {sum(bool(r['differ']) for r in ROWS)} documented deviations")

# %% [markdown]
# The same table as a figure: green is bit-exact, orange a documented deviation.

# %%
columns = ["library", "format", "convention", "values", "bit-exact", "differing", "max |diff|"]
cells, colors = [], []
for r in ROWS:
    color = "#cfe8cf" if not r["differ"] else "#fbdcb4"
    convention = r["convention"] if len(r["convention"]) <= 62 else r["convention"][:59] + "…"
    cells.append([r["library"], r["format"], convention, f"{r['values']:,}", exact(r),
                  f"{r['differ']:,}", fmt_diff(r["max_diff"])])
    colors.append([color] * len(columns))
fig, ax = plt.subplots(figsize=(14, 0.27 * len(cells) + 0.8))
ax.axis("off")
table = ax.table(cellText=cells, colLabels=columns, cellColours=colors, loc="upper center", cellLoc="left",
                 colWidths=[0.14, 0.13, 0.43, 0.08, 0.06, 0.07, 0.08])
table.auto_set_font_size(False)
table.set_fontsize(7.5)
table.scale(1, 1.25)
for (row, _), cell in table.get_celld().items():
    if row == 0:
        cell.set_facecolor("#dddddd")
        cell.set_text_props(weight="bold")
ax.set_title("jquant against the reference libraries' goldens (tests/goldens/*.npz)", fontsize=10)
fig.tight_layout()
plt.show()
