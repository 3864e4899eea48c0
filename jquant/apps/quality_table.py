"""The calibration quality table: ``bench/results/quality.json`` (rows ``jquant calibrate --record`` adds)
and its markdown twin, rewritten from the JSON on every record so the two never disagree."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import subprocess

HEADER = """# Calibration quality: SmolLM2-135M-Instruct

`jquant calibrate --record bench/results/quality.json` on 2 CPU cores (JAX {jax}): calibration on {calibration},
{evaluation}. Projections of all 30 layers quantized, embeddings and norms float (AWQ and SmoothQuant
fold their scales into the norms); GPTQ with damp 0.01, block 128, float16 scales for the integer formats
and the formats' own scales for MXFP4 / NVFP4 (their blocks are GPTQ's static groups). Bits per weight
count codes, scales and zero points as jquant stores them. "Recovered" is the share of
round-to-nearest's perplexity loss that the method wins back. The model's weights come from a Q4_1
GGUF (blocks of 32 along K, with a minimum): groups of 32 line up with that grid, groups of 64 span
two of its blocks; MXFP4's blocks are 32 and NVFP4's 16, so both line up with it.
"""

DEFAULTS = {
    "model": "SmolLM2-135M-Instruct",
    "evaluation": "perplexity on the first 2048 tokens of the Britannica text (8 rows of 256)",
    "calibration": "32 rows of 256 tokens of the same text from token 16384",
}


@dataclasses.dataclass(frozen=True)
class Row:
    """One line of the table; ``baseline`` is the round-to-nearest row's ``weights`` it is measured
    against (None for the baselines themselves)."""

    weights: str
    method: str
    bits_per_weight: float
    ppl: float
    recovered: float | None = None
    seconds: int | None = None
    baseline: str | None = None


def current_commit() -> str:
    """The checkout's short commit (``unknown`` outside git): take it when a run starts, as the tree
    may move on while the run lasts."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def record_rows(path, rows: list[Row], commit: str | None = None) -> pathlib.Path:
    """Adds ``rows`` to the JSON table at ``path`` (a row with the same weights and method is replaced)
    and rewrites ``path`` with suffix ``.md``. The first row must be the float model's; its perplexity
    must equal the table's (to 1e-3), else the evaluation changed and the rows would not compare.
    ``commit``: the code the rows were measured with (default: the checkout's now)."""
    import jax

    path = pathlib.Path(path)
    table = json.loads(path.read_text()) if path.exists() else {**DEFAULTS, "rows": []}
    table["jax"] = jax.__version__
    float_rows = [r for r in table["rows"] if r["method"] == ""]
    base = rows[0].ppl
    if float_rows and abs(float_rows[0]["ppl"] - base) > 1e-3:
        raise ValueError(f"{path}: its float perplexity is {float_rows[0]['ppl']:.3f}, this run's {base:.3f}; "
                         "the evaluation differs, so the rows would not compare (record into a new file)")
    commit = commit or current_commit()
    for row in rows:
        entry = {"weights": row.weights, "method": row.method, "bits_per_weight": round(row.bits_per_weight, 4),
                 "ppl": round(row.ppl, 3), "delta_ppl": round(row.ppl - base, 3),
                 "recovered": None if row.recovered is None else round(row.recovered, 3),
                 "seconds": row.seconds, "baseline": row.baseline, "commit": commit}
        same = [i for i, r in enumerate(table["rows"]) if (r["weights"], r["method"]) == (row.weights, row.method)]
        if row.method == "" and same:
            continue    # the float row stays as first recorded (checked equal above)
        if same:
            table["rows"][same[0]] = entry
        else:
            table["rows"].append(entry)
    path.write_text(json.dumps(table, indent=1, ensure_ascii=False) + "\n")
    path.with_suffix(".md").write_text(markdown(table))
    return path


def _group(row: dict) -> str:
    return row.get("baseline") or row["weights"]


def markdown(table: dict) -> str:
    """The table as markdown: float first, then each round-to-nearest baseline followed by the methods
    measured against it, in the order the baselines were first recorded."""
    rows = table["rows"]
    order = []
    for r in rows:
        if r["method"] and _group(r) not in order:
            order.append(_group(r))
    lines = [HEADER.format(**table), "| weights | method | bits/weight | PPL | ΔPPL | recovered | time | commit |",
             "|---|---|---|---|---|---|---|---|"]
    ranked = [r for r in rows if not r["method"]] + sorted(
        (r for r in rows if r["method"]),
        key=lambda r: (order.index(_group(r)), r["method"] != "round-to-nearest"))
    for r in ranked:
        recovered = "" if r["recovered"] is None else f"{r['recovered']:.0%}"
        seconds = "" if r["seconds"] is None else f"{r['seconds']} s"
        delta = "" if not r["method"] else f"{r['delta_ppl']:+.3f}"
        lines.append(f"| {r['weights']} | {r['method']} | {r['bits_per_weight']:.2f} | {r['ppl']:.3f} | {delta} | "
                     f"{recovered} | {seconds} | {r['commit']} |")
    return "\n".join(lines) + "\n"


# The table of record, in a source checkout (an installed wheel has none).
RECORD = pathlib.Path(__file__).resolve().parents[2] / "bench" / "results" / "quality.json"


def calibrated_summary(path=RECORD) -> str:
    """What calibration wins over round-to-nearest, one line per baseline (its best method), from the
    table at ``path``; empty when there is no table."""
    path = pathlib.Path(path)
    if not path.exists():
        return ""
    rows = json.loads(path.read_text())["rows"]
    baselines = {r["weights"]: r for r in rows if r["method"] == "round-to-nearest"}
    best: dict[str, dict] = {}
    for r in rows:
        group = _group(r)
        if r["method"] not in ("", "round-to-nearest") and group in baselines:
            if group not in best or r["ppl"] < best[group]["ppl"]:
                best[group] = r
    lines = [f"calibration (`jquant calibrate`; {path.name}, its own evaluation slice: 8 rows of 256 tokens):"]
    for group, r in best.items():
        base = baselines[group]
        lines.append(f"  {group:<18} round-to-nearest ΔPPL {base['delta_ppl']:+8.3f}  ->  {r['weights']}, "
                     f"{r['method']}: {r['delta_ppl']:+.3f}")
    return "\n".join(lines) + "\n"
