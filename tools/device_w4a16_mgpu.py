"""One H200 run for the Mosaic GPU W4A16 kernel: correctness on the device, then a launch sweep
against XLA bf16 (and the Triton kernels at M = 1) measured in the same process.

PYTHONPATH=. python3 tools/device_w4a16_mgpu.py --out $OUT [--quick] [--skip-sweep]
    [--ab] [--group-acc-ab] [--latency-probe] [--wide-rows] [--ws-wide] [--ws-small-m]
    [--copy-probe] [--stream-probe] [--pipeline-probe] [--codebook-ab] [--word-order-ab]
    [--small-m-launch-ab] [--decode-ab] [--final-output-ab] [--launch-overhead-probe]
    [--skip-correctness]
Writes mgpu_correctness.json and mgpu_sweep.json, and one JSON per extra stage (rewritten after
each cell): mgpu_ab.json, group_acc_ab.json, latency_probe.json, wide_rows_ab.json, ws_wide_ab.json,
ws_small_m_ab.json, copy_probe.json, stream_probe.json, codebook_ab.json, word_order_ab.json,
small_m_launch_ab.json, decode_ab.json, final_output_ab.json, pipeline_probe.json, launch_overhead_probe.json;
gpu_state.txt logs nvidia-smi's clocks and other processes between stages. The A/B stages live in
device_w4a16_mgpu_ab.py, the probes in device_w4a16_mgpu_probes.py (beside this file).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import pathlib
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jquant.bench import w4a16 as bench
from jquant.bench.timing import time_fn, time_interleaved
from jquant.formats import bnb
from jquant.pallas_kernels.w4a16_mgpu import (MgpuConfig, default_mgpu_config, prepack_nk,
                                              w4a16_mgpu, w4a16_mgpu_matmul)
from jquant.pallas_kernels.w4a16_mgpu_common import group_acc_fits
from tools.device_w4a16_mgpu_ab import (CODEBOOK_AB_PLAN, FINAL_OUTPUT_PLAN, SMALL_M_LAUNCH_PLAN,
                                        WIDE_ROWS_PLAN, add_candidate,
                                        decode_default_variants,
                                        WORD_ORDER_AB_PLAN, WS_SMALL_M_PLAN, WS_WIDE_PLAN,
                                        codebook_ab, final_output_variants, launch_ab,
                                        log, record_cell,
                                        small_m_launch_variants, weight_operands,
                                        wide_rows_variants, ws_launches,
                                        ws_small_m_variants, ws_wide_variants)
from tools.device_w4a16_mgpu_probes import (copy_probe, gpu_state, latency_probe,
                                            launch_overhead_probe, pipeline_probe, stream_probe)


def correctness(luts=("int4", "e2m1", "nf4", "fp4_bnb")) -> list[dict]:
    """Every launch variant of each case whose code book is in ``luts``, against numpy."""
    rng = np.random.default_rng(11)
    cases = [  # k, n, group, zeros (or a code book: e2m1, nf4, fp4_bnb), scale, m, x dtype, act
        (1024, 320, 128, None, "bf16", 1, jnp.bfloat16, False),
        (1024, 320, 128, "int", "f16", 7, jnp.float16, False),
        (2048, 512, 64, None, "f32", 16, jnp.bfloat16, False),
        (1000, 300, -1, None, "bf16", 33, jnp.bfloat16, False),
        (576, 1536, 128, "int", "bf16", 1, jnp.bfloat16, False),      # x unpadded, K_pad 640
        (2048, 384, 128, None, "f16", 100, jnp.bfloat16, True),
        (4096, 4096, 128, None, "bf16", 128, jnp.bfloat16, False),
        (4096, 4096, 128, "int", "f16", 200, jnp.float16, False),
        (2048, 512, 32, "e2m1", "e8m0", 1, jnp.bfloat16, False),       # MXFP4
        (2048, 512, 16, "e2m1", "e4m3", 16, jnp.bfloat16, False),      # NVFP4 (+ global scale)
        (1024, 320, 32, "e2m1", "e8m0", 5, jnp.float16, False),        # MXFP4, fp16 decode
        (2048, 1024, 16, "e2m1", "e4m3", 64, jnp.float16, False),      # NVFP4, fp16, WS launches
        (2048, 512, 64, "nf4", "f32", 1, jnp.bfloat16, False),         # NF4
        (1024, 320, 64, "nf4", "f32", 24, jnp.float16, True),          # NF4, fp16, act-order
        (2048, 1024, 64, "nf4", "f32", 64, jnp.bfloat16, False),       # NF4, WS launches
        (1024, 320, 64, "fp4_bnb", "f32", 3, jnp.bfloat16, False),     # bnb FP4 (a table too)
    ]
    out = []
    for k, n, g, zeros, sdt, m, xdt, act in cases:
        lut = zeros if zeros in ("e2m1", "nf4", "fp4_bnb") else "int4"
        if lut not in luts:
            continue
        q, s, z = bench.random_w4_weight(rng, k, n, g, zeros=zeros if lut == "int4" else None,
                                         scale_dtype=sdt)
        g_idx = rng.permutation(np.arange(k) // g).astype(np.int32) if act else None
        gs = 0.05 if sdt == "e4m3" else None
        packed = prepack_nk(q, s, z, group_size=g, g_idx=g_idx, lut=lut, global_scale=gs)
        gg = k if g == -1 else g
        groups = (np.arange(k) // gg) if g_idx is None else g_idx
        zf = 8.0 if z is None else np.asarray(z, np.float32)[groups]
        # The code books as their format modules define them (ml_dtypes' E2M1, bnb's tables).
        values = (q.view(ml_dtypes.float4_e2m1fn).astype(np.float32) if lut == "e2m1"
                  else q.astype(np.float32) - zf if lut == "int4" else bnb.code_table(lut)[q])
        w = values * np.asarray(s, np.float32)[groups] * (gs or 1.0)
        x = rng.standard_normal((m, k)).astype(np.float32)
        bias = jnp.asarray(rng.standard_normal(n), xdt)
        ref = (x.astype(np.asarray(jnp.zeros((), xdt)).dtype).astype(np.float32) @ w
               + np.asarray(bias, np.float32))
        case = dict(k=k, n=n, group=g, zeros=zeros, scale=sdt, m=m, x=jnp.dtype(xdt).name, act=act)
        base = default_mgpu_config(min(m, 128), packed)
        ws = [c for c in ws_launches(m, packed) if c.block_m == base.block_m]
        # The default (128-byte rows unless warp-specialized), 32-byte rows, the WS launches
        # with both row widths, group_acc flipped.
        narrow = dataclasses.replace(base, wide_rows=False)
        alts = [base, narrow] + ws[:2]
        alts += [dataclasses.replace(c, wide_rows=True) for c in ws[:1]]
        if group_acc_fits(packed.group_size, base.block_k, base.compute_wgs):
            alts.append(dataclasses.replace(base, group_acc=not base.group_acc))
        # The kernel's own output and fp32 partials (both kernels; split-K summed in a cluster
        # by the one-warpgroup kernel), at the default split and 4.
        alts += [dataclasses.replace(c, final_output=not c.final_output) for c in alts
                 if c.split_k <= (8 if c.compute_wgs == 1 else 1)]
        if base.compute_wgs == 1 and not packed.k_pad % (4 * base.block_k):
            alts.append(dataclasses.replace(base, final_output=True, split_k=4))
        for cfg in dict.fromkeys(alts):
            rec = dict(case, word_order=packed.word_order, wide_rows=cfg.wide_rows,
                       compute_wgs=cfg.compute_wgs, group_acc=cfg.group_acc,
                       final_output=cfg.final_output, split_k=cfg.split_k)
            try:
                got = jax.jit(lambda x, p, b: w4a16_mgpu_matmul(x, p, b, config=cfg))(
                    jnp.asarray(x, xdt), packed, bias)
                got = np.asarray(got, np.float32)
                err = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
                rec.update(cfg=dataclasses.asdict(cfg), rel_err=err,
                           ok=bool(err <= 1e-2 and np.isfinite(got).all()))
            except Exception as e:
                traceback.print_exc()
                rec.update(ok=False, error=f"{type(e).__name__}: {e}"[:2000])
            log(f"  {'ok  ' if rec['ok'] else 'FAIL'} {rec}")
            out.append(rec)
    return out


def smem_bytes(cfg: MgpuConfig) -> int:
    per_step = cfg.block_n * cfg.block_k // 2 + cfg.block_m * cfg.block_k * 2 + 4 * cfg.block_n * 4
    return cfg.max_concurrent_steps * per_step + cfg.block_n * cfg.block_m * 4


def launches(m: int, packed, full: bool):
    """The default launch first, then a grid ordered most-promising first (cells are time-capped)."""
    base = default_mgpu_config(m, packed)
    yield base
    if m <= 16:
        space = dict(bn=(128, 64, 256), bk=(256, 512), st=(2, 3, 4), sp=(4, 8, 2, 16))
    else:
        space = dict(bn=(64, 128), bk=(128, 64, 256), st=(2, 3, 4), sp=(1, 2, 4))
    if not full:
        space["st"] = (2, 3)
    for sp, bn, bk, st in itertools.product(space["sp"], space["bn"], space["bk"], space["st"]):
        cfg = MgpuConfig(block_n=bn, block_k=bk, block_m=base.block_m, split_k=sp,
                         max_concurrent_steps=st)
        if cfg == base or smem_bytes(cfg) > 220_000 or bn * base.block_m > 128 * 128:
            continue
        if packed.k_pad % (sp * bk) or packed.n_pad % bn or (packed.k_pad // (sp * bk)) < 2:
            continue
        yield cfg


def _time_launch(cfg: MgpuConfig, xs, packs, cell: str) -> float | None:
    """Median µs of the kernel under ``cfg`` over rotated weight copies; None (logged) if it fails."""
    try:
        fn = jax.jit(lambda x, p: w4a16_mgpu_matmul(x, p, config=cfg))
        return time_fn(fn, [(xs[c % 4], p) for c, p in enumerate(packs)]).median_us
    except Exception as e:
        log(f"  FAILED {cell} {cfg}: {type(e).__name__}: {str(e)[:300]}")
        return None


def sweep(quick: bool) -> list[dict]:
    rows = []
    key = jax.random.PRNGKey(0)
    plan = [((28672, 8192), (1, 16, 64, 128, 256, 1024)), ((8192, 8192), (1, 16, 64, 128)),
            ((8192, 28672), (1, 128)), ((4096, 4096), (1, 128))]
    for (n, k), ms in plan:
        weight, packs, w_bf16 = weight_operands(n, k, key)
        codes = weight["q"]
        rows_packed = (codes[0::2] | (codes[1::2] << 4)).astype(jnp.uint8)
        dequant = bench._xla_dequant_dot_fn(k, 128)
        for m in ms:
            xs = [jax.random.normal(jax.random.fold_in(key, c), (m, k), jnp.bfloat16) for c in range(4)]
            bf16 = time_fn(jnp.dot, [(xs[c % 4], w) for c, w in enumerate(w_bf16)]).median_us
            rows.append(dict(N=n, K=k, M=m, kernel="xla_bf16", time_us=bf16))
            dq = time_fn(dequant, [(x, rows_packed, weight["scale"]) for x in xs]).median_us
            rows.append(dict(N=n, K=k, M=m, kernel="xla_dequant_dot", time_us=dq))
            best = None
            cell_start = time.time()
            full = not quick and (n, k) in ((28672, 8192), (8192, 8192))
            cap = 45 if full and m == 1 else 22 if m <= 256 else 8
            for cfg in launches(m, packed, full):
                if time.time() - cell_start > cap:
                    break
                us = _time_launch(cfg, xs, packs, f"{n}x{k} M={m}")
                if us is None:
                    continue
                rows.append(dict(N=n, K=k, M=m, kernel="mgpu", time_us=us, config=dataclasses.asdict(cfg)))
                if best is None or us < best[0]:
                    best = (us, cfg)
            if best:
                log(f"{n}x{k} M={m:<4d} bf16 {bf16:7.1f} dequant+dot {dq:7.1f} us  mgpu best "
                    f"{best[0]:7.1f} us (x{bf16 / best[0]:.2f})  {best[1]}")
            del xs
        del packs, w_bf16
    return rows


def ab(out: pathlib.Path, ms=(1, 16, 32, 64, 128, 256)) -> list[dict]:
    """The default launch against warp-specialized launches and wide loads, same process
    (``out``/mgpu_ab.json rewritten after each cell)."""
    rows = []
    key = jax.random.PRNGKey(0)
    for n, k in ((28672, 8192), (8192, 8192)):
        weight, packs, w_bf16 = weight_operands(n, k, key)
        packed = packs[0]
        for m in ms:
            xs = [jax.random.normal(jax.random.fold_in(key, c), (m, k), jnp.bfloat16) for c in range(4)]
            base = default_mgpu_config(m, packed)
            alts = [base] + ws_launches(m, packed)
            cands = {"xla_bf16": (jnp.dot, [(xs[c % 4], w) for c, w in enumerate(w_bf16)])}
            for cfg in alts:
                label = (f"{'ws ' if cfg.compute_wgs > 1 else ''}bn{cfg.block_n} bk{cfg.block_k} "
                         f"st{cfg.max_concurrent_steps} sp{cfg.split_k}")
                fn = jax.jit(lambda x, p, cfg=cfg: w4a16_mgpu_matmul(x, p, config=cfg))
                try:   # compiled alone first, so one launch that fails does not sink the cell
                    jax.block_until_ready(fn(xs[0], packs[0]))
                except Exception as e:
                    log(f"  FAILED {n}x{k} M={m} {cfg}: {type(e).__name__}: {str(e)[:300]}")
                    continue
                cands[label] = (fn, [(xs[c % 4], p) for c, p in enumerate(packs)], cfg)
            # Round-robin: back-to-back timings of one launch differed by up to 25 % on the H200.
            times = time_interleaved({name: c[:2] for name, c in cands.items()})
            bf16 = times.pop("xla_bf16").median_us
            line = f"{n}x{k} M={m:<4d} bf16 {bf16:7.1f} |"
            for label, t in times.items():
                rows.append(dict(N=n, K=k, M=m, time_us=t.median_us, xla_bf16_us=bf16,
                                 config=dataclasses.asdict(cands[label][2])))
                line += f" {label}: {t.median_us:6.1f} |"
            log(line)
            (out / "mgpu_ab.json").write_text(json.dumps(rows, indent=1))
        del packs, w_bf16
    return rows


def group_acc_ab(out: pathlib.Path) -> list[dict]:
    """Scales applied per group to an fp32 accumulator (``group_acc``) against scaling every
    decoded weight in bf16, same launch, timed round-robin with XLA bf16; at M = 1 also 128-row
    tiles, 4 stages, and the kernel alone with x unpadded (TMA zero-fills rows 1-7) or padded
    to 8 rows as before (``out``/group_acc_ab.json, rewritten per cell)."""
    rows = []
    key = jax.random.PRNGKey(0)
    plan = [((28672, 8192), (1, 4, 16, 32)), ((8192, 8192), (1, 16, 32)), ((8192, 28672), (1, 16))]
    for (n, k), ms in plan:
        _, packs, w_bf16 = weight_operands(n, k, key)
        for m in ms:
            xs = [jax.random.normal(jax.random.fold_in(key, c), (m, k), jnp.bfloat16) for c in range(4)]
            base = default_mgpu_config(m, packs[0])
            alts = {"default": base, "flip_group_acc": dataclasses.replace(base, group_acc=not base.group_acc)}
            if m == 1:
                on = dataclasses.replace(base, group_acc=True)
                alts["group_acc_st4"] = dataclasses.replace(on, max_concurrent_steps=4)
                alts["group_acc_bn128"] = dataclasses.replace(on, block_n=128)
                alts["group_acc_bn128_sp4"] = dataclasses.replace(on, block_n=128, split_k=4)
                alts["group_acc_bk512_sp4"] = dataclasses.replace(on, block_k=512, split_k=4)
            cands = {"xla_bf16": (jnp.dot, [(xs[c % 4], w) for c, w in enumerate(w_bf16)])}
            for name, cfg in alts.items():
                fn = jax.jit(lambda x, p, cfg=cfg: w4a16_mgpu_matmul(x, p, config=cfg))
                add_candidate(cands, name, fn, [(xs[c % 4], p) for c, p in enumerate(packs)],
                              f"{n}x{k} M={m} {name} {cfg}")
            if m == 1:   # the kernel alone, x as is (rows 1-7 zero-filled by TMA) or padded
                xp = [jnp.pad(x, ((0, base.block_m - 1), (0, 0))) for x in xs]
                for name, xk in (("default", xs), ("default_padded_x", xp),
                                 ("flip_group_acc_padded_x", xp)):
                    cfg = alts[name.replace("_padded_x", "")]
                    kern = jax.jit(lambda x, p, cfg=cfg: w4a16_mgpu(x, p, config=cfg))
                    cands[name + "_kernel_only"] = (kern, [(xk[c % 4], p) for c, p in enumerate(packs)])
            times = time_interleaved(cands)
            configs = {name: alts.get(name.replace("_kernel_only", "").replace("_padded_x", ""))
                       for name in times}
            record_cell(rows, times, configs, dict(N=n, K=k, M=m), f"{n}x{k} M={m:<4d} {base}:",
                        out / "group_acc_ab.json")
        del packs, w_bf16
    return rows


def compile_for_sass() -> None:
    """Runs one launch per kernel of interest once, for a process started with
    MOSAIC_GPU_DUMP_PTX=1 MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_TO=<dir> (one dump per compiled
    kernel; the SASS dump needs nvdisasm, which the H200 machine lacks)."""
    key = jax.random.PRNGKey(0)
    n, k = 4096, 4096
    for scheme, word_order in itertools.product(("int4_g128", "mxfp4", "nf4"), (True, False)):
        weight = bench.make_weight(scheme, n, k, key)
        packed = prepack_nk(weight["q"], weight["scale"], group_size=weight["group_size"],
                            lut=weight["lut"], word_order=word_order)
        for m in ((1, 128) if scheme == "int4_g128" else (1,)):
            x = jax.random.normal(key, (m, k), jnp.bfloat16)
            for cfg in [default_mgpu_config(m, packed)] + ws_launches(m, packed)[:1]:
                fn = jax.jit(lambda x, p: w4a16_mgpu_matmul(x, p, config=cfg))
                jax.block_until_ready(fn(x, packed))
                log(f"compiled {scheme} word_order={word_order} M={m} {cfg}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--skip-sweep", action="store_true")
    parser.add_argument("--ab", action="store_true", help="default launch vs WS launches")
    parser.add_argument("--group-acc-ab", action="store_true", help="per-group fp32 scaling A/B")
    parser.add_argument("--latency-probe", action="store_true", help="where an M = 1 CTA's time goes")
    parser.add_argument("--wide-rows", action="store_true", help="128-byte weight rows A/B")
    parser.add_argument("--ws-wide", action="store_true", help="wide rows in the WS kernel A/B")
    parser.add_argument("--ws-small-m", action="store_true", help="WS launches at M ≤ 16, both row widths")
    parser.add_argument("--pipeline-probe", action="store_true",
                        help="the M = 1 pipeline's copies piece by piece, no consumer")
    parser.add_argument("--copy-probe", action="store_true", help="TMA copy rate by tile shape")
    parser.add_argument("--stream-probe", action="store_true",
                        help="the M = 1 weight stream by split-K and stages, copies only")
    parser.add_argument("--codebook-ab", action="store_true",
                        help="int4 / MXFP4 / NVFP4 / NF4 round-robin")
    parser.add_argument("--word-order-ab", action="store_true",
                        help="each code book in word order vs K order, kernel alone")
    parser.add_argument("--skip-correctness", action="store_true")
    parser.add_argument("--luts", default="int4,e2m1,nf4,fp4_bnb",
                        help="code books the correctness stage runs")
    parser.add_argument("--ab-cells", default=None,
                        help="NxKxM list for --codebook-ab / --word-order-ab / --final-output-ab / "
                             "--small-m-launch-ab (int4 there) / --stream-probe (all tile "
                             "shapes, M ignored), e.g. 8192x8192x1")
    parser.add_argument("--schemes", default="int4_g128,mxfp4,nvfp4,nf4",
                        help="code books --codebook-ab / --word-order-ab time")
    parser.add_argument("--small-m-launch-ab", action="store_true",
                        help="the M ≤ 16 default launch against its neighbours")
    parser.add_argument("--decode-ab", action="store_true",
                        help="the M ≤ 16 default against the one before it (--ab-cells)")
    parser.add_argument("--final-output-ab", action="store_true",
                        help="XLA-summed partials vs the kernel's own final output")
    parser.add_argument("--launch-overhead-probe", action="store_true",
                        help="an empty XLA op and empty Mosaic GPU kernels, back to back")
    parser.add_argument("--sass-only", action="store_true", help="compile a few launches, nothing else")
    args = parser.parse_args(argv)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log(f"devices {jax.devices()} jax {jax.__version__}")
    if args.sass_only:
        compile_for_sass()
        return 0
    gpu_state(out, "start")
    cells = (tuple(tuple(int(v) for v in c.split("x")) for c in args.ab_cells.split(","))
             if args.ab_cells else None)
    if args.launch_overhead_probe:
        launch_overhead_probe(out)
    if args.stream_probe:
        if cells:   # every tile shape and split the cells' weights take (their M is ignored)
            stream_probe(out, cells=tuple(c[:2] for c in cells), splits=(2, 4, 8, 16),
                         layouts=("int4_bk256_swz128", "int4_bn128_bk256_swz128",
                                  "int4_bk512_swz128"))
        else:
            stream_probe(out)
        gpu_state(out, "after stream probe")
    if args.copy_probe:
        copy_probe(out)
        gpu_state(out, "after copy probe")
    if not args.skip_correctness:
        res = correctness(tuple(args.luts.split(",")))
        (out / "mgpu_correctness.json").write_text(json.dumps(res, indent=1))
        log(f"correctness {sum(r['ok'] for r in res)}/{len(res)}")
    if args.codebook_ab:
        codebook_ab(out, cells or CODEBOOK_AB_PLAN, schemes=tuple(args.schemes.split(",")))
        gpu_state(out, "after code book ab")
    if args.word_order_ab:
        codebook_ab(out, cells or WORD_ORDER_AB_PLAN, schemes=tuple(args.schemes.split(",")),
                    orders=(True, False), file_name="word_order_ab.json")
        gpu_state(out, "after word order ab")
    if args.group_acc_ab:
        group_acc_ab(out)
    if args.pipeline_probe:
        pipeline_probe(out)
        gpu_state(out, "after pipeline probe")
    if args.latency_probe:
        latency_probe(out)
    if args.wide_rows:
        launch_ab(out, WIDE_ROWS_PLAN, wide_rows_variants, "wide_rows_ab.json",
                  kernel_only=("default", "narrow_rows"))
        gpu_state(out, "after wide rows")
    if args.ws_wide:
        launch_ab(out, WS_WIDE_PLAN, ws_wide_variants, "ws_wide_ab.json")
    if args.small_m_launch_ab:
        plan = (tuple(("int4_g128", *c) for c in cells) if cells else SMALL_M_LAUNCH_PLAN)
        launch_ab(out, plan, small_m_launch_variants, "small_m_launch_ab.json",
                  every_kernel_alone=True)
        gpu_state(out, "after small-M launches")
    if args.decode_ab:
        plan = (tuple(("int4_g128", *c) for c in cells) if cells else SMALL_M_LAUNCH_PLAN)
        launch_ab(out, plan, decode_default_variants, "decode_ab.json")
        gpu_state(out, "after decode ab")
    if args.final_output_ab:
        plan = (tuple(("int4_g128", *c) for c in cells) if cells else FINAL_OUTPUT_PLAN)
        launch_ab(out, plan, final_output_variants, "final_output_ab.json")
        gpu_state(out, "after final output ab")
    if args.ws_small_m:
        launch_ab(out, WS_SMALL_M_PLAN, ws_small_m_variants, "ws_small_m_ab.json")
        gpu_state(out, "after ws small m")
    if args.ab:
        ab(out)
    if not args.skip_sweep:
        rows = sweep(args.quick)
        (out / "mgpu_sweep.json").write_text(json.dumps(rows, indent=1))
    log("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
