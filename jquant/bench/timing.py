"""Timing harness: jitted calls, warm-up, median of repeated batches, inputs rotated past the L2.

A batch of back-to-back calls ends with one ``block_until_ready``, so the figure is the device time
per call, launch gaps inside one XLA program included, the way a model step sees it. The calls of a
rotation each take the next of several input copies, so a weight that fits the L2 (60 MB on an
H200) is not re-read from it, and so a program holds enough device work to hide its host
dispatch (``copies_for``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import pathlib
import statistics
import subprocess
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jquant.schemes import dispatch

H200_L2_BYTES = 60 * 2**20
# The H200's rate, measured: f32 ``x + 1`` over 4 GiB (bench/README.md, Rooflines). A reference for
# records of that device; a benchmark takes its floor from ``device_hbm_bytes_per_s``.
H200_HBM_BYTES_PER_S = 4.18e12
_CHECKOUT = pathlib.Path(__file__).resolve().parents[2]   # the checkout holding the jquant package


@dataclasses.dataclass(frozen=True)
class Timing:
    """Per-call times in µs: the median and minimum over batches, and every batch's mean.

    Examples:
      >>> from jquant.bench import Timing, spread_pct
      >>> t = Timing(median_us=10.0, min_us=9.0, batches_us=(9.0, 10.0, 12.0), calls_per_batch=4)
      >>> t.median_us, spread_pct(t)  # (12 - 9) / 10
      (10.0, 30.0)
    """

    median_us: float
    min_us: float
    batches_us: tuple[float, ...]
    calls_per_batch: int


def _block(out) -> None:
    jax.tree_util.tree_map(lambda a: a.block_until_ready() if hasattr(a, "block_until_ready") else a,
                           out)


def time_fn(fn: Callable, args_list: Sequence[tuple], warmup: int = 3, reps: int = 5,
            calls_per_batch: int | None = None, min_batch_s: float = 2e-3,
            max_calls: int = 400) -> Timing:
    """Times ``fn`` over input tuples rotated from ``args_list``; returns µs per call.

    One jitted program calls ``fn`` once on every tuple of ``args_list`` (so Python's per-dispatch
    cost, tens of µs, is paid once per rotation, not per call, and the device runs the calls back to
    back); a batch repeats that program until it lasts ``min_batch_s`` (or ``calls_per_batch``
    calls, rounded up to whole rotations; at most ``max_calls``).

    Examples:
      Two input copies, 4 calls a batch (2 rotations), 3 batches:

      >>> import jax.numpy as jnp
      >>> from jquant.bench import time_fn
      >>> args = [(jnp.ones(256),), (jnp.zeros(256),)]
      >>> t = time_fn(lambda a: a * 2 + 1, args, warmup=1, reps=3, calls_per_batch=4)
      >>> t.calls_per_batch, len(t.batches_us), 0 < t.min_us <= t.median_us
      (4, 3, True)
    """
    return time_interleaved({"fn": (fn, args_list)}, warmup=warmup, reps=reps,
                            calls_per_batch=calls_per_batch, min_batch_s=min_batch_s,
                            max_calls=max_calls)["fn"]


def time_interleaved(candidates: dict[str, tuple[Callable, Sequence[tuple]]], warmup: int = 3,
                     reps: int = 9, calls_per_batch: int | None = None,
                     min_batch_s: float = 10e-3, max_calls: int = 4000) -> dict[str, Timing]:
    """Times several ``(fn, args_list)`` candidates as ``time_fn`` does, but interleaved: each of
    the ``reps`` repetitions runs one batch of every candidate in turn, so a drift of the device's
    clocks or temperature during the run falls on all of them alike instead of on whichever was
    timed last. Returns µs per call by name.

    Examples:
      >>> import jax.numpy as jnp
      >>> from jquant.bench import time_interleaved
      >>> x = jnp.ones((64, 64))
      >>> times = time_interleaved({"add": (lambda a: a + 1, [(x,)]), "matmul": (lambda a: a @ a, [(x,)])},
      ...                          warmup=1, reps=2, calls_per_batch=2)
      >>> sorted(times), [len(t.batches_us) for t in times.values()]
      (['add', 'matmul'], [2, 2])
    """
    if warmup < 1 or reps < 1:
        raise ValueError(f"warmup and reps must be ≥ 1, got warmup={warmup}, reps={reps}")
    for name, (_, args_list) in candidates.items():
        if not args_list:
            raise ValueError(f"args_list of {name!r} must hold at least one tuple of arguments")
    batchers = {}
    for name, (fn, args_list) in candidates.items():
        rotation = jax.jit(lambda all_args, fn=fn: tuple(fn(*a) for a in all_args))
        args = tuple(tuple(a) for a in args_list)
        for _ in range(warmup):
            _block(rotation(args))
        batchers[name] = (rotation, args)

    def batch(name: str, rotations: int) -> float:
        rotation, args = batchers[name]
        start = time.perf_counter()
        out = None
        for _ in range(rotations):
            out = rotation(args)
        _block(out)
        return time.perf_counter() - start

    rotations = {}
    for name, (_, args) in batchers.items():
        n = len(args)
        calls = calls_per_batch
        if calls is None:
            probe = batch(name, 1) / n
            calls = int(min(max_calls, max(n, math.ceil(min_batch_s / max(probe, 1e-9)))))
        rotations[name] = max(1, -(-calls // n))
    samples = {name: [] for name in batchers}
    for _ in range(reps):
        for name, (_, args) in batchers.items():
            samples[name].append(1e6 * batch(name, rotations[name]) / (rotations[name] * len(args)))
    return {name: Timing(statistics.median(v), min(v), tuple(v), rotations[name] * len(batchers[name][1]))
            for name, v in samples.items()}


def spread_pct(t: Timing) -> float:
    """(slowest − fastest batch) / median, in %: how far a figure can be trusted.

    Examples:
      >>> from jquant.bench import Timing, spread_pct
      >>> spread_pct(Timing(median_us=20.0, min_us=19.0, batches_us=(19.0, 20.0, 21.0), calls_per_batch=8))
      10.0
    """
    return round(100.0 * (max(t.batches_us) - min(t.batches_us)) / t.median_us, 1)


def time_steadiest(time_once: Callable[[], dict[str, Timing]], max_spread_pct: float,
                   retries: int) -> tuple[dict[str, Timing], list[float]]:
    """Calls ``time_once`` (one interleaved timing of a cell's candidates) until the widest batch
    spread among its candidates is at most ``max_spread_pct``, at most ``1 + retries`` times,
    and returns the steadiest attempt with every attempt's widest spread. Why: on a shared
    device a burst of noise can move one cell's medians by 20–50 % (H200: 42.9–69.4 µs for one
    cell in four runs of a day, docs/design/w4a16.md); the spread shows it, and a second attempt
    usually misses it.

    Examples:
      A noisy first attempt (spread 50 %), a steady second one (5 %):

      >>> from jquant.bench import Timing, time_steadiest
      >>> attempts = iter([{"f": Timing(10.0, 8.0, (8.0, 10.0, 13.0), 4)},
      ...                  {"f": Timing(10.0, 9.8, (9.8, 10.0, 10.3), 4)}])
      >>> times, spreads = time_steadiest(lambda: next(attempts), max_spread_pct=10.0, retries=3)
      >>> times["f"].min_us, spreads
      (9.8, [50.0, 5.0])
    """
    if retries < 0 or max_spread_pct < 0:
        raise ValueError(f"retries and max_spread_pct must be ≥ 0, got retries={retries}, "
                         f"max_spread_pct={max_spread_pct}")
    best, spreads = None, []
    for _ in range(1 + retries):
        times = time_once()
        spreads.append(max(spread_pct(t) for t in times.values()))
        if best is None or spreads[-1] < best[1]:
            best = (times, spreads[-1])
        if spreads[-1] <= max_spread_pct:
            break
    return best[0], spreads


def copies_for(bytes_per_set: int, l2_bytes: int = H200_L2_BYTES, max_copies: int = 64,
               min_bytes: int = 2**30) -> int:
    """How many input copies one rotation (one program) takes: enough to read at least twice the
    L2 and at least ``min_bytes`` (2 ≤ copies ≤ ``max_copies``). The second bound keeps the
    device busier than the host: a program costs ~80 µs to dispatch whatever it runs (H200
    launch-overhead probe, docs/design/w4a16.md), so one of a few short calls is timed at the
    host's pace.

    Examples:
      >>> from jquant.bench import copies_for
      >>> copies_for(2**30), copies_for(200 * 2**20), copies_for(2**20)  # 1 GiB, 200 MiB, 1 MiB a set
      (2, 6, 64)
    """
    need = max(2 * l2_bytes, min_bytes) / max(bytes_per_set, 1)
    return int(min(max_copies, max(2, math.ceil(need))))


def measure_hbm_bandwidth(nbytes: int = 2**30) -> float:
    """Bytes/s of an f32 ``x + 1`` over ``nbytes`` (read + write counted).

    Examples:
      >>> from jquant.bench import measure_hbm_bandwidth
      >>> measure_hbm_bandwidth(nbytes=2**20) > 0  # a 1 MiB probe; the default reads and writes 1 GiB
      True
    """
    x = jnp.zeros((nbytes // 4,), jnp.float32) + 1.0
    t = time_fn(lambda a: a + 1.0, [(x,)], warmup=2, reps=3, calls_per_batch=5)
    return 2 * nbytes / (t.median_us * 1e-6)


@functools.cache
def device_hbm_bytes_per_s() -> float:
    """The HBM rate of the device this process runs on, in bytes/s: ``measure_hbm_bandwidth`` over
    1 GiB on a GPU, over 4 MiB elsewhere (a CPU run only checks a benchmark's plumbing), measured once
    per process. The benchmarks' byte floors use it, so their % of floor is against the device that ran
    them, not the H200's 4.18 TB/s.

    Examples:
      >>> from jquant.bench import device_hbm_bytes_per_s
      >>> rate = device_hbm_bytes_per_s()
      >>> rate > 0 and device_hbm_bytes_per_s() == rate  # measured on the first call only
      True
    """
    return measure_hbm_bandwidth(2**30 if dispatch.is_gpu() else 2**22)


@dataclasses.dataclass(frozen=True)
class Roofline:
    """Figures for one timed op: achieved bandwidth and rate, and the share of the byte floor.

    Examples:
      >>> from jquant.bench import roofline
      >>> from jquant.bench.timing import H200_HBM_BYTES_PER_S
      >>> r = roofline(time_us=200.0, nbytes=418_000_000, flops=2 * 10**10,  # half the H200's 4.18 TB/s
      ...              hbm_bytes_per_s=H200_HBM_BYTES_PER_S)
      >>> [f"{value:.2f}" for value in (r.tb_per_s, r.tflop_per_s, r.byte_floor_us, r.pct_of_byte_floor)]
      ['2.09', '100.00', '100.00', '50.00']
    """

    tb_per_s: float
    tflop_per_s: float
    byte_floor_us: float
    pct_of_byte_floor: float


def roofline(time_us: float, nbytes: int, flops: int, hbm_bytes_per_s: float) -> Roofline:
    """``pct_of_byte_floor`` = byte-floor time / measured time (100 % = at the memory roof), the floor
    being ``nbytes`` at ``hbm_bytes_per_s`` (no default: the device's own rate, ``device_hbm_bytes_per_s``
    in a benchmark).

    Examples:
      A weight read of 4 MB in 2 µs on a device of 4 TB/s (the byte floor is 1 µs):

      >>> from jquant.bench import roofline
      >>> r = roofline(time_us=2.0, nbytes=4_000_000, flops=0, hbm_bytes_per_s=4e12)
      >>> [f"{value:.2f}" for value in (r.byte_floor_us, r.pct_of_byte_floor, r.tb_per_s)]
      ['1.00', '50.00', '2.00']
    """
    if time_us <= 0:
        raise ValueError(f"time_us must be positive, got {time_us}")
    floor_us = 1e6 * nbytes / hbm_bytes_per_s
    return Roofline(tb_per_s=nbytes / (time_us * 1e-6) / 1e12,
                    tflop_per_s=flops / (time_us * 1e-6) / 1e12,
                    byte_floor_us=floor_us, pct_of_byte_floor=100.0 * floor_us / time_us)


def array_bytes(*trees: Any) -> int:
    """Bytes of every array leaf in ``trees`` (4-bit dtypes count half a byte per element).

    Examples:
      >>> import jax.numpy as jnp
      >>> from jquant.bench import array_bytes
      >>> array_bytes(jnp.zeros((4, 4), jnp.float32), {"codes": jnp.zeros(8, jnp.int4), "n": 3})
      68
    """
    return sum(-(-int(np.prod(a.shape)) * jnp.iinfo(a.dtype).bits // 8)
               if jnp.issubdtype(a.dtype, jnp.integer) and jnp.iinfo(a.dtype).bits < 8
               else int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize
               for t in trees for a in jax.tree_util.tree_leaves(t) if hasattr(a, "dtype"))


def device_bytes(tree: Any) -> int:
    """Bytes the first device holds of ``tree``'s arrays: its piece of a split leaf, a replicated leaf
    whole (what one device of a tensor-parallel model reads).

    Examples:
      >>> import jax.numpy as jnp
      >>> from jquant.bench import device_bytes
      >>> device_bytes({"w": jnp.zeros((4, 8), jnp.bfloat16), "b": jnp.zeros(8, jnp.float32)})
      96
    """
    return array_bytes([a.addressable_shards[0].data for a in jax.tree_util.tree_leaves(tree)])


def source_commit(checkout: str | os.PathLike | None = None) -> str:
    """The commit whose code a run measured, for its records: ``$JQUANT_COMMIT`` when set (a copy of the
    code on a benchmark machine may carry a stale ``.git``), else ``git rev-parse HEAD`` of ``checkout``
    (default: the one holding this package) when it is a git checkout, else ``"unknown"``. Uncommitted
    edits are not reflected."""
    if os.environ.get("JQUANT_COMMIT"):
        return os.environ["JQUANT_COMMIT"]
    root = pathlib.Path(checkout) if checkout is not None else _CHECKOUT
    # Only the checkout's own .git: a copy placed inside another repository must not take its HEAD.
    if (root / ".git").exists():
        try:
            out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                                 text=True, timeout=10, check=True).stdout.strip()
            if out:
                return out
        except (OSError, subprocess.SubprocessError):
            pass
    return "unknown"
