"""What every benchmark record carries about its run, and how a record list is written."""

from __future__ import annotations

import datetime
import os
import json
import pathlib
from typing import Callable

import jax
import numpy as np

from jquant.bench.timing import source_commit
from jquant.schemes.dispatch import device_name


def run_meta() -> dict:
    """``device`` (platform:device_kind), ``jax_version``, ``commit``, ``date`` (UTC, the run's start) and
    ``xla_flags`` (``$XLA_FLAGS``: command buffers and the like change a step's time)."""
    return dict(device=device_name(), jax_version=jax.__version__, commit=source_commit(),
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                xla_flags=os.environ.get("XLA_FLAGS", ""))


def markdown_title(title: str, records: list[dict], detail: str = "") -> str:
    """``# title`` and the run line every results table opens with: device, JAX version, date and commit
    of the first record (of every run, in order, where the records come from several) and ``detail``,
    then a blank line.

    Examples:
      >>> recs = [dict(device="gpu:H100", jax_version="0.11.2", date="2026-12-05T16:47", commit="b6a6264"),
      ...         dict(device="gpu:H100", jax_version="0.11.2", date="2026-12-05T17:14", commit="e81228d")]
      >>> markdown_title("Decode", recs).splitlines()[2]
      'gpu:H100, JAX 0.11.2, runs 2026-12-05T16:47 (commit b6a6264), 2026-12-05T17:14 (commit e81228d)'
    """
    meta = records[0] if records else {}
    runs = sorted(dict.fromkeys((r.get("date", ""), r.get("commit")) for r in records), key=lambda run: run[0])
    if len(runs) > 1:
        when = "runs " + ", ".join(f"{date} (commit {commit})" for date, commit in runs)
    else:
        when = meta.get("date", "") + (f", commit {meta['commit']}" if "commit" in meta else "")
    detail = f"; {detail}" if detail else ""
    return f"# {title}\n\n{meta.get('device', '')}, JAX {meta.get('jax_version', '')}, {when}{detail}\n\n"


def write_records(records: list[dict], out_dir, stem: str,
                  to_markdown: Callable[[list[dict]], str]) -> tuple[pathlib.Path, pathlib.Path]:
    """``<out_dir>/<stem>.json`` (the records) and ``<stem>.md`` (``to_markdown`` of them)."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    js, md = out / f"{stem}.json", out / f"{stem}.md"
    js.write_text(json.dumps(records, indent=1))
    md.write_text(to_markdown(records))
    return js, md


def same_bits(a, b) -> bool:
    """Whether two pytrees hold the same arrays, bit for bit (NaN payloads and -0.0 included)."""
    bits = lambda x: np.atleast_1d(np.asarray(x)).view(np.uint8)
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(np.array_equal(bits(x), bits(y)) for x, y in zip(la, lb))
