"""The kernel-variant stage of tools/device_w4a16.py (``--variants``): base against each variant.

On one H200, in one process (so the XLA baselines drift with the kernels, not between runs):
(a) every variant against the reference on the device (small shapes, all code books, GPU numerics:
the inline tricks that interpret mode cannot exercise); (b) int4 g128 timings: gemv variants at M = 1
on 28672×8192 and 8192×8192 over three tiles, mma variants at M = 16 / 64 / 128 over a few
launches, with XLA bf16 and XLA dequant+dot measured alongside; (c) a comparison table, variants.json,
and auto_dispatch.json: a candidate dispatch table (same schema as
jquant/pallas_kernels/auto_dispatch_h200.json) holding the fastest kernel per measured M where it beats
XLA dequant+dot (what ``auto`` falls back to). About 3 minutes.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from jquant.bench import w4a16 as bench
from jquant.bench.timing import copies_for, time_fn
from jquant.pallas_kernels import TuningConfig, default_config, prepack, reference, w4a16_matmul
from jquant.pallas_kernels.w4a16_triton import GEMV_MAX_ROWS, VARIANTS

GEMV_TILES = ((128, 128), (64, 256), (64, 512))
# (block_n, block_k, block_m, split_k, num_warps) per M for the mma kernels.
MMA_LAUNCHES = {16: ((64, 512, 16, 4, 4), (128, 256, 16, 4, 4), (128, 128, 16, 4, 4)),
                64: ((128, 256, 64, 4, 4), (128, 128, 64, 4, 4), (128, 128, 64, 4, 8)),
                128: ((128, 128, 128, 4, 8), (128, 256, 128, 2, 8), (128, 128, 64, 4, 4))}
CORRECTNESS_CASES = (  # lut, group, zeros, scale dtype, global scale
    ("int4", 128, None, jnp.bfloat16, None), ("int4", 64, "int", jnp.float16, None),
    ("int4", 64, "float", jnp.float32, None), ("int4", -1, None, jnp.bfloat16, None),
    ("e2m1", 32, None, "e8m0", None), ("e2m1", 16, None, "e4m3", 0.02),
    ("nf4", 64, None, jnp.float32, None))


def correctness(log) -> list[dict]:
    rng = np.random.default_rng(7)
    k, n = 1024, 320
    records = []
    for lut, group, zeros, sdt, gs in CORRECTNESS_CASES:
        q, s, z = bench.random_w4_weight(rng, k, n, group, zeros=zeros, scale_dtype=sdt)
        for bn, bk in ((64, 512), (128, 128)):
            packed = prepack(q, s, z, lut=lut, group_size=group, global_scale=gs,
                             config=TuningConfig(bn, bk))
            for mode, m, x_dtype in (("gemv", 1, jnp.bfloat16), ("gemv", 4, jnp.float16),
                                     ("mma", 16, jnp.bfloat16), ("mma", 100, jnp.float16)):
                x = jnp.asarray(rng.standard_normal((m, k)), x_dtype)
                ref = reference(x, packed).astype(jnp.float32)
                for variant in VARIANTS[mode]:
                    rec = dict(lut=lut, group=group, zeros=zeros, tiles=(bn, bk), mode=mode, m=m,
                               x_dtype=jnp.dtype(x_dtype).name, variant=variant)
                    try:
                        cfg = default_config(mode, m, packed, variant)
                        out = jax.jit(lambda x, p, c=cfg, md=mode: w4a16_matmul(
                            x, p, impl=md, config=c, poison=True))(x, packed).astype(jnp.float32)
                        err = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
                        nan = bool(jnp.isnan(out).any())
                        rec.update(rel_err=err, ok=err <= 1e-2 and not nan)
                    except Exception as e:
                        rec.update(ok=False, error=f"{type(e).__name__}: {e}"[:1500])
                    records.append(rec)
                    if not rec["ok"]:
                        log(f"  FAIL {rec}")
    log(f"variant correctness: {sum(r['ok'] for r in records)}/{len(records)} ok")
    return records


def _copies(packed):
    return [packed] + [jax.tree_util.tree_map(lambda a: a.copy(), packed)
                       for _ in range(copies_for(packed.nbytes, max_copies=8) - 1)]


def _time(mode, cfg, packs, xs):
    fn = jax.jit(lambda x, p: w4a16_matmul(x, p, impl=mode, config=cfg))
    return time_fn(fn, [(xs[c % len(xs)], p) for c, p in enumerate(packs)]).median_us


def timings(log) -> list[dict]:
    rows = []
    key = jax.random.PRNGKey(3)
    plan = [(28672, 8192, 1), (8192, 8192, 1), (28672, 8192, 16), (28672, 8192, 64),
            (28672, 8192, 128), (8192, 8192, 128)]
    for n, k, m in plan:
        weight = bench.make_weight("int4_g128", n, k, key)
        xs = [jax.random.normal(jax.random.fold_in(key, c), (m, k), jnp.bfloat16) for c in range(4)]
        w_bf16 = [jax.random.normal(jax.random.fold_in(key, 50 + c), (k, n), jnp.bfloat16)
                  for c in range(copies_for(k * n * 2, max_copies=4))]
        codes = weight["q"]
        rows_packed = (codes[0::2] | (codes[1::2] << 4)).astype(jnp.uint8)
        base = dict(N=n, K=k, M=m)
        rows.append(dict(base, kernel="xla_bf16", time_us=time_fn(
            jnp.dot, [(xs[c % 4], w) for c, w in enumerate(w_bf16)]).median_us))
        dequant = bench._xla_dequant_dot_fn(k, 128)
        rows.append(dict(base, kernel="xla_dequant_dot", time_us=time_fn(
            dequant, [(x, rows_packed, weight["scale"]) for x in xs]).median_us))
        mode = "gemv" if m <= GEMV_MAX_ROWS else "mma"
        launches = ([(bn, bk, None, None, None) for bn, bk in GEMV_TILES] if mode == "gemv"
                    else MMA_LAUNCHES[m])
        for bn, bk, bm, split, warps in launches:
            packed = prepack(weight["q"], weight["scale"], lut="int4", group_size=128,
                             config=TuningConfig(bn, bk))
            packs = _copies(packed)
            for variant in VARIANTS[mode]:
                cfg = default_config(mode, m, packed, variant)
                if mode == "mma":
                    cfg = dataclasses.replace(cfg, block_m=bm, split_k=split, num_warps=warps)
                try:
                    us = _time(mode, cfg, packs, xs)
                except Exception as e:
                    log(f"  FAILED {mode}/{variant} {n}x{k} M={m} {cfg}: {type(e).__name__}: "
                        f"{str(e)[:300]}")
                    traceback.print_exc()
                    continue
                rows.append(dict(base, kernel=f"{mode}/{variant}", time_us=us,
                                 config=dataclasses.asdict(cfg)))
                log(f"  {n}x{k} M={m:<4d} {mode}/{variant:17s} bn={bn} bk={bk} bm={cfg.block_m} "
                    f"split={cfg.split_k} warps={cfg.num_warps}: {us:8.1f} us")
            del packs
    return rows


def comparison(rows: list[dict]) -> tuple[str, list[dict]]:
    """A markdown table (best launch per kernel per cell) and the candidate auto rules."""
    cells: dict = {}
    for r in rows:
        cell = cells.setdefault((r["N"], r["K"], r["M"]), {})
        if r["kernel"] not in cell or r["time_us"] < cell[r["kernel"]]["time_us"]:
            cell[r["kernel"]] = r
    lines = ["| N×K | M | kernel | µs | vs XLA bf16 | vs base | config |", "|---|---|---|---|---|---|---|"]
    rules = []
    for (n, k, m), cell in sorted(cells.items(), key=lambda c: (c[0][2], -c[0][0])):
        bf16 = cell["xla_bf16"]["time_us"]
        mode = "gemv" if m <= GEMV_MAX_ROWS else "mma"
        base = cell.get(f"{mode}/base", {}).get("time_us")
        for name, r in sorted(cell.items(), key=lambda kv: kv[1]["time_us"]):
            cfg = r.get("config") or {}
            lines.append(f"| {n}×{k} | {m} | {name} | {r['time_us']:.1f} | {bf16 / r['time_us']:.2f}× | "
                         + (f"{base / r['time_us']:.2f}× | " if base and "/" in name else "| ")
                         + " ".join(f"{key}={cfg[key]}" for key in ("block_n", "block_k", "block_m",
                                                                    "split_k", "num_warps") if key in cfg) + " |")
        if n == 28672:   # the dispatch table follows the large shape (the rows it was tuned on)
            kernels = {nm: r for nm, r in cell.items() if "/" in nm}
            best = min(kernels.values(), key=lambda r: r["time_us"]) if kernels else None
            if best and best["time_us"] < cell["xla_dequant_dot"]["time_us"]:
                kmode, variant = best["kernel"].split("/")
                rules.append(dict(max_m=m, mode=kmode, variant=variant,
                                  measured_us=round(best["time_us"], 1)))
    return "\n".join(lines) + "\n", rules


def run(out: pathlib.Path, log) -> None:
    results = {}
    try:
        results["correctness"] = correctness(log)
    except Exception:
        traceback.print_exc()
    rows = []
    try:
        rows = timings(log)
    except Exception:
        traceback.print_exc()
    results["timings"] = rows
    table, rules = comparison(rows) if rows else ("", [])
    print(table, flush=True)
    (out / "variants.md").write_text(f"# W4A16 kernel variants, {jax.devices()[0].device_kind}\n\n"
                                     + table)
    (out / "variants.json").write_text(json.dumps(results, indent=1, default=str))
    (out / "auto_dispatch.json").write_text(json.dumps(dict(
        about="Candidate for jquant/pallas_kernels/auto_dispatch_h200.json: the fastest kernel per "
              "measured M on 28672x8192 where it beats XLA dequant+dot. Check the M between the "
              "measured ones before adopting it.",
        source=f"tools/device_w4a16.py --variants, {jax.devices()[0].device_kind}",
        rules=rules), indent=1))
    log(f"candidate auto rules: {rules}")
