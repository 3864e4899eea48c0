"""Where a traced program's device time goes: a ``jax.profiler`` trace of a few steps, and a summary of
its GPU kernels."""

from __future__ import annotations

import collections
import gzip
import json
import pathlib
from typing import Any, Callable

import jax


def trace_steps(folder: str | pathlib.Path, run: Callable[[], Any], steps: int) -> dict:
    """``summarize_trace`` of a ``jax.profiler`` trace written into ``folder`` while ``run()`` dispatches
    ``steps`` steps of compiled programs (compile them first: a trace of compilation says nothing of a
    step) and its result is waited for."""
    with jax.profiler.trace(str(folder)):
        jax.block_until_ready(run())
    return summarize_trace(folder, steps)


def summarize_trace(folder: str | pathlib.Path, steps: int, top: int = 12) -> dict:
    """Per-step figures of the newest ``*.trace.json.gz`` under ``folder``: GPU kernels launched, the sum of
    their durations, the time the GPU was busy (their union), the span from first start to last end, and
    the ``top`` kernels by total time. An empty dict when the trace holds no GPU events (a CPU run)."""
    files = sorted(pathlib.Path(folder).rglob("*.trace.json.gz"), key=lambda p: p.stat().st_mtime)
    if not files:
        return {}
    events = json.load(gzip.open(files[-1]))["traceEvents"]
    gpu = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
           and "GPU" in str(e.get("args", {}).get("name", ""))}
    kernels = [e for e in events if e.get("ph") == "X" and e.get("pid") in gpu and e.get("dur", 0) > 0]
    if not kernels:
        return {}
    spans = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in kernels)
    busy, end = 0.0, spans[0][0]
    for s, t in spans:
        busy += max(0.0, t - max(s, end))
        end = max(end, t)
    by_name = collections.defaultdict(lambda: [0, 0.0])
    for e in kernels:
        by_name[e["name"]][0] += 1
        by_name[e["name"]][1] += float(e["dur"])
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
    return dict(kernels_per_step=round(len(kernels) / steps, 1),
                kernel_us_per_step=round(sum(float(e["dur"]) for e in kernels) / steps, 1),
                busy_us_per_step=round(busy / steps, 1),
                span_us_per_step=round((spans[-1][1] - spans[0][0]) / steps, 1),
                top=[dict(name=n[:120], calls_per_step=round(c / steps, 1), us_per_step=round(d / steps, 1))
                     for n, (c, d) in ranked])
