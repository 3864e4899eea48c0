"""``jquant bench moe --tp 1,2,4,8``: one MoE layer split over several devices (``jquant.parallel.moe``)
against the same layer on one device, in one run.

A cell is (layer shape, expert format, tokens, devices n, split mode, collectives). Parameters and x are
made as ``jquant bench moe`` makes them (random bf16 of ``MoE.init``'s shapes, ``quantize_experts``), then
placed by ``shard_moe_params``. Candidates, timed interleaved: ``split`` (``MoEParallel.apply``, jitted),
``no_collectives`` (the same with its all-reduce replaced by a stand-in that moves nothing, n > 1: the
difference is the communication the schedule did not hide) and ``one_device`` (the layer as a user runs
it on one device, ``prepare_experts``). A record holds the run's ``device``, ``jax_version``, ``commit``
and ``date``, the shape, tokens, format, n, mode, collectives, µs of each candidate, the speedup over one
device and ``device_bytes`` (what device 0 holds: its experts or slices, the router, the shared expert).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from jquant.bench.records import markdown_title, run_meta
from jquant.bench.timing import device_bytes, spread_pct, time_interleaved
from jquant.kernels.moe.api import prepare_experts
from jquant.kernels.moe.bench import MoEShape, random_params
from jquant.models.moe import quantize_experts

MODES = ("expert", "tensor")


def run_split(shapes: Iterable[MoEShape], tokens: Iterable[int], formats: Sequence[str] | None = None, *,
              tps: Iterable[int] = (1, 2, 4, 8), modes: Iterable[str] = MODES,
              collectives: Iterable[str] = ("psum",), reps: int = 9, cpu: bool = False,
              log: Callable[[str], None] = print,
              on_records: Callable[[list[dict]], Any] | None = None) -> list[dict]:
    """Times every (shape, format, n, mode, collectives, tokens) cell; returns the records (``on_records``
    gets them all after every cell). n = 1 runs the split code on one device (mode as given, psum only).
    ``cpu``: a plumbing check (one warm-up; the timings mean nothing)."""
    from jquant.parallel.moe import moe_parallel, shard_moe_params

    meta, key, records = run_meta(), jax.random.key(0), []
    warmup, min_batch_s = (1, 1e-3) if cpu else (3, 10e-3)
    for shape in shapes:
        model = shape.model()
        bf16 = random_params(model, jax.random.fold_in(key, shape.num_experts))
        xs = {t: jax.random.normal(jax.random.fold_in(key, t), (t, shape.hidden), jnp.bfloat16) for t in tokens}
        apply_one = lambda p, x, model=model: model.apply({"params": p}, x)
        for scheme in formats or shape.formats:
            try:
                qparams, _ = quantize_experts(bf16, scheme)
            except Exception as e:  # one failing format must not end the run
                log(f"  FAILED {shape.name} {scheme}: quantize: {type(e).__name__}: {e}")
                continue
            one_device = prepare_experts(qparams)
            for n in tps:
                for mode in modes:
                    try:
                        sharded = shard_moe_params(moe_parallel(model, n, mode=mode), {"params": qparams})
                    except Exception as e:  # a split this shape does not allow must not end the run
                        log(f"  FAILED {shape.name} {scheme} n={n} {mode}: {type(e).__name__}: {e}")
                        continue
                    held = device_bytes(sharded)
                    for coll in (("psum",) if n == 1 else tuple(collectives)):
                        plan = moe_parallel(model, n, mode=mode, collectives=coll)
                        stand_in = moe_parallel(model, n, mode=mode, collectives=coll, local_collectives=True)
                        for t in tokens:
                            x = jax.device_put(xs[t], NamedSharding(plan.mesh, P()))
                            cands = {"split": (plan.apply, [(sharded, x)]),
                                     "one_device": (apply_one, [(one_device, xs[t])])}
                            if n > 1:
                                cands["no_collectives"] = (stand_in.apply, [(sharded, x)])
                            try:
                                times = time_interleaved(cands, warmup=warmup, reps=reps, min_batch_s=min_batch_s)
                            except Exception as e:  # one failing cell must not end the run
                                log(f"  FAILED {shape.name} {scheme} n={n} {mode} {coll} T={t}: "
                                    f"{type(e).__name__}: {e}"[:400])
                                continue
                            records.append(_record(shape, scheme, t, n, mode, coll, times, held, meta))
                            r = records[-1]
                            log(f"  {shape.name:16s} {scheme:22s} n={n} {mode:6s} {coll:6s} T={t:<5d} "
                                f"{r['time_us']:>9.1f} us  one device {r['one_device_us']:>9.1f}  "
                                f"x{r['speedup_vs_one_device']}  collectives {r['collective_us']} us")
                            if on_records is not None:
                                on_records(records)
                    del sharded
            del qparams, one_device
    return records


def _record(shape: MoEShape, scheme: str, tokens: int, n: int, mode: str, coll: str, times: dict, held: int,
            meta: dict) -> dict:
    median = {name: timing.median_us for name, timing in times.items()}
    t, one = median["split"], median["one_device"]
    alone = median.get("no_collectives", t)
    return dict(op="moe_split", bench="moe_tp", **shape.describe(), tokens=tokens, format=scheme, tp=n, mode=mode,
                collectives=coll, time_us=round(t, 2), one_device_us=round(one, 2),
                speedup_vs_one_device=round(one / t, 3), no_collectives_us=round(alone, 2),
                collective_us=round(t - alone, 2), collective_pct=round(100 * (t - alone) / t, 1),
                device_bytes=held, spread_pct={name: spread_pct(timing) for name, timing in times.items()},
                **meta)


def to_markdown(records: list[dict]) -> str:
    """The records as a table: one row per (shape, format, tokens, n, mode, collectives)."""
    head = ("| shape | format | tokens | devices | mode | collectives | µs | one device µs | vs one device | "
            "collectives µs | device bytes | spread % |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    rows = [f"| {r['shape']} | {r['format']} | {r['tokens']} | {r['tp']} | {r['mode']} | {r['collectives']} | "
            f"{r['time_us']} | {r['one_device_us']} | {r['speedup_vs_one_device']} | {r['collective_us']} | "
            f"{r['device_bytes']} | {max(r['spread_pct'].values())} |" for r in records]
    detail = ("one MoE layer split over devices (jquant.parallel.moe: expert or tensor parallel, one all-reduce) "
              "against the same layer on one device; collectives µs: the step minus the step with a stand-in "
              "that moves nothing")
    return markdown_title("MoE layer over several devices", records, detail) + head + "\n".join(rows) + "\n"
