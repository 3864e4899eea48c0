"""The W4A16 benchmark: kernels against XLA bf16 ``x @ W`` and XLA dequant+dot, in one run.

Each record (JSON) holds op, impl, scheme, M, N, K, time_us, baselines {name: time_us}, device,
jax_version, date, the launch config, TB/s, TFLOP/s, speedup vs bf16, % of the byte floor, and
the batch spread ((slowest − fastest) / median, %) of the kernel and of each baseline.
The baselines and kernels of one cell are timed interleaved, a batch of each in turn
(``time_interleaved``).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import pathlib
from typing import Callable, Iterable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jquant.bench.timing import (H200_HBM_BYTES_PER_S, array_bytes, copies_for, roofline,
                                 spread_pct, time_interleaved, time_steadiest)
from jquant.kernels.w4a16 import (PackedW4NK, default_mgpu_config, prepack_nk, resolve_impl,
                                   w4a16_matmul)

SHAPES = ((28672, 8192), (8192, 28672), (8192, 8192), (4096, 4096), (1536, 576))
MS = (1, 4, 16, 32, 64, 128, 256, 1024, 4096)
QUICK_SHAPES = ((28672, 8192), (8192, 8192), (4096, 4096))
QUICK_MS = (1, 16, 128, 1024)
# scheme → (lut, group size, scale kind); int4 is GPTQ-style symmetric uint4b8.
SCHEMES = {"int4_g128": ("int4", 128, "bf16"), "mxfp4": ("e2m1", 32, "e8m0"),
           "nvfp4": ("e2m1", 16, "e4m3"), "nf4": ("nf4", 64, "f32")}
M1_ONLY_SCHEMES = ("mxfp4", "nvfp4", "nf4")


_SCALE_DTYPES = {"f32": np.float32, "f16": np.float16, "bf16": ml_dtypes.bfloat16}


def random_w4_weight(rng: np.random.Generator, k: int, n: int, group: int, *, zeros: str | None = None,
                     scale_dtype="f32"):
    """Random ``prepack_nk`` inputs: codes ``[K, N]``, per-group scales and optional zero points.

    ``scale_dtype``: "f32" / "f16" / "bf16" (or a numpy dtype), "e8m0" or "e4m3" (scaled into e4m3's
    normal range); ``zeros``: None, "int" (uint8 codes) or "float" (fractional fp32 zero points).
    """
    q = rng.integers(0, 16, (k, n)).astype(np.uint8)
    groups = 1 if group == -1 else -(-k // group)
    s = (rng.random((groups, n)) * 0.02 + 0.005).astype(np.float32)
    if scale_dtype == "e8m0":
        s = s.astype(ml_dtypes.float8_e8m0fnu)
    elif scale_dtype == "e4m3":
        s = (s * 50).astype(ml_dtypes.float8_e4m3fn)
    else:
        s = s.astype(_SCALE_DTYPES.get(scale_dtype, scale_dtype))
    z = None
    if zeros == "int":
        z = rng.integers(0, 16, (groups, n)).astype(np.uint8)
    elif zeros == "float":
        z = (rng.random((groups, n)) * 15).astype(np.float32)
    return q, s, z


def make_weight(scheme: str, n: int, k: int, key) -> dict:
    """Random codes [K, N] and scales for ``scheme`` (generated on the device)."""
    lut, group, scale_kind = SCHEMES[scheme]
    kq, ks = jax.random.split(key)
    q = jax.random.randint(kq, (k, n), 0, 16, jnp.int32).astype(jnp.uint8)
    groups = -(-k // group)
    s = jax.random.uniform(ks, (groups, n), jnp.float32, 0.5, 2.0) * 0.01
    if scale_kind == "e8m0":
        s = s.astype(jnp.float8_e8m0fnu)
    elif scale_kind == "e4m3":
        s = (s * 100).astype(jnp.float8_e4m3fn)
    elif scale_kind == "bf16":
        s = s.astype(jnp.bfloat16)
    gs = 0.01 if scheme == "nvfp4" else None
    return dict(q=q, scale=s, lut=lut, group_size=group, global_scale=gs)


def _xla_dequant_dot_fn(k: int, group: int) -> Callable:
    """The checkpoint-style baseline: int4 codes packed two per byte along K (low nibble first),
    bf16 scales; XLA converts, scales (materializing W) and dots."""
    def fn(x, packed_rows, scale):
        lo, hi = packed_rows & 15, packed_rows >> 4
        q = jnp.stack([lo, hi], axis=1).reshape(k, -1).astype(jnp.bfloat16)
        w = (q - 8) * jnp.repeat(scale, group, axis=0)[:k]
        return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)
    return jax.jit(fn)


def _device_name() -> str:
    d = jax.devices()[0]
    return f"{d.platform}:{d.device_kind}"


def run(shapes: Iterable[tuple[int, int]] = SHAPES, ms: Iterable[int] = MS,
        schemes: Iterable[str] = tuple(SCHEMES), configs: dict | None = None,
        impls: Iterable[str] = ("auto",), interpret: bool = False, reps: int = 9,
        hbm_bytes_per_s: float = H200_HBM_BYTES_PER_S, log: Callable[[str], None] = print,
        max_copies: int = 64, max_spread_pct: float = 25.0, retries: int = 2) -> list[dict]:
    """Measures every (shape, M) for int4 (and the M=1 row for the other schemes).

    ``configs`` maps ``(N, K, M)`` to an ``MgpuConfig`` (e.g. a sweep's winners); missing
    entries use ``default_mgpu_config``. ``impls`` lists the ``w4a16_matmul`` impls to time per cell.
    A cell whose widest batch spread (kernel or baseline) exceeds ``max_spread_pct`` is timed
    again, up to ``retries`` times; its record keeps the steadiest attempt and lists every
    attempt's widest spread (``attempt_spreads_pct``).
    """
    configs = configs or {}
    if interpret:   # interpret mode measures nothing real: one copy, one warm-up, just the plumbing
        max_copies, warmup, retries = 1, 1, 0
    else:
        warmup = 3
    records = []
    key = jax.random.PRNGKey(0)
    meta = dict(device=_device_name(), jax_version=jax.__version__,
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    for n, k in shapes:
        w_bf16 = [jax.random.normal(jax.random.fold_in(key, c), (k, n), jnp.bfloat16)
                  for c in range(copies_for(k * n * 2, max_copies=max_copies))]
        int4 = make_weight("int4_g128", n, k, key)
        k_even = k + (k % 2)
        codes = jnp.pad(int4["q"], ((0, k_even - k), (0, 0)))
        rows = (codes[0::2] | (codes[1::2] << 4)).astype(jnp.uint8)
        dequant_fn = _xla_dequant_dot_fn(k, 128)
        packed_cache: dict = {}
        for scheme in schemes:
            weight = int4 if scheme == "int4_g128" else make_weight(scheme, n, k, key)
            for m in ms:
                if scheme in M1_ONLY_SCHEMES and m != 1:
                    continue
                # As many distinct x as a program has calls of the dequant+dot (which reads one
                # copy of the codes), so XLA merges none of them.
                n_x = copies_for(k * n // 2 + m * k * 2, max_copies=max_copies)
                xs = [jax.random.normal(jax.random.fold_in(key, 100 + c), (m, k), jnp.bfloat16)
                      for c in range(n_x)]
                # Baselines and impls of a cell are timed in turn, so a drift of the
                # device's clocks falls on all of them alike and their ratios hold.
                cands = {}
                if scheme == "int4_g128" or m == 1:
                    cands["xla_bf16"] = (jnp.dot, [(xs[c % n_x], w) for c, w in enumerate(w_bf16)])
                    cands["xla_dequant_dot"] = (dequant_fn, [(x, rows, int4["scale"]) for x in xs])
                timed = {}
                packed = _packed(packed_cache, scheme, weight, max_copies)
                for impl in impls:
                    mode = resolve_impl(impl, m, interpret, weight_elems=n * k)
                    cfg = None
                    if mode == "mgpu":
                        cfg = configs.get((n, k, m)) or default_mgpu_config(m, packed[0])
                    fn = jax.jit(lambda x, p, _impl=impl, _cfg=cfg: w4a16_matmul(
                        x, p, impl=_impl, config=_cfg, interpret=interpret))
                    args = [(xs[c % n_x], p) for c, p in enumerate(packed)]
                    try:
                        jax.block_until_ready(fn(*args[0]))
                    except Exception as e:  # one failing cell must not end the run
                        log(f"  FAILED {scheme} {n}x{k} M={m} impl={impl}: {type(e).__name__}: {e}")
                        continue
                    cands[f"impl:{impl}"] = (fn, args)
                    timed[impl] = (mode, cfg, packed)
                # 10 ms batches: the H200 A/Bs timed with them ran steady, the two H200 runs
                # with 2 ms batches did not (batch spreads in bench/results/h200/w4a16.md).
                times, attempts = time_steadiest(
                    lambda cands=cands: time_interleaved(
                        cands, warmup=warmup, reps=reps,
                        min_batch_s=1e-3 if interpret else 10e-3),
                    max_spread_pct, retries)
                baselines = {b: times[b].median_us for b in ("xla_bf16", "xla_dequant_dot")
                             if b in times}
                spread = {b: spread_pct(times[b]) for b in baselines}
                for impl, (mode, cfg, packed) in timed.items():
                    t = times[f"impl:{impl}"]
                    nbytes = array_bytes(packed[0], xs[0]) + m * n * 2
                    roof = roofline(t.median_us, nbytes, 2 * m * n * k, hbm_bytes_per_s)
                    rec = dict(op=f"w4a16_{mode}", impl=impl, scheme=scheme, M=m, N=n, K=k,
                               time_us=round(t.median_us, 2),
                               baselines={b: round(v, 2) for b, v in baselines.items()},
                               spread_pct=spread_pct(t), baseline_spread_pct=spread,
                               attempt_spreads_pct=attempts,
                               config=dataclasses.asdict(cfg) if cfg else None,
                               tb_per_s=round(roof.tb_per_s, 3),
                               tflop_per_s=round(roof.tflop_per_s, 2),
                               pct_of_byte_floor=round(roof.pct_of_byte_floor, 1), **meta)
                    if "xla_bf16" in baselines:
                        rec["speedup_vs_bf16"] = round(baselines["xla_bf16"] / t.median_us, 3)
                    records.append(rec)
                    log(f"  {scheme:9s} {n}x{k} M={m:<5d} {rec['op']:11s} {rec['time_us']:9.1f} us"
                        f"  bf16 {baselines.get('xla_bf16', float('nan')):9.1f}"
                        f"  x{rec.get('speedup_vs_bf16', float('nan')):.2f}"
                        f"  {rec['tb_per_s']:.2f} TB/s")
    return records


def _packed(cache: dict, scheme: str, weight: dict, max_copies: int) -> list[PackedW4NK]:
    """Copies of the weight in the kernel's layout."""
    if scheme not in cache:
        one = prepack_nk(weight["q"], weight["scale"], group_size=weight["group_size"],
                         lut=weight["lut"], global_scale=weight["global_scale"])
        copies = copies_for(one.nbytes, max_copies=max_copies)
        # Copies are distinct buffers holding the same values: the L2 never has the next one.
        cache[scheme] = [one] + [jax.tree_util.tree_map(lambda a: a.copy(), one)
                                 for _ in range(copies - 1)]
    return cache[scheme]


def to_markdown(records: list[dict]) -> str:
    head = ("| scheme | N×K | M | op | µs | XLA bf16 µs | XLA dequant+dot µs | vs bf16 | TB/s | "
            "% byte floor | spread % |\n|---|---|---|---|---|---|---|---|---|---|---|\n")
    rows = []
    for r in records:
        b = r["baselines"]
        rows.append(f"| {r['scheme']} | {r['N']}×{r['K']} | {r['M']} | {r['op']} | {r['time_us']} | "
                    f"{b.get('xla_bf16', '')} | {b.get('xla_dequant_dot', '')} | "
                    f"{r.get('speedup_vs_bf16', '')} | {r['tb_per_s']} | {r['pct_of_byte_floor']} | "
                    f"{_cell_spread(r)} |")
    meta = records[0] if records else {}
    title = (f"# W4A16 benchmark\n\n{meta.get('device', '')}, JAX {meta.get('jax_version', '')}, "
             f"{meta.get('date', '')}\n\n")
    return title + head + "\n".join(rows) + "\n"


def _cell_spread(record: dict) -> str:
    """The widest batch spread among a cell's kernel and baselines ('' for older records)."""
    spreads = [record.get("spread_pct"), *record.get("baseline_spread_pct", {}).values()]
    spreads = [v for v in spreads if v is not None]
    return str(max(spreads)) if spreads else ""


def write(records: list[dict], out_dir, stem: str = "w4a16") -> tuple[pathlib.Path, pathlib.Path]:
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    js, md = out / f"{stem}.json", out / f"{stem}.md"
    js.write_text(json.dumps(records, indent=1))
    md.write_text(to_markdown(records))
    return js, md
