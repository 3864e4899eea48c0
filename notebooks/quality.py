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
# # Quality against bytes
#
# What quantization costs a real model, from the committed result files (nothing is measured here):
#
# * `bench/results/quality.json`: SmolLM2-135M-Instruct's perplexity with its projections quantized,
#   uncalibrated (nearest-value quantization, RTN) and calibrated (`jquant calibrate`), against bits per
#   weight;
# * `bench/results/kv_quality.md`: the same model with a quantized paged KV cache, per `kv_cache_dtype`
#   (`jquant demo --schemes none --kv-cache-dtypes all`);
# * `bench/results/embedding_quality.md`, when present: the sentence-embedding check.
#
# The files are read as they are when the notebook runs: rows added to them later appear in the plots
# without a change here.

# %%
import json
import os
import pathlib
import re

ROOT = next(p for p in (pathlib.Path.cwd(), *pathlib.Path.cwd().parents)
            if (p / "pyproject.toml").is_file() and (p / "jquant").is_dir())
os.chdir(ROOT)

import matplotlib.pyplot as plt
from IPython.display import Markdown, display

plt.rcParams.update({"figure.dpi": 80, "savefig.dpi": 80, "axes.grid": True, "grid.alpha": 0.3})
RESULTS = ROOT / "bench" / "results"


def show_table(headers, rows):
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join("" if c is None else str(c) for c in row) + " |" for row in rows]
    display(Markdown("\n".join(lines)))


def markdown_tables(text):
    """Every pipe table in a markdown text, as (header, rows of cells)."""
    tables, block = [], []
    for line in [*text.splitlines(), ""]:
        if line.strip().startswith("|"):
            block.append([c.strip() for c in line.strip().strip("|").split("|")])
        elif block:
            if len(block) >= 2 and all(re.fullmatch(r":?-+:?", c) for c in block[1]):
                tables.append((block[0], block[2:]))
            block = []
    return tables


def lead(text):
    """A results file's text above its first table: how its numbers were made."""
    return text.split("\n|", 1)[0].strip()


def number(cell):
    """'+0.209' → 0.209, '94.8%' → 94.8, '1.88×' → 1.88; None where the cell is not a number."""
    try:
        return float(cell.replace("%", "").replace("×", "").replace("+", "").replace(",", "").strip())
    except ValueError:
        return None


# %% [markdown]
# ## Weights: perplexity against bits per weight (`quality.json`)

# %%
quality_file = RESULTS / "quality.json"
quality = json.loads(quality_file.read_text()) if quality_file.is_file() else None
if quality is None:
    display(Markdown(f"`{quality_file.relative_to(ROOT)}` is not in this checkout: no weight-quantization "
                     "perplexities to show. The cells below draw them once the file exists."))
else:
    for key in ("model", "evaluation", "calibration", "jax"):
        print(f"{key}: {quality.get(key)}")
    rows = quality["rows"]
    show_table(["weights", "method", "bits / weight", "PPL", "ΔPPL", "share of RTN's loss recovered", "seconds",
                "commit"],
               [[r["weights"], r["method"] or "(float)", r["bits_per_weight"], r["ppl"], r["delta_ppl"],
                 None if r.get("recovered") is None else f"{r['recovered']:.0%}", r.get("seconds"), r.get("commit")]
                for r in rows])

# %% [markdown]
# One marker per method; x is bits per weight (codes and scales, as the scheme stores them), y the
# perplexity increase over the float model (log scale; the float row itself, ΔPPL = 0, is the
# reference and has no point). Arrows join the uncalibrated row of a weight format (the one without a
# "recovered" share: RTN) to each calibrated row that starts from it (its `baseline`, or the same
# `weights`).

# %%
if quality is not None:
    baseline = [r for r in rows if not r["delta_ppl"]]
    points = [r for r in rows if r["delta_ppl"] and r["delta_ppl"] > 0]
    methods = list(dict.fromkeys(r["method"] for r in points))
    markers = dict(zip(methods, "osD^vP*Xh<>" * 3))
    colors = dict(zip(methods, plt.cm.tab10.colors * 3))
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(14, 5), gridspec_kw={"width_ratios": [1.5, 1]})
    for r in points:
        ax.scatter(r["bits_per_weight"], r["delta_ppl"], marker=markers[r["method"]], color=colors[r["method"]],
                   s=70, edgecolor="k", lw=0.5, zorder=3)
        ax.annotate(r["weights"], (r["bits_per_weight"], r["delta_ppl"]), textcoords="offset points",
                    xytext=(6, 3), fontsize=7)
    uncalibrated = {r["weights"]: r for r in points if r.get("recovered") is None}
    for r in points:
        # A calibrated row names its baseline ("baseline": the weights of its RTN row), else shares its weights.
        rtn = uncalibrated.get(r.get("baseline") or r["weights"]) if r.get("recovered") is not None else None
        if rtn is not None:
            ax.annotate("", (r["bits_per_weight"], r["delta_ppl"]), (rtn["bits_per_weight"], rtn["delta_ppl"]),
                        arrowprops=dict(arrowstyle="->", color="grey", lw=0.8, shrinkA=6, shrinkB=6))
    for method in methods:
        ax.scatter([], [], marker=markers[method], color=colors[method], label=method, edgecolor="k", lw=0.5)
    base = f" (float PPL {baseline[0]['ppl']})" if baseline else ""
    ax.set(yscale="log", xlabel="bits per weight", ylabel="ΔPPL over float", title=f"{quality['model']}{base}")
    ax.legend(fontsize=8)

    recovered = [r for r in rows if r.get("recovered") is not None]
    ax2.barh(range(len(recovered)), [100 * r["recovered"] for r in recovered],
             color=[colors.get(r["method"], "grey") for r in recovered])
    ax2.set_yticks(range(len(recovered)), [f"{r['weights']}\n{r['method']}" for r in recovered], fontsize=8)
    ax2.set(xlabel="% of RTN's ΔPPL recovered by calibration", xlim=(0, 100), title="calibration's gain")
    ax2.invert_yaxis()
    fig.tight_layout()
    plt.show()

# %% [markdown]
# ## KV cache: perplexity against bytes per token (`kv_quality.md`)
#
# The file as committed: its own account of the run, then its table.

# %%
kv_text = (RESULTS / "kv_quality.md").read_text()
display(Markdown(lead(kv_text)))
(header, kv_rows), *_ = markdown_tables(kv_text)
show_table(header, kv_rows)
col = {name: i for i, name in enumerate(header)}


def column(*candidates):
    """The index of the first header that contains one of the candidate words."""
    for c in candidates:
        for name, i in col.items():
            if c in name.lower():
                return i
    raise KeyError(f"no column like {candidates} in {header}")


i_name, i_bytes, i_dppl = column("kv_cache_dtype", "dtype"), column("bytes"), column("δppl", "delta")
i_top1 = column("top-1")
kv = [(r[i_name], number(r[i_bytes]), number(r[i_dppl]), number(r[i_top1])) for r in kv_rows]

fig, (ax, ax2) = plt.subplots(1, 2, figsize=(14, 4.8))
for (name, nbytes, dppl, top1), color in zip(kv, plt.cm.tab10.colors * 2):
    ax.scatter(nbytes, dppl, color=color, s=60, edgecolor="k", lw=0.5, zorder=3)
    ax.annotate(name, (nbytes, dppl), textcoords="offset points", xytext=(5, 4), fontsize=8)
    ax2.scatter(nbytes, top1, color=color, s=60, edgecolor="k", lw=0.5, zorder=3)
    ax2.annotate(name, (nbytes, top1), textcoords="offset points", xytext=(5, 4), fontsize=8)
ax.set(yscale="symlog", xlabel="KV bytes per token (all layers, K and V)", ylabel="ΔPPL over the bf16 cache",
       title="KV cache dtype: perplexity")
ax.set_yscale("symlog", linthresh=0.01)
ax2.set(xlabel="KV bytes per token", ylabel="top-1 agreement with the bf16 cache (%)",
        title="KV cache dtype: next-token agreement")
fig.tight_layout()
plt.show()

# %% [markdown]
# ## Sentence embeddings (`embedding_quality.md`)

# %%
embedding = RESULTS / "embedding_quality.md"
if not embedding.is_file():
    display(Markdown(f"`{embedding.relative_to(ROOT)}` is not in this checkout yet: the sentence-embedding check "
                     "has no committed result to show. This cell shows its tables once the file exists."))
else:
    text = embedding.read_text()
    display(Markdown(lead(text)))
    tables = markdown_tables(text)
    for header, table_rows in tables:
        show_table(header, table_rows)
    # Quality against bytes where the table has a bits column and cosine columns: 1 - cosine on a log
    # scale (lower is better), one point per row; the other numeric columns as bars.
    for header, table_rows in tables:
        lower = [h.lower() for h in header]
        bits = next((i for i, h in enumerate(lower) if "bits" in h), None)
        cosines = [i for i, h in enumerate(lower) if "cos" in h]
        if bits is None or not cosines:
            continue
        others = [i for i in range(1, len(header)) if i not in cosines and i != bits
                  and all(number(r[i]) is not None for r in table_rows)]
        fig, axes = plt.subplots(1, 1 + len(others), figsize=(7 + 5 * len(others), 5), squeeze=False)
        ax = axes[0][0]
        for i, marker in zip(cosines, "os^D"):
            xs = [number(r[bits]) for r in table_rows]
            ys = [1 - number(r[i]) for r in table_rows]
            keep = [(x, y, r[0]) for x, y, r in zip(xs, ys, table_rows) if y > 0]
            ax.scatter([k[0] for k in keep], [k[1] for k in keep], marker=marker, s=50, edgecolor="k", lw=0.5,
                       label=f"1 − {header[i]}")
            if marker == "o":
                for x, y, name in keep:
                    ax.annotate(name, (x, y), textcoords="offset points", xytext=(5, 3), fontsize=7)
        ax.set(yscale="log", xlabel=header[bits], ylabel="1 − cosine with the float embedding",
               title="sentence embeddings under weight quantization")
        ax.legend(fontsize=8)
        for ax, i in zip(axes[0][1:], others):
            ax.barh(range(len(table_rows)), [number(r[i]) for r in table_rows])
            ax.set_yticks(range(len(table_rows)), [r[0] for r in table_rows], fontsize=8)
            ax.set(title=header[i])
            ax.invert_yaxis()
        fig.tight_layout()
        plt.show()
