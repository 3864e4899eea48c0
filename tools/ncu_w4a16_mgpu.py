"""Launches a few Mosaic GPU W4A16 kernels once each, for Nsight Compute on the H200:

ncu --clock-control none --kernel-name regex:mosaic_gpu --section SpeedOfLight --section Occupancy \
    --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis \
    --section ComputeWorkloadAnalysis --section InstructionStats \
    --csv --page details python3 tools/ncu_w4a16_mgpu.py > ncu.csv

Prints, in launch order, which launch is which (ncu's rows follow the same order): each code
book's default launch at M = 1 on 28672×8192 (the decodes differ in instructions and pipes:
ComputeWorkloadAnalysis shows each pipe's share), then int4 on 8192×8192 and at M = 128.
bench/results/h200_2026-12-01c/ncu_m1.csv was taken with an older list of launches.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp

from jquant.bench import w4a16 as bench
from jquant.pallas_kernels.w4a16_mgpu import default_mgpu_config, prepack_nk, w4a16_mgpu, x_rows

LAUNCHES = [  # (N, K, scheme, M, config or None for the default)
    (28672, 8192, "int4_g128", 1, None),
    (28672, 8192, "mxfp4", 1, None),
    (28672, 8192, "nvfp4", 1, None),
    (28672, 8192, "nf4", 1, None),
    (8192, 8192, "int4_g128", 1, None),
    (28672, 8192, "int4_g128", 128, None),
]


def main() -> int:
    key = jax.random.PRNGKey(0)
    for i, (n, k, scheme, m, cfg) in enumerate(LAUNCHES):
        weight = bench.make_weight(scheme, n, k, key)
        packed = prepack_nk(weight["q"], weight["scale"], group_size=weight["group_size"],
                            lut=weight["lut"], global_scale=weight["global_scale"])
        cfg = cfg or default_mgpu_config(m, packed)
        xs = jax.random.normal(key, (x_rows(m), packed.k_pad), jnp.bfloat16)
        jax.block_until_ready(jax.jit(lambda x, p: w4a16_mgpu(x, p, config=cfg))(xs, packed))
        print(f"launch {i}: {n}x{k} {scheme} M={m} {cfg}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
