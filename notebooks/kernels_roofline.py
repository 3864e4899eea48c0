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
# # The kernels against their rooflines
#
# Every number here is read from the committed benchmark records, `bench/results/h200/*.json`: one
# `jquant bench` command each, on one NVIDIA H200 (the command and commit of each file are in
# `bench/results/h200/README.md`; the method and record format in `bench/README.md`). Nothing is
# measured on this machine. Each record names its device, commit, date and JAX version; the table
# below lists them, so a figure can be traced back to the run that made it.
#
# The floors:
#
# * **bytes**: a call that only streamed the bytes it must read and write at the H200's HBM rate.
#   The records' `pct_of_byte_floor` / `byte_floor_us` use 4.18 TB/s
#   (`jquant.bench.timing.H200_HBM_BYTES_PER_S`, an f32 `x + 1` over 4 GiB measured when the harness
#   was written; the decode records carry the rate their own run measured, `hbm_tb_per_s`).
# * **FLOPs**: for the 4-bit GEMM, the H200's dense BF16 tensor-core peak from NVIDIA's spec sheet
#   (989 TFLOP/s; a datasheet figure, not measured here), drawn so the roofline has its ridge.

# %%
import collections
import json
import os
import pathlib

ROOT = next(p for p in (pathlib.Path.cwd(), *pathlib.Path.cwd().parents)
            if (p / "pyproject.toml").is_file() and (p / "jquant").is_dir())
os.chdir(ROOT)

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from IPython.display import Markdown, display

from jquant.bench.timing import H200_HBM_BYTES_PER_S

plt.rcParams.update({"figure.dpi": 80, "savefig.dpi": 80, "axes.grid": True, "grid.alpha": 0.3})
RESULTS = ROOT / "bench" / "results" / "h200"
H200_BF16_DENSE_PEAK = 989e12  # FLOP/s, NVIDIA H200 SXM datasheet (dense, no sparsity): not a measurement
HBM = H200_HBM_BYTES_PER_S


def show_table(headers, rows):
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    display(Markdown("\n".join(lines)))


RECORDS = {path.stem: json.loads(path.read_text()) for path in sorted(RESULTS.glob("*.json"))}
# Records name their op; the gptq and moe files of record name their benchmark under `bench`.
show_table(["file", "op", "records", "device", "commit", "date (UTC)", "JAX", "XLA_FLAGS"],
           [[f"`{stem}.json`", ", ".join(sorted({r.get("op", r.get("bench")) for r in recs})), len(recs),
             ", ".join(sorted({r["device"] for r in recs})), ", ".join(sorted({r["commit"] for r in recs})),
             " … ".join(sorted({min(r["date"][:16] for r in recs), max(r["date"][:16] for r in recs)})),
             ", ".join(sorted({r["jax_version"] for r in recs})),
             ", ".join(sorted({r.get("xla_flags", "") for r in recs})) or ""]
            for stem, recs in RECORDS.items()])

# %% [markdown]
# ## W4A16: 4-bit weight GEMM (`w4a16.json`)
#
# One record per cell (scheme, N×K, M): `Scheme.apply` timed with XLA's bf16 GEMM (`xla_bf16`,
# `jnp.dot` with W in bf16) and XLA's dequantize + dot (`xla_dequant_dot`) interleaved in the same run.
# The kernel's bytes and FLOPs come from the record (`tb_per_s` and `tflop_per_s` times `time_us`);
# the bf16 baseline's are counted from the shape: `2·M·N·K` FLOPs over `2·N·K + 2·M·K + 2·M·N` bytes
# (W, x and the output in bf16). Left: the classic roofline (FLOP/s against FLOP per byte). Right: time
# against M, each shape with its byte floor (the bytes the kernel reads at 4.18 TB/s).

# %%
w4 = RECORDS["w4a16"]
shapes = sorted({(r["N"], r["K"]) for r in w4}, key=lambda s: -s[0] * s[1])
shape_color = {s: c for s, c in zip(shapes, plt.cm.tab10.colors)}
scheme_marker = {"int4_g128": "o", "mxfp4": "s", "nvfp4": "^", "nf4": "D"}

fig, (ax, ax2) = plt.subplots(1, 2, figsize=(15, 5.6))
intensity = np.logspace(-0.5, 4, 200)
ax.plot(intensity, np.minimum(intensity * HBM, H200_BF16_DENSE_PEAK) / 1e12, "k-", lw=1.2,
        label=f"roof: {HBM / 1e12:.2f} TB/s × I, capped at {H200_BF16_DENSE_PEAK / 1e12:.0f} TFLOP/s")
for r in w4:
    seconds = r["time_us"] * 1e-6
    flops, nbytes = r["tflop_per_s"] * 1e12 * seconds, r["tb_per_s"] * 1e12 * seconds
    color = shape_color[(r["N"], r["K"])]
    ax.scatter(flops / nbytes, r["tflop_per_s"], color=color, marker=scheme_marker.get(r["scheme"], "x"),
               s=36, edgecolor="k", lw=0.4, zorder=3)
    if r["scheme"] == "int4_g128":
        m, n, k = r["M"], r["N"], r["K"]
        bf16_bytes = 2 * n * k + 2 * m * k + 2 * m * n
        ax.scatter(2 * m * n * k / bf16_bytes, 2 * m * n * k / (r["baselines"]["xla_bf16"] * 1e-6) / 1e12,
                   facecolor="none", edgecolor=color, marker="o", s=36, zorder=2)
for s in shapes:
    ax.scatter([], [], color=shape_color[s], marker="o", label=f"N×K {s[0]}×{s[1]}")
for name, m in scheme_marker.items():
    ax.scatter([], [], color="grey", marker=m, label=f"kernel: {name}")
ax.scatter([], [], facecolor="none", edgecolor="grey", marker="o", label="XLA bf16 GEMM (same cell)")
ax.set(xscale="log", yscale="log", xlabel="arithmetic intensity (FLOP / byte)", ylabel="TFLOP/s",
       title="W4A16 roofline, H200 (points: M = 1 … 4096)")
ax.legend(fontsize=7, loc="lower right")

for s in shapes:
    rows = sorted((r for r in w4 if (r["N"], r["K"]) == s and r["scheme"] == "int4_g128"), key=lambda r: r["M"])
    if not rows:
        continue
    ms = [r["M"] for r in rows]
    color = shape_color[s]
    ax2.plot(ms, [r["time_us"] for r in rows], "o-", color=color, label=f"{s[0]}×{s[1]} kernel (Scheme.apply)")
    ax2.plot(ms, [r["baselines"]["xla_bf16"] for r in rows], "s--", color=color, alpha=0.6, ms=4)
    floor = [r["tb_per_s"] * r["time_us"] / (HBM / 1e12) for r in rows]  # bytes / HBM rate, in µs
    ax2.plot(ms, floor, ":", color=color, lw=1.5)
ax2.plot([], [], "k--", label="XLA bf16 GEMM (dashed)")
ax2.plot([], [], "k:", label="byte floor of the 4-bit call (dotted)")
ax2.set(xscale="log", yscale="log", xlabel="M (rows of x)", ylabel="µs per call",
        title="int4_g128: time against M, bf16 baseline and byte floor")
ax2.legend(fontsize=7)
fig.tight_layout()
plt.show()

best = max((r for r in w4 if r["M"] == 1), key=lambda r: r["pct_of_byte_floor"])
print(f"best M = 1 cell: {best['scheme']} {best['N']}×{best['K']}: {best['time_us']} µs, "
      f"{best['pct_of_byte_floor']} % of the byte floor, {best['speedup_vs_bf16']}× XLA bf16 "
      f"(w4a16.json, commit {best['commit']})")

bf16_m1 = max(2 * r["N"] * r["K"] / (r["baselines"]["xla_bf16"] * 1e-6) / 1e12 for r in w4
              if r["M"] == 1 and r["scheme"] == "int4_g128")
print(f"XLA bf16 GEMM at M = 1 streams its weight at up to {bf16_m1:.2f} TB/s "
      f"(the roof's {HBM / 1e12:.2f} TB/s is a measured copy rate, not a hard ceiling)")

# %% [markdown]
# Below M ≈ 128 the 4-bit kernel sits on the bandwidth slope, at the fraction of the byte floor the
# records give (`pct_of_byte_floor`); XLA's bf16 GEMM reads four times the weight bytes, so its points
# sit at a quarter of the intensity, on the roof. From M = 256 the bf16 GEMM is the faster path on these
# shapes (what `w4a16_impl` encodes: `auto` runs XLA above M = 1024, or above 128 for weights under
# 8192×8192).

# %% [markdown]
# ## 8-bit GEMMs (`gemm8.json`) and the MoE layer (`moe.json`)
#
# `gemm8.json`: each 8-bit scheme as `Scheme.apply` runs it (`scheme`), the W8A16 kernel forced
# (`mgpu`) and XLA's path for the same math (`xla`), with XLA bf16 in the same run; `pct_of_byte_floor`
# is the scheme's bytes (codes, scales, x, y) at 4.18 TB/s over its time. `moe.json`: one gpt-oss-20b
# MoE layer, the grouped W4A16 kernel against bf16 `ragged_dot` and the dequantize + `ragged_dot`
# reference; the byte floor counts the experts the routing hits.

# %%
g8 = RECORDS["gemm8"]
show_table(["scheme", "N×K", "M", "impl", "µs", "XLA bf16 µs", "vs bf16", "% byte floor", "TFLOP/s"],
           [[r["scheme"], f"{r['N']}×{r['K']}", r["M"], r["impl"], r["time_us"], r["baselines"]["xla_bf16"],
             r["speedup_vs_bf16"], r["pct_of_byte_floor"], r["tflop_per_s"]]
            for r in sorted(g8, key=lambda r: (-r["N"] * r["K"], r["M"], r["scheme"], r["impl"]))
            if r["impl"] != "scheme" or r["w8a8"]])

moe = RECORDS["moe"]
show_table(["format", "tokens", "experts hit", "grouped kernel µs", "dequant + ragged_dot µs",
            "bf16 ragged_dot µs", "kernel vs bf16", "byte floor µs"],
           [[r["format"], r["tokens"], r["active_experts"], r["baselines"].get("grouped_kernel"),
             r["baselines"]["dequant_ragged_dot"], r["baselines"]["bf16_ragged_dot"],
             r["grouped_kernel_speedup_vs_bf16"], r["byte_floor_us"]] for r in moe])

# %% [markdown]
# At M = 1 the W8A16 kernel reads its 8-bit weight at about 80 % of the byte floor, 1.6× XLA bf16 (the
# floor allows about 2×); XLA's own path for the same weight dequantizes to bf16 first and is 6× slower.
# The W8A8 FP8 schemes run XLA's FP8 dot; block FP8 is fast at small M (one FP8 dot per K group) and
# falls back to dequantize + dot at 8192³. The MoE kernel is far from its floor at one token and 2.7×
# bf16 `ragged_dot` from 64 tokens (`docs/design/gemm8.md`, `docs/design/moe.md`).

# %% [markdown]
# ## Paged decode attention (`attention.json`, `attention_sweep.json`)
#
# One query token per sequence, B = 8, ctx = 32k, 32 query / 8 KV heads of 128, page 16. Each bar is
# the median µs per call; the black tick is the record's `byte_floor_us` (K and V codes and their
# scales, `kv_bytes`, at 4.18 TB/s). Beside jquant's kernel (`cache_decode_attention`, Pallas on the
# Triton backend; TurboQuant through its rotated-domain kernel): jquant's XLA path and JAX's own
# `paged_attention` on bf16 and on fp8 pages, timed in the same batches.

# %%
att = [r for r in RECORDS["attention"] if r["config"] is None]
labels = [r["kv_dtype"] for r in att]
series = [("jquant kernel", [r["time_us"] for r in att]),
          ("JAX paged_attention, bf16 pages", [r["baselines"]["jax_paged_attention_bf16"] for r in att]),
          ("JAX paged_attention, fp8 pages", [r["baselines"]["jax_paged_attention_fp8"] for r in att]),
          ("jquant XLA path", [r["baselines"]["xla"] for r in att])]
fig, (ax, ax2) = plt.subplots(1, 2, figsize=(15, 5), gridspec_kw={"width_ratios": [1.6, 1]})
width = 0.8 / len(series)
for j, (name, values) in enumerate(series):
    ax.bar(np.arange(len(att)) + (j - 1.5) * width, values, width, label=name)
ax.scatter(np.arange(len(att)) - 1.5 * width, [r["byte_floor_us"] for r in att], marker="_", s=300, color="k",
           lw=2.5, zorder=3, label="byte floor (jquant's pages)")
for i, r in enumerate(att):
    ax.text(i - 1.5 * width, r["time_us"] * 1.03, f"{r['pct_of_byte_floor']:.0f}%", ha="center", fontsize=7)
ax.set_xticks(range(len(att)), labels, rotation=25, ha="right")
ax.set(ylabel="µs per call", yscale="log", ylim=(30, 8000),
       title=f"decode attention, B={att[0]['batch']}, ctx={att[0]['ctx']} (labels: % of byte floor)")
ax.legend(fontsize=7, ncol=3, loc="upper left")

sweep = RECORDS["attention_sweep"]
for dtype, color in zip(sorted({r["kv_dtype"] for r in sweep}), ("#4c72b0", "#c44e52", "#55a868")):
    rows = [r for r in sweep if r["kv_dtype"] == dtype]
    default = next(r for r in rows if r["config"] is None)
    line = ax2.axhline(default["time_us"], ls="--", lw=1, color=color)
    for block_tokens in sorted({r["config"]["block_tokens"] for r in rows if r["config"]}):
        cells = sorted((r for r in rows if r["config"] and r["config"]["block_tokens"] == block_tokens),
                       key=lambda r: r["config"]["num_splits"])
        ax2.errorbar([r["config"]["num_splits"] for r in cells], [r["time_us"] for r in cells],
                     yerr=[r["time_us"] * r["spread_pct"] / 200 for r in cells], marker="o", capsize=2,
                     color=line.get_color(), ls="-" if block_tokens == 64 else ":",
                     label=f"{dtype}, block_tokens {block_tokens}")
    ax2.plot([], [], ls="--", color=line.get_color(), label=f"{dtype}, default launch")
ax2.set(xscale="log", xlabel="num_splits", ylabel="µs per call",
        title="launch sweep (error bars: half the batch spread)")
ax2.legend(fontsize=7)
fig.tight_layout()
plt.show()

# %% [markdown]
# ## KV insert (`insert.json`)
#
# Quantizing new tokens into their pages: useful bytes (new K and V read in bf16, codes and scales
# written) per second against the number of tokens inserted, jquant's Pallas kernel (forced, solid)
# and XLA's scatter (dashed), with the 4.18 TB/s line. `bit_exact` says whether the kernel wrote exactly
# XLA's bytes in that run.

# %%
ins = RECORDS["insert"]
fig, ax = plt.subplots(figsize=(9, 4.8))
for dtype, color in zip(sorted({r["kv_dtype"] for r in ins}), plt.cm.tab10.colors):
    rows = sorted((r for r in ins if r["kv_dtype"] == dtype and r["config"] is None), key=lambda r: r["tokens"])
    exact = "bit-exact" if all(r["bit_exact"] for r in rows) else "not bit-exact in " + ", ".join(
        str(r["tokens"]) for r in rows if not r["bit_exact"]) + " tokens"
    ax.plot([r["tokens"] for r in rows], [r["tb_per_s"] for r in rows], "o-", color=color, label=f"{dtype} ({exact})")
    ax.plot([r["tokens"] for r in rows], [r["xla_tb_per_s"] for r in rows], "s--", color=color, alpha=0.6, ms=4)
ax.axhline(HBM / 1e12, color="k", lw=1)
ax.text(10, HBM / 1e12 * 1.05, f"HBM {HBM / 1e12:.2f} TB/s", fontsize=8)
ax.plot([], [], "k--", label="XLA (dashed)")
ax.set(xscale="log", yscale="log", xlabel="tokens inserted per call", ylabel="useful TB/s",
       title="KV insert: kernel vs XLA")
ax.legend(fontsize=7)
fig.tight_layout()
plt.show()

# %% [markdown]
# ## Decode step (`decode.json`, `decode_unfused.json`, `decode_command_buffers.json`)
#
# One decode step of an 8-layer Llama-3-8B-shaped stack (`jquant.models.llama.decode_step`, dispatch
# included). Each bar is the step; the tick its byte floor (every weight once plus `ctx` cached tokens
# per sequence and layer, at the HBM rate that run measured); the dot, where the run was profiled, the
# GPU's busy time per step (`profile.busy_us_per_step`): at B = 1 the gap between the dot and the bar
# is the host launching ~150 kernels a step. The bf16-weight rows are the XLA baselines.

# %%
dec = [(stem, r) for stem in ("decode", "decode_unfused", "decode_command_buffers") for r in RECORDS.get(stem, [])]
variant = {"decode": "fused", "decode_unfused": "unfused", "decode_command_buffers": "fused, command buffers"}
groups = collections.OrderedDict()
for stem, r in dec:
    groups.setdefault((r["batch"], r["ctx"]), []).append((stem, r))
fig, axes = plt.subplots(1, len(groups), figsize=(15, 5.2),
                         gridspec_kw={"width_ratios": [len(v) for v in groups.values()]})
for ax, ((batch, ctx), rows) in zip(np.atleast_1d(axes), groups.items()):
    names = [f"{r['scheme']} / KV {r['kv_dtype']}\n{variant[stem]}" for stem, r in rows]
    for i, (stem, r) in enumerate(rows):  # the fused rows of decode.json solid, the other variants hatched
        ax.bar(i, r["time_us"], color="#4c72b0" if r["scheme"] == "bf16" else "#dd8452",
               hatch="" if stem == "decode" else "//", edgecolor="w")
    ax.scatter(range(len(rows)), [r["byte_floor_us"] for _, r in rows], marker="_", s=500, color="k", lw=2.5, zorder=3)
    busy = [(i, r["profile"]["busy_us_per_step"]) for i, (_, r) in enumerate(rows) if "profile" in r]
    if busy:
        ax.scatter(*zip(*busy), color="k", s=25, zorder=4)
    for i, (_, r) in enumerate(rows):
        ax.text(i, r["time_us"] * 1.01, f"{r['time_us']:.0f}", ha="center", fontsize=7)
    ax.set_xticks(range(len(rows)), names, rotation=60, ha="right", fontsize=7)
    ax.set(ylabel="µs per step", title=f"B = {batch}, ctx = {ctx}")
axes = np.atleast_1d(axes)
axes[-1].legend(handles=[Patch(color="#4c72b0", label="bf16 weights (XLA GEMMs)"),
                         Patch(color="#dd8452", label="int4_g128 weights (W4A16 kernel)"),
                         Patch(facecolor="grey", hatch="//", edgecolor="w", label="unfused / command buffers"),
                         Line2D([], [], color="k", marker="_", ls="", ms=14, mew=2.5, label="byte floor"),
                         Line2D([], [], color="k", marker="o", ls="", ms=5, label="GPU busy per step (profiled)")],
                fontsize=7, loc="upper right")
fig.suptitle("decode step of an 8-layer Llama-3-8B-shaped stack, H200")
fig.tight_layout()
plt.show()

# %% [markdown]
# The B = 1 rows move by up to 40 % between runs of the same code (`bench/results/h200/README.md`:
# the host's launches, not the GPU, bound the step); read them with their spreads:

# %%
show_table(["file", "weights", "KV", "B", "ctx", "step µs", "byte floor µs", "% floor", "spread %", "GPU busy µs",
            "commit"],
           [[f"`{stem}`", r["scheme"], r["kv_dtype"], r["batch"], r["ctx"], r["time_us"], r["byte_floor_us"],
             r["pct_of_byte_floor"], r["spread_pct"], r.get("profile", {}).get("busy_us_per_step", ""), r["commit"]]
            for stem, r in dec])
