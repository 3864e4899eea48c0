"""One run on an H200: W4A16 kernel correctness, a small tile sweep, then the full benchmark.

    PYTHONPATH=. python3 tools/device_w4a16.py --out $OUT [--quick] [--skip-sweep] [--skip-bench]
        [--variants]

Writes into --out: correctness.json, sweep.json, w4a16.json, w4a16.md, log.txt; with --variants
also variants.json, variants.md and auto_dispatch.json (tools/device_w4a16_variants.py: base against
each kernel variant, ~3 minutes). Every variant runs inside its own try/except: a failure is printed
and the run goes on. Budget: < 8 minutes; the variant comparison alone:
    PYTHONPATH=. python3 tools/device_w4a16.py --out $OUT --variants --skip-correctness \
        --skip-sweep --skip-bench
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from jquant.bench import w4a16 as bench
from jquant.bench.timing import copies_for, measure_hbm_bandwidth, roofline, time_fn
from jquant.pallas_kernels import TuningConfig, prepack, reference, w4a16_matmul
from jquant.pallas_kernels.w4a16_triton import effective_split

T0 = time.time()
LOG: list[str] = []


def log(msg: str) -> None:
    line = f"[{time.time() - T0:6.1f}s] {msg}"
    LOG.append(line)
    print(line, flush=True)


# ---- (1) correctness -------------------------------------------------------------------------------
CORRECTNESS = [
    # (name, lut, group, asym, scale dtype, act_order, global scale)
    ("int4_sym_g128", "int4", 128, False, jnp.float16, False, None),
    ("int4_asym_g128", "int4", 128, True, jnp.bfloat16, False, None),
    ("int4_sym_g32", "int4", 32, False, jnp.bfloat16, False, None),
    ("int4_asym_g64", "int4", 64, True, jnp.float16, False, None),
    ("int4_perchannel", "int4", -1, False, jnp.bfloat16, False, None),
    ("int4_actorder_g128", "int4", 128, False, jnp.float16, True, None),
    ("mxfp4", "e2m1", 32, False, "e8m0", False, None),
    ("nvfp4", "e2m1", 16, False, "e4m3", False, 0.02),
    ("nf4", "nf4", 64, False, jnp.float32, False, None),
]


def correctness() -> list[dict]:
    rng = np.random.default_rng(0)
    results = []
    for (n, k) in ((300, 1024), (4096, 4096)):
        for name, lut, group, asym, sdt, act, gs in CORRECTNESS:
            if n == 4096 and name not in ("int4_sym_g128", "int4_actorder_g128"):
                continue   # the large shape checks tiling at scale; the small one every variant
            q, s, z = bench.random_w4_weight(rng, k, n, group, zeros="int" if asym else None, scale_dtype=sdt)
            g_idx = None
            if act:
                g_idx = rng.permutation(np.arange(k) // group).astype(np.int32)
            try:
                packed = prepack(q, s, z, lut=lut, group_size=group, global_scale=gs, g_idx=g_idx)
            except Exception as e:
                log(f"  prepack FAILED {name}: {type(e).__name__}: {e}")
                continue
            for m, impl, xdt, bias in ((1, "gemv", jnp.bfloat16, False), (3, "gemv", jnp.float16, True),
                                       (16, "mma", jnp.bfloat16, True), (100, "mma", jnp.float16, False),
                                       (100, "xla", jnp.bfloat16, False)):
                x = jnp.asarray(rng.standard_normal((m, k)), xdt)
                b = jnp.asarray(rng.standard_normal(n), jnp.float32) if bias else None
                rec = dict(variant=name, n=n, k=k, m=m, impl=impl, x_dtype=jnp.dtype(xdt).name, bias=bias)
                try:
                    out = jax.jit(lambda x, p, b, _i=impl: w4a16_matmul(x, p, bias=b, impl=_i, poison=True))(
                        x, packed, b)
                    ref = reference(x, packed, b).astype(jnp.float32)
                    out32 = out.astype(jnp.float32)
                    err = float(jnp.linalg.norm(out32 - ref) / jnp.linalg.norm(ref))
                    nan = bool(jnp.isnan(out32).any())
                    rec.update(rel_err=err, nan=nan, ok=bool(err <= 1e-2 and not nan))
                except Exception as e:
                    rec.update(ok=False, error=f"{type(e).__name__}: {e}"[:2000])
                    traceback.print_exc()
                results.append(rec)
                log(f"  {'ok  ' if rec['ok'] else 'FAIL'} {name:20s} {n}x{k} M={m:<3d} {impl:4s} "
                    f"{rec['x_dtype']:8s} bias={bias} err={rec.get('rel_err', float('nan')):.2e} "
                    f"{rec.get('error', '')[:200]}")
    return results


# ---- (2) tuning sweep ------------------------------------------------------------------------------
def _time_config(weight, n, k, m, mode, cfg, reps=5):
    one = prepack(weight["q"], weight["scale"], lut=weight["lut"], group_size=weight["group_size"],
                  global_scale=weight["global_scale"], config=cfg)
    cfg = dataclasses.replace(cfg, block_n=one.block_n, block_k=one.block_k)   # BK fits small G
    packs = [one] + [jax.tree_util.tree_map(lambda a: a.copy(), one)
                     for _ in range(copies_for(one.nbytes, max_copies=8) - 1)]
    xs = [jax.random.normal(jax.random.PRNGKey(c), (m, k), jnp.bfloat16) for c in range(4)]
    fn = jax.jit(lambda x, p: w4a16_matmul(x, p, impl=mode, config=cfg))
    t = time_fn(fn, [(xs[c % 4], p) for c, p in enumerate(packs)], reps=reps)
    return t.median_us, one


def sweep(modes=("gemv", "mma")) -> tuple[list[dict], dict]:
    """A compact grid (~80 configs, ~2 minutes) around the winners of earlier H200 sweeps."""
    rows, best = [], {}
    key = jax.random.PRNGKey(1)
    gemv_grid = [(bn, bk, 16, w, st) for (bn, bk) in ((64, 512), (128, 128), (64, 256), (128, 256))
                 for w, st in ((4, 2), (8, 2), (4, 1))] + [(64, 512, 4, 4, 2), (64, 512, 32, 4, 2)]
    mma_small = [(bn, bk, 16, sk, 4, 2) for (bn, bk) in ((64, 512), (128, 256)) for sk in (2, 4)]
    mma_large = [(bn, bk, bm, sk, w, 2) for (bn, bk) in ((128, 128), (128, 256)) for bm in (64, 128)
                 for sk in (2, 4) for w in (4, 8)]
    plan = [("gemv", 28672, 8192, 1, "int4_g128"), ("gemv", 8192, 8192, 1, "int4_g128"),
            ("gemv", 28672, 8192, 1, "mxfp4"), ("gemv", 28672, 8192, 1, "nf4"),
            ("mma", 28672, 8192, 16, "int4_g128"), ("mma", 8192, 8192, 16, "int4_g128"),
            ("mma", 8192, 8192, 128, "int4_g128"), ("mma", 28672, 8192, 128, "int4_g128")]
    for mode, n, k, m, scheme in [p for p in plan if p[0] in modes]:
        weight = bench.make_weight(scheme, n, k, key)
        log(f"sweep {mode} {scheme} {n}x{k} M={m}")
        grid = gemv_grid if mode == "gemv" else mma_small if m <= 16 else mma_large
        if scheme != "int4_g128":
            grid = grid[::3]
        for g in grid:
            if mode == "gemv":
                bn, bk, sk, w, st = g
                cfg = TuningConfig(bn, bk, sk, w, st, block_m=1)
            else:
                bn, bk, bm, sk, w, st = g
                cfg = TuningConfig(bn, bk, sk, w, st, block_m=bm)
            try:
                us, one = _time_config(weight, n, k, m, mode, cfg)
            except Exception as e:
                log(f"  {cfg}: FAILED {type(e).__name__}: {str(e)[:300]}")
                continue
            split = effective_split(one.data.shape[1], cfg.split_k)
            nbytes = one.nbytes + m * k * 2 + m * n * 2
            roof = roofline(us, nbytes, 2 * m * n * k)
            rows.append(dict(mode=mode, scheme=scheme, N=n, K=k, M=m, config=dataclasses.asdict(cfg),
                             effective_split=split, time_us=round(us, 2),
                             tb_per_s=round(roof.tb_per_s, 3)))
            log(f"  bn={cfg.block_n:3d} bk={cfg.block_k:3d} bm={cfg.block_m:3d} split={split:2d} "
                f"warps={cfg.num_warps} stages={cfg.num_stages}: {us:8.1f} us {roof.tb_per_s:.2f} TB/s")
            k_best = (mode, n, k, m, scheme)
            if k_best not in best or us < best[k_best][0]:
                best[k_best] = (us, cfg)
    return rows, best


def probe() -> None:
    """Where the gemv time goes at M=1, 28672×8192: the full kernel against the same kernel with the
    nibble decode replaced by a bare bitcast (memory + multiply-accumulate only)."""
    from jquant.pallas_kernels import w4a16_triton as kt
    weight = bench.make_weight("int4_g128", 28672, 8192, jax.random.PRNGKey(2))
    real = kt._decode_plane
    for name, decode in (("full decode", real),
                         ("bitcast only", lambda u, u_hi, i, lut: (
                             jax.lax.bitcast_convert_type(u, jnp.float32), 1.0))):
        kt._decode_plane = decode
        for cfg in (TuningConfig(128, 128, 16, 4, 2, 1), TuningConfig(64, 512, 16, 8, 2, 1)):
            try:
                us, _ = _time_config(weight, 28672, 8192, 1, "gemv", cfg)
                log(f"  probe {name:12s} {cfg}: {us:.1f} us")
            except Exception as e:
                log(f"  probe {name} {cfg} FAILED {type(e).__name__}: {str(e)[:200]}")
    kt._decode_plane = real
    for body in ("sum", "scalar", "bcast", "bcast_affine", "bcast_decode"):
        try:
            log(f"  probe body={body:13s}: {_probe_body(body):.1f} us")
        except Exception as e:
            log(f"  probe body={body} FAILED {type(e).__name__}: {str(e)[:300]}")


def _probe_body(body: str, n=28672, k=8192, bn=128, bk=128, split=16) -> float:
    """A stripped gemv over the same tile-major words: which per-element step costs what."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu
    p, nt, kt_n = bk // 8, n // bn, k // bk
    tiles = kt_n // split

    def kernel(x_ref, w_ref, s_ref, o_ref):
        pk = pl.program_id(1)

        def step(t, acc):
            kk = pk * tiles + t
            u = jax.lax.bitcast_convert_type(w_ref[kk], jnp.uint32)
            a = s_ref[kk, :].astype(jnp.float32)
            for i in range(8):
                if body == "bcast_decode":
                    v = jax.lax.bitcast_convert_type(((u << np.uint32(19 - 4 * i) if i < 5 else
                                                       u >> np.uint32(4 * i - 19))
                                                      & np.uint32(0x780000)) | np.uint32(0x3F800000),
                                                     jnp.float32)
                else:
                    v = jax.lax.bitcast_convert_type(u, jnp.float32)
                x = x_ref[0, pl.ds(kk * bk + i * p, p)].astype(jnp.float32)
                if body == "sum":
                    acc = acc + v
                elif body == "scalar":
                    acc = acc + v * x_ref[0, kk].astype(jnp.float32)
                elif body == "bcast":
                    acc = acc + x[:, None] * v
                else:
                    acc = acc + x[:, None] * (v * a[None, :] + a[None, :])
            return acc

        acc = jax.lax.fori_loop(0, tiles, step, jnp.zeros((p, bn), jnp.float32))
        o_ref[0, :] = jnp.sum(acc, axis=0)

    call = pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((split, 1, n), jnp.float32), grid=(nt, split),
        in_specs=[pl.BlockSpec((1, k), lambda j, s: (0, 0)),
                  pl.BlockSpec((None, kt_n, p, bn), lambda j, s: (j, 0, 0, 0)),
                  pl.BlockSpec((None, kt_n, bn), lambda j, s: (j, 0, 0))],
        out_specs=pl.BlockSpec((None, 1, bn), lambda j, s: (s, 0, j)),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2))
    fn = lambda x, w, sc: jnp.sum(call(x, w, sc), axis=0)
    args = [(jax.random.normal(jax.random.PRNGKey(c), (1, k), jnp.bfloat16),
             jax.random.randint(jax.random.PRNGKey(c), (nt, kt_n, p, bn), 0, 2**30, jnp.int32),
             jnp.ones((nt, kt_n, bn), jnp.bfloat16)) for c in range(2)]
    return time_fn(fn, args).median_us


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--quick", action="store_true", help="3 shapes × 4 M in the benchmark")
    parser.add_argument("--skip-sweep", action="store_true")
    parser.add_argument("--skip-bench", action="store_true")
    parser.add_argument("--skip-correctness", action="store_true")
    parser.add_argument("--sweep-modes", default="gemv,mma", help="kernels the sweep covers")
    parser.add_argument("--probe", action="store_true", help="time the gemv decode's share first")
    parser.add_argument("--variants", action="store_true", help="base against each kernel variant")
    args = parser.parse_args(argv)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log(f"devices {jax.devices()} jax {jax.__version__}")
    hbm = 4.18e12
    try:
        hbm = measure_hbm_bandwidth()
        log(f"HBM f32 x+1: {hbm / 1e12:.2f} TB/s")
    except Exception as e:
        log(f"bandwidth probe FAILED: {e}")

    if args.probe:
        log("(0) probe")
        probe()
    if args.variants:
        log("(0b) kernel variants")
        import device_w4a16_variants   # beside this file
        device_w4a16_variants.run(out, log)
    if not args.skip_correctness:
        log("(1) correctness")
        res = correctness()
        (out / "correctness.json").write_text(json.dumps(res, indent=1))
        log(f"correctness: {sum(r['ok'] for r in res)}/{len(res)} ok")

    configs = {}
    if not args.skip_sweep:
        log("(2) sweep")
        try:
            rows, best = sweep(tuple(args.sweep_modes.split(",")))
            (out / "sweep.json").write_text(json.dumps(rows, indent=1))
            log("best configs:")
            for (mode, n, k, m, scheme), (us, cfg) in best.items():
                log(f"  {mode} {scheme} {n}x{k} M={m}: {us:.1f} us  {cfg}")
                if scheme == "int4_g128":
                    configs[(mode, n, k, m)] = cfg
        except Exception:
            traceback.print_exc()

    if not args.skip_bench:
        log("(3) benchmark")
        shapes = bench.QUICK_SHAPES if args.quick else bench.SHAPES
        ms = bench.QUICK_MS if args.quick else bench.MS
        records = []
        try:
            records = bench.run(shapes, ms, configs=configs, hbm_bytes_per_s=hbm,
                                log=lambda s: log(s))
        except Exception:
            traceback.print_exc()
        bench.write(records, out)
        print(bench.to_markdown(records), flush=True)
    (out / "log.txt").write_text("\n".join(LOG))
    log("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
