"""One short device check (session 9): the warp-specialized kernel's own final output against
the pure-JAX reference, with bias, act-order and zeros, fp16, NVFP4's global scale, M = 64 …
200 (``ws_check.txt`` in bench/results/h200_2026-12-02d). The full correctness stage of
tools/device_w4a16_mgpu.py covers the same launches, at a few minutes per run.

Run on the GPU machine: ``PYTHONPATH=. python3 tools/device_ws_final_check.py``."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jquant.bench.w4a16 import random_w4_weight
from jquant.pallas_kernels.w4a16_mgpu import (default_mgpu_config, prepack_nk, reference_nk,
                                              w4a16_mgpu_matmul)

CASES = (  # k, n, group, zeros, m, x dtype, act-order, code book
    (2048, 1024, 128, "int", 64, jnp.bfloat16, True, "int4"),
    (2048, 1024, 128, None, 100, jnp.float16, False, "int4"),
    (2048, 1024, 16, None, 128, jnp.bfloat16, False, "e2m1"),      # NVFP4 + global scale
    (4096, 28672, 128, None, 200, jnp.bfloat16, False, "int4"),    # the default WS launch
)


def main():
    rng = np.random.default_rng(1)
    for k, n, g, z, m, dt, act, lut in CASES:
        q, s, zz = random_w4_weight(rng, k, n, g, zeros=z,
                                    scale_dtype="e4m3" if lut == "e2m1" else "bf16")
        g_idx = rng.permutation(np.arange(k) // g).astype(np.int32) if act else None
        p = prepack_nk(q, s, zz, group_size=g, g_idx=g_idx, lut=lut,
                       global_scale=0.05 if lut == "e2m1" else None)
        x = jnp.asarray(rng.standard_normal((m, k)), dt)
        b = jnp.asarray(rng.standard_normal(n), dt)
        cfg = default_mgpu_config(m, p)
        if cfg.compute_wgs == 1:   # N = 1024 is too narrow for the WS default: force it
            cfg = dataclasses.replace(cfg, block_n=256, compute_wgs=2, block_k=64, split_k=1,
                                      final_output=True, group_acc=False, wide_rows=False)
        got = np.asarray(jax.jit(lambda x, p, b: w4a16_mgpu_matmul(x, p, b, config=cfg))(
            x, p, b), np.float32)
        ref = np.asarray(reference_nk(x, p, b), np.float32)
        err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
        ok = err <= 1e-2 and np.isfinite(got).all()
        print("WSCHECK", "ok" if ok else "FAIL", k, n, g, z, m, dt.__name__, act, lut, cfg, err,
              flush=True)


if __name__ == "__main__":
    main()
