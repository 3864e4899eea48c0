"""Benchmarks: a timing harness with roofline figures, and the W4A16 kernel benchmark."""

from jquant.apps.bench import main
from jquant.bench.timing import (Roofline, Timing, array_bytes, copies_for, device_bytes,
                                 device_hbm_bytes_per_s, measure_hbm_bandwidth, roofline, spread_pct,
                                 time_fn, time_interleaved, time_steadiest)

__all__ = ["Roofline", "Timing", "array_bytes", "copies_for", "device_bytes", "device_hbm_bytes_per_s", "main",
           "measure_hbm_bandwidth", "roofline", "spread_pct", "time_fn", "time_interleaved", "time_steadiest"]
