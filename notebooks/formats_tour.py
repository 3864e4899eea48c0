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
# # A tour of the formats
#
# What each weight format can represent, and what it costs a tensor: the value grids of the 4-bit
# formats and of FP8, then the quantization error of every registered weight scheme on the same three
# synthetic tensors (Gaussian, heavy-tailed Student-t, Gaussian with a few outlier input channels).
#
# Everything below is computed here, on this machine, through jquant's public API:
# `jquant.quantize` / `jquant.get_scheme(name).quantize_weight` and `QTensor.dequantize`, plus the
# code tables the formats themselves use (`jquant.formats.mx.E2M1_VALUES`, `jquant.formats.bnb.code_table`,
# `jquant.formats.fp8.FP8_DTYPES`). No number is read from a results file.

# %%
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
from jquant.formats import bnb, fp8, mx

plt.rcParams.update({"figure.dpi": 80, "savefig.dpi": 80, "axes.grid": True, "grid.alpha": 0.3})
print(f"jquant on {jax.devices()[0].platform} ({jax.devices()[0].device_kind}), JAX {jax.__version__}")


def show_table(headers, rows):
    """A markdown table in the notebook (plain text when run as a script)."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    display(Markdown("\n".join(lines)))


# %% [markdown]
# ## The grids
#
# A 4-bit format has 16 codes. Where they sit relative to a block's largest magnitude (`amax`) is the
# whole difference between the formats:
#
# * **int4, symmetric** (GPTQ `uint4b8`, `int4_g*`): `scale = amax / 7`, codes −7…7: 15 evenly spaced
#   levels (code −8 is never produced, so `-x` quantizes to `-q`).
# * **int4, asymmetric** (AWQ, `int4_g128_asym`): 16 evenly spaced levels over `[min, max]` (widened to
#   contain 0) with a zero point.
# * **E2M1** (MXFP4, NVFP4): 0, ±0.5, ±1, ±1.5, ±2, ±3, ±4, ±6: a tiny float, denser near zero. MXFP4
#   scales each block of 32 by a power of two (E8M0), NVFP4 each block of 16 by an FP8 E4M3 number
#   times one FP32 per-tensor scale.
# * **NF4** (bitsandbytes): the quantiles of a normal distribution, scaled by the block's absmax.
#
# The transfer curves below are measured, not drawn from formulas: every row of the input is
# `[1, -1, v, v, …]` (one block long), so every block has the same `amax = 1` (and `min = -1`), and
# the dequantized `v` is the format's rounding of `v`.

# %%
N, K = 512, 1024  # one shape for every array below: each scheme compiles its quantizer once


def transfer(quantize, block, probes):
    """Q(v) for each probe v: row i repeats the block [1, -1, v_i, ..., v_i] along K."""
    pattern = np.tile(probes[:, None], (1, block)).astype(np.float32)
    pattern[:, 0], pattern[:, 1] = 1.0, -1.0
    out = np.asarray(quantize(jnp.asarray(np.tile(pattern, (1, K // block)))).dequantize(jnp.float32))
    return out[:, 2]


probes = np.linspace(-1, 1, N, dtype=np.float32)
GRIDS = {
    "int4 sym (g64)": ("int4_g64", 64),
    "int4 asym (g128)": ("int4_g128_asym", 128),
    "MXFP4 (E2M1 × 2^k)": ("mxfp4", 32),
    "NVFP4 (E2M1 × E4M3 × FP32)": ("nvfp4", 16),
    "NF4 (bitsandbytes)": ("nf4", 64),
    "FP4 (bitsandbytes)": ("fp4_bnb", 64),
}
curves = {name: transfer(jquant.get_scheme(scheme).quantize_weight, block, probes)
          for name, (scheme, block) in GRIDS.items()}

fig, axes = plt.subplots(1, 2, figsize=(12, 4.6), gridspec_kw={"width_ratios": [1.25, 1]})
for i, (name, q) in enumerate(curves.items()):
    axes[0].step(probes, q, where="mid", label=name, lw=1.2)
axes[0].plot([-1, 1], [-1, 1], color="k", lw=0.6, ls=":")
axes[0].set(title="transfer curves at amax = 1 (measured through quantize → dequantize)",
            xlabel="input v", ylabel="dequantized Q(v)")
axes[0].legend(fontsize=8)
for i, (name, q) in enumerate(curves.items()):
    levels = np.unique(q)
    axes[1].plot(levels, np.full_like(levels, i), "|", ms=14, mew=2)
    axes[1].text(1.04, i, f"{levels.size} levels", va="center", fontsize=8)
axes[1].set_yticks(range(len(curves)), list(curves), fontsize=8)
axes[1].set(xlim=(-1.05, 1.3), title="distinct levels reached in [-1, 1]", xlabel="value / amax")
axes[1].invert_yaxis()
fig.tight_layout()
plt.show()

# %% [markdown]
# MXFP4's power-of-two scale is `2^(floor(log2 amax) - 2)`: at `amax = 1` the scale is 1/4, so the
# block's largest level is 6/4 = 1.5, which no value reaches: only 13 distinct levels land in [-1, 1].
# As `amax` grows towards 2 under the same scale, `amax / scale` crosses E2M1's gap between 4 and 6
# (the block maximum rounds down by up to 20 % or up by up to 20 %), then passes 6 and saturates
# (down to 0.75 × amax just below 2). NVFP4's E4M3 block scale tracks `amax / 6` within E4M3's
# rounding, and int4's float scale maps the maximum exactly. The largest dequantized value of a block,
# against its amax (rows `[amax, 0.3, 0, …]`, 512 amaxes):

# %%
amaxes = np.linspace(1.0, 4.0, N, dtype=np.float32)
rows = np.zeros((N, K), np.float32)
rows[:, 0] = amaxes
rows[:, 1] = 0.3  # any smaller value: only the block max matters here
for name, scheme in [("MXFP4", "mxfp4"), ("NVFP4", "nvfp4"), ("int4 g32 sym", "int4_g32")]:
    back = np.asarray(jquant.get_scheme(scheme).quantize_weight(jnp.asarray(rows)).dequantize(jnp.float32))
    plt.plot(amaxes, back[:, 0] / amaxes, label=name)
plt.gca().set(xlabel="block amax", ylabel="Q(amax) / amax", title="how the block maximum survives",
              ylim=(0.6, 1.3))
plt.gcf().set_size_inches(7, 3.4)
plt.legend()
plt.show()

# %% [markdown]
# The fixed code books, as the formats store them (`E2M1_VALUES` for MXFP4 / NVFP4,
# `bnb.code_table` for bitsandbytes; int4 symmetric is `q / 7`):

# %%
books = {
    "E2M1 / 6": np.sort(mx.E2M1_VALUES) / mx.E2M1_MAX,
    "NF4": np.sort(bnb.code_table("nf4")),
    "FP4 (bnb)": np.sort(bnb.code_table("fp4_bnb")),
    "int4 sym / 7": np.arange(-7, 8) / 7,
}
fig, ax = plt.subplots(figsize=(9, 2.6))
for i, (name, values) in enumerate(books.items()):
    ax.plot(values, np.full_like(values, i, dtype=float), "o", ms=5)
ax.set_yticks(range(len(books)), list(books))
ax.set(xlabel="value (normalized to the block scale)", title="the 16 codes of each 4-bit code book")
ax.invert_yaxis()
fig.tight_layout()
plt.show()

# %% [markdown]
# ### FP8
#
# FP8 has 256 codes. E4M3 (`float8_e4m3fn`: max 448, no infinities, one NaN per sign) keeps 8 values per
# binade from 2^-6 up, plus 7 subnormals below; E5M2 (max 57344, IEEE-like) trades a mantissa bit for
# range. The histogram counts the finite positive values per power of two:

# %%
fig, ax = plt.subplots(figsize=(10, 3.4))
for name, dtype in fp8.FP8_DTYPES.items():
    values = np.arange(256, dtype=np.uint8).view(ml_dtypes.finfo(dtype).dtype).astype(np.float64)
    positive = values[np.isfinite(values) & (values > 0)]
    print(f"{name}: {np.isfinite(values).sum()} finite codes, {positive.size} positive, "
          f"min subnormal {positive.min():.3g}, max {positive.max():.6g}")
    ax.hist(np.log2(positive), bins=np.arange(-18, 17) - 0.5, alpha=0.6, label=name)
ax.set(xlabel="log2(value)", ylabel="codes per binade", title="FP8 representable positive values")
ax.legend()
fig.tight_layout()
plt.show()

# %% [markdown]
# ## Error on three tensors
#
# Three `[N, K] = [512, 1024]` weights (PyTorch orientation, quantized along K), each scaled to unit
# RMS: a Gaussian; a Student-t with 3 degrees of freedom (heavy tails, as trained weights have); a
# Gaussian whose 4 input channels (columns) are 25× larger, the outlier-channel pattern that hurts
# group-wise quantization. Each scheme quantizes the same arrays; the error is
# `dequantize(quantize(w)) - w`.
#
# Bits per weight count everything a QTensor stores (codes, scales, zero points, nested scales)
# over its element count: `QTensor.bits_per_weight`.

# %%
rng = np.random.default_rng(0)
gauss = rng.standard_normal((N, K))
student = rng.standard_t(3, (N, K))
outliers = rng.standard_normal((N, K))
outliers[:, rng.choice(K, 4, replace=False)] *= 25
TENSORS = {name: (t / np.sqrt(np.mean(t ** 2))).astype(np.float32)
           for name, t in [("Gaussian", gauss), ("Student-t (3)", student), ("outlier channels", outliers)]}

SCHEMES = {
    "int4 g128 sym": jquant.get_scheme("int4_g128"),
    "int4 g128 asym": jquant.get_scheme("int4_g128_asym"),
    "int4 g64 sym": jquant.get_scheme("int4_g64"),
    # No registered name: AWQ's asymmetric g64, built as vLLM would from its quantization_config.
    "int4 g64 asym": jquant.scheme_from_config({"quant_method": "awq", "bits": 4, "group_size": 64,
                                                "zero_point": True, "version": "gemm"}),
    "MXFP4": jquant.get_scheme("mxfp4"),
    "NVFP4": jquant.get_scheme("nvfp4"),
    "NF4": jquant.get_scheme("nf4"),
    "NF4 + double quant": jquant.get_scheme("nf4_dq"),
    "FP8 e4m3 tensor": jquant.get_scheme("fp8_e4m3_tensor"),
    "FP8 e4m3 channel": jquant.get_scheme("fp8_e4m3_channel"),
    "int8 channel": jquant.get_scheme("int8_ch"),
}

results = []  # (scheme, tensor, bits/weight, relative RMS error, max |error|)
for sname, scheme in SCHEMES.items():
    for tname, w in TENSORS.items():
        qw = scheme.quantize_weight(jnp.asarray(w))
        err = np.asarray(qw.dequantize(jnp.float32)) - w
        results.append((sname, tname, qw.bits_per_weight, float(np.sqrt(np.mean(err ** 2))),
                        float(np.abs(err).max())))

show_table(["scheme", "weight format", "bits / weight"] + [f"rel. RMS error: {t}" for t in TENSORS]
           + [f"max abs error: {t}" for t in TENSORS],
           [[s, SCHEMES[s].weight_format, f"{next(r[2] for r in results if r[0] == s):.3f}"]
            + [f"{r[3]:.4f}" for r in results if r[0] == s] + [f"{r[4]:.3f}" for r in results if r[0] == s]
            for s in SCHEMES])

# %% [markdown]
# The tensors have unit RMS, so the RMS error is also relative to the weight's RMS, and the max error is
# in units of it.

# %%
fig, ax = plt.subplots(figsize=(12, 4.2))
width = 0.8 / len(TENSORS)
names = list(SCHEMES)
for j, tname in enumerate(TENSORS):
    vals = [next(r[3] for r in results if r[0] == s and r[1] == tname) for s in names]
    ax.bar(np.arange(len(names)) + (j - 1) * width, vals, width, label=tname)
ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
ax.set(yscale="log", ylabel="relative RMS error", title="quantization error per scheme and tensor")
ax.legend()
fig.tight_layout()
plt.show()

# %% [markdown]
# ## Error against bits per weight
#
# Lower-left is better. The 4-bit formats cluster at 4.1–4.5 bits (the scales are the difference);
# the heavy-tailed and outlier tensors separate them: a group that contains an outlier spends its whole
# grid on it, so finer groups (g64 over g128, NVFP4's 16 over MXFP4's 32) pay for their extra scale bits.

# %%
fig, axes = plt.subplots(1, 2, figsize=(13, 6), gridspec_kw={"width_ratios": [1, 1.4]})
markers = dict(zip(TENSORS, "os^"))
palette = [*plt.cm.tab10.colors, (0.0, 0.0, 0.0)]
colors = {s: palette[i % len(palette)] for i, s in enumerate(SCHEMES)}
for ax, title in zip(axes, ("every scheme", "the 4-bit schemes")):
    for sname, tname, bits, rel, _ in results:
        if title.startswith("the 4-bit") and bits > 5:
            continue
        ax.scatter(bits, rel, marker=markers[tname], color=colors[sname], s=55, edgecolor="k", lw=0.4)
    ax.set(yscale="log", xlabel="bits per weight (codes + scales + zero points)", ylabel="relative RMS error",
           title=f"error vs storage: {title}")
handles = [plt.Line2D([], [], ls="", marker="o", color=colors[s], mec="k", mew=0.4, ms=7, label=s) for s in SCHEMES]
handles += [plt.Line2D([], [], ls="", marker=m, mfc="none", mec="k", ms=7, label=f"tensor: {t}")
            for t, m in markers.items()]
fig.legend(handles=handles, loc="lower center", ncol=5, fontsize=8)
fig.tight_layout(rect=(0, 0.14, 1, 1))
plt.show()
