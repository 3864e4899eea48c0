"""``jquant bench gemm8``: 8-bit weight schemes as a model runs them, against XLA bf16 ``x @ W``, in one
run. Per shape and M, every scheme's weight comes from the public API (``quantize_weight`` then
``process_weights_after_loading``) and ``scheme.apply`` is timed, what a model runs: the weight-only
schemes (``int8_ch``, FP8 e4m3 per channel with bf16 activations) through their dispatch, plus the W8A16
kernel forced (``mgpu``) and XLA's dequantize + dot for the same math (``xla``); the W8A8 FP8 schemes
(per tensor, per token × channel, 128×128 blocks) and INT8 W8A8 through theirs (XLA's FP8 dot, or
dequantize + dot for blocks; XLA's int8 × int8 → int32 dot), plus for the W8A8 FP8 schemes the FP8 GEMM
kernel forced (``mgpu``: activations quantized as the scheme says; the dispatch runs it by M,
``dispatch.fp8_gemm_impl``), and at M ≤ 4 the 8-bit GEMV forced (``triton``, both kinds). Records: op,
scheme, impl, M, N, K, µs, the XLA bf16 baseline of the same run, TB/s, TFLOP/s, % of the byte floor at
the HBM rate measured on the device (``hbm_tb_per_s``), the speedup over bf16, the kernel's launch
(``config``, for ``mgpu`` and ``triton``), device, JAX version, commit.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable

import jax
import jax.numpy as jnp

import jquant
from jquant.bench.records import markdown_title
from jquant.bench.timing import (array_bytes, copies_for, device_hbm_bytes_per_s, roofline, spread_pct,
                                 time_interleaved)
from jquant.kernels.fp8_gemm.config import Fp8GemmConfig, default_fp8_config
from jquant.kernels.fp8_gemm.from_qtensor import fp8_scheme_gemm, pack_fp8_qtensor
from jquant.kernels.fp8_gemm.layout import PackedFp8
from jquant.kernels.gemv8.config import MAX_ROWS, GemvConfig, default_gemv_config
from jquant.kernels.w4a16.config import MgpuConfig
from jquant.kernels.w8a16.api import default_w8_config, w8a16_matmul
from jquant.kernels.w8a16.from_qtensor import unified_w8
from jquant.kernels.w8a16.layout import prepack_w8
from jquant.schemes import builtin
from jquant.schemes import dispatch as device_lib
from jquant.schemes.xla import xla_apply

SHAPES = ((28672, 8192), (8192, 28672), (8192, 8192), (4096, 4096))
# DeepSeek-V3's block-FP8 projections (N × K), for the block scheme.
DEEPSEEK_SHAPES = ((7168, 2048), (2112, 7168), (24576, 1536), (7168, 16384))
MS = (1, 16, 64, 128, 256, 1024, 4096, 8192)
# ``jquant bench gemm8 --sweep``: FP8 GEMM launches (x as A, so M ≥ 128) timed beside the default in each
# cell. On the H100 (bench/results/h100/gemm8_fp8_sweep*.md) block FP8 went from 368-377 TFLOP/s with one
# warpgroup of 64 × 128 (it waits for every K step's wgmmas before promoting them) to 537 with two sharing
# the weight tile, 543-571 walking the grid in snake strips of 8 x tiles and 582 on 132 persistent CTAs
# (the default now: one CTA an SM, the next tile's loads under this one's epilogue); one K block from
# 807-810 (128 × 128 a warpgroup) to 854-861 with 64 × 256, and at 1024 × 28672 × 8192 from 664 to 1154
# on the snake grid (the default now). The sweep keeps the earlier defaults beside the new ones. A block
# launch keeps 64 × 128 a warpgroup: its promoted sum doubles the accumulator.
FP8_SWEEP = (Fp8GemmConfig(swap_ab=False, block_a=64, block_b=128),
             Fp8GemmConfig(swap_ab=False, block_a=64, block_b=128, compute_wgs=2, grid_tile_width=8),
             Fp8GemmConfig(swap_ab=False, block_a=128, block_b=128, compute_wgs=2, max_concurrent_steps=3),
             Fp8GemmConfig(swap_ab=False, block_a=64, block_b=256, compute_wgs=2, max_concurrent_steps=3),
             Fp8GemmConfig(swap_ab=False, block_a=64, block_b=128, compute_wgs=2, grid_tile_width=8,
                           persistent_ctas=132),
             Fp8GemmConfig(swap_ab=False, block_a=64, block_b=256, compute_wgs=2, max_concurrent_steps=3,
                           grid_tile_width=8, persistent_ctas=132))
# W8A16 from M = 256 on wide weights: the earlier default took 128 x rows a CTA, so each weight tile was
# read and decoded once per 128 rows (0.76-0.93× XLA bf16 at M = 256 on the H200, bench/results/h200/
# gemm8.md). The default now takes 256 x rows (wgmma's widest N) on two warpgroups of 64 weight rows,
# 4 deep; the sweep times it 3 deep and the earlier launch.
W8_SWEEP = (MgpuConfig(block_n=128, block_k=64, block_m=256, max_concurrent_steps=3, compute_wgs=2,
                       final_output=True),
            MgpuConfig(block_n=128, block_k=64, block_m=256, max_concurrent_steps=4, compute_wgs=2,
                       final_output=True),
            MgpuConfig(block_n=256, block_k=64, block_m=128, max_concurrent_steps=4, compute_wgs=2,
                       final_output=True))

# The 8-bit GEMV (``impl="triton"``, both ops) at M ≤ MAX_ROWS: weight rows a program, codes a step, warps.
# On the H100 (bench/results/h100/gemm8_gemv_sweep.md, gemm8_gemv_prefetch.md) 16 or 32 rows a program,
# 8 warps and 3 Triton stages never won by more than the timing spread; loading each step's tiles one step
# ahead lost (28672×8192 int8 97.8 against 94.7 µs, FP8 W8A8 100.4 against 89.8).
GEMV_SWEEP = tuple(GemvConfig(block_n=bn, block_k=bk, num_warps=w)
                   for bn, bk, w in ((4, 1024, 4), (8, 512, 4), (4, 2048, 4), (4, 512, 4), (16, 512, 8)))


def schemes() -> dict[str, jquant.Scheme]:
    """The 8-bit schemes timed, by name: three weight-only (MXFP8 among them), five W8A8 (INT8 and
    bitsandbytes' LLM.int8(), FP8 three ways)."""
    weight_only = [jquant.get_scheme("int8_ch"), builtin.fp8_channel(weight_only=True), jquant.get_scheme("mxfp8_ct")]
    w8a8 = [jquant.get_scheme(n) for n in ("int8_w8a8", "llm_int8", "fp8_e4m3_tensor", "fp8_e4m3_channel",
                                            "fp8_e4m3_block128x128")]
    return {s.name: s for s in weight_only + w8a8}


def _copies(tree, max_copies: int) -> list:
    n = copies_for(array_bytes(tree), max_copies=max_copies)
    return [tree] + [jax.tree_util.tree_map(lambda a: a.copy(), tree) for _ in range(n - 1)]


@dataclasses.dataclass(frozen=True)
class _Weight:
    scheme: jquant.Scheme
    prepared: list           # process_weights_after_loading and copies
    qweight: list            # the QTensor and copies (XLA's path for the same math)
    packed: list | None      # the layout of the kernel forced (``mgpu``), None without one


def _kernel_layout(scheme: jquant.Scheme, qw):
    """``qw`` laid out for the kernel of the scheme's math: the W8A16 kernel's (weight-only), the FP8
    GEMM's (W8A8 FP8); None for others or a layout the kernel does not take."""
    if scheme.weight_only:
        args = unified_w8(qw)
        return None if args is None else prepack_w8(**args)
    if scheme.weight.format == "fp8_e4m3" and scheme.activation.format == "fp8_e4m3":
        return pack_fp8_qtensor(qw)
    return None


def _weight(scheme: jquant.Scheme, w: jax.Array, max_copies: int, log: Callable[[str], None]) -> _Weight:
    qw = jax.jit(scheme.quantize_weight)(w)
    try:
        packed = _kernel_layout(scheme, qw)
    except Exception as e:   # the scheme's other candidates are still timed
        log(f"  mgpu skipped for {scheme.name} {w.shape[0]}x{w.shape[1]}: layout: {type(e).__name__}: {e}")
        packed = None
    return _Weight(scheme, _copies(scheme.process_weights_after_loading(qw), max_copies),
                   _copies(qw, max_copies), None if packed is None else _copies(packed, max_copies))


def _launch(m: int, packed):
    """The launch the kernel forced runs at ``m`` rows: its default for ``packed`` and a bf16 output."""
    if isinstance(packed, PackedFp8):
        return default_fp8_config(m, packed.n_pad, packed.blocked, num_sms=device_lib.sm_count())
    return default_w8_config(m, packed)


def _sweep(m: int, packed) -> list:
    """The ``FP8_SWEEP`` (``W8_SWEEP``) launches other than the default that run ``packed`` at ``m`` rows."""
    if isinstance(packed, PackedFp8):
        if m < 128:
            return []
        cands = [c for c in FP8_SWEEP if not (packed.blocked and c.block_a * c.block_b > 64 * 128)]
    else:
        cands = [c for c in W8_SWEEP if m >= max(256, c.block_m) and packed.n_pad % c.block_n == 0]
    default = _launch(m, packed)
    return [c for c in cands if c != default]


def _label(cfg) -> str:
    """``mgpu`` and the fields of a swept launch: ``mgpu 64x256 wg2 st3``, ``… snake8 p132`` (FP8 GEMM: x rows
    × weight rows a warpgroup), ``mgpu n128 k64 m256 wg2 st3`` (W8A16: a CTA's weight rows, K a step, x rows),
    ``triton n8 k512 w4 st1`` (the GEMV)."""
    if isinstance(cfg, GemvConfig):
        return f"triton n{cfg.block_n} k{cfg.block_k} w{cfg.num_warps} st{cfg.num_stages}"
    if isinstance(cfg, MgpuConfig):
        return (f"mgpu n{cfg.block_n} k{cfg.block_k} m{cfg.block_m} wg{cfg.compute_wgs} "
                f"st{cfg.max_concurrent_steps}")
    snake = f" snake{cfg.grid_tile_width}" if cfg.grid_tile_width else ""
    ctas = f" p{cfg.persistent_ctas}" if cfg.persistent_ctas else ""
    return f"mgpu {cfg.block_a}x{cfg.block_b} wg{cfg.compute_wgs} st{cfg.max_concurrent_steps}{snake}{ctas}"


def run(shapes: Iterable[tuple[int, int]] = SHAPES, ms: Iterable[int] = MS,
        names: Iterable[str] | None = None, reps: int = 9, interpret: bool = False, sweep: bool = False,
        hbm_bytes_per_s: float | None = None, meta: dict | None = None,
        log: Callable[[str], None] = print, max_copies: int = 64,
        on_records: Callable[[list[dict]], None] | None = None) -> list[dict]:
    """Times every (shape, M, scheme) cell with its XLA bf16 baseline, interleaved. ``interpret``
    runs the kernel in interpret mode (CPU plumbing check; its timings mean nothing).
    ``on_records`` gets the records so far after every M (a run cut short keeps its rows). ``sweep``
    also times the ``FP8_SWEEP`` (FP8 GEMM) and ``W8_SWEEP`` (W8A16) launches in each cell.
    ``hbm_bytes_per_s``: the rate of the byte floor (None: this device's, ``device_hbm_bytes_per_s``)."""
    table = schemes()
    names = tuple(names or table)
    unknown = [n for n in names if n not in table]
    if unknown:
        raise ValueError(f"unknown 8-bit schemes {unknown}; known: {', '.join(table)}")
    if interpret:
        max_copies = 1
    meta = meta or {}
    hbm_bytes_per_s = hbm_bytes_per_s or device_hbm_bytes_per_s()
    key = jax.random.PRNGKey(0)
    records = []
    for n, k in shapes:
        w = jax.random.normal(jax.random.fold_in(key, 7), (n, k), jnp.bfloat16)
        w_bf16 = _copies(w.T, max_copies)
        weights = {}
        for name in names:
            try:
                weights[name] = _weight(table[name], w, max_copies, log)
            except Exception as e:   # one failing scheme must not end the run
                log(f"  FAILED {name} {n}x{k}: quantize/prepare: {type(e).__name__}: {e}")
        for m in ms:
            n_x = copies_for(n * k + m * k * 2, max_copies=max_copies)
            xs = [jax.random.normal(jax.random.fold_in(key, 100 + c), (m, k), jnp.bfloat16) for c in range(n_x)]
            cands = {"xla_bf16": (jnp.dot, [(xs[c % n_x], wc) for c, wc in enumerate(w_bf16)])}
            timed = {}
            for name, wt in weights.items():
                for impl, fn, copies, cfg in _candidates(wt, m, interpret, sweep):
                    args = [(xs[c % n_x], p) for c, p in enumerate(copies)]
                    try:
                        jax.block_until_ready(fn(*args[0]))
                    except Exception as e:
                        log(f"  FAILED {name} {n}x{k} M={m} {impl}: {type(e).__name__}: {e}")
                        continue
                    cands[f"{name}:{impl}"] = (fn, args)
                    timed[f"{name}:{impl}"] = (name, impl, copies[0], cfg)
            times = time_interleaved(cands, warmup=1 if interpret else 3, reps=reps,
                                     min_batch_s=1e-3 if interpret else 10e-3)
            bf16 = times["xla_bf16"].median_us
            for label, (name, impl, one, cfg) in timed.items():
                t = times[label]
                nbytes = array_bytes(one, xs[0]) + m * n * 2
                roof = roofline(t.median_us, nbytes, 2 * m * n * k, hbm_bytes_per_s)
                rec = dict(op="gemm8", scheme=name, impl=impl, M=m, N=n, K=k,
                           w8a8=not table[name].weight_only, time_us=round(t.median_us, 2),
                           baselines={"xla_bf16": round(bf16, 2)},
                           speedup_vs_bf16=round(bf16 / t.median_us, 3),
                           spread_pct=spread_pct(t), baseline_spread_pct=spread_pct(times["xla_bf16"]),
                           config=dataclasses.asdict(cfg) if cfg else None,
                           tb_per_s=round(roof.tb_per_s, 3), tflop_per_s=round(roof.tflop_per_s, 2),
                           pct_of_byte_floor=round(roof.pct_of_byte_floor, 1),
                           hbm_tb_per_s=round(hbm_bytes_per_s / 1e12, 3), **meta)
                records.append(rec)
                log(f"  {name:24s} {n}x{k} M={m:<5d} {impl:6s} {rec['time_us']:9.1f} us  bf16 {bf16:9.1f}"
                    f"  x{rec['speedup_vs_bf16']:.2f}  {rec['tflop_per_s']:.0f} TFLOP/s")
            if on_records is not None:
                on_records(records)
    return records


def _candidates(wt: _Weight, m: int, interpret: bool, sweep: bool):
    """(impl, fn, weight copies, launch or None): the scheme as a model runs it; the kernel of its math
    forced (the W8A16 kernel, or the FP8 GEMM on the activations quantized as the scheme says), with
    ``sweep`` also at each swept launch; XLA's path for the same QTensor."""
    scheme = wt.scheme
    out = [("scheme", jax.jit(lambda x, p, s=scheme: s.apply(x, p)), wt.prepared, None)]
    if wt.packed is not None:
        packed = wt.packed[0]
        if isinstance(packed, PackedFp8):
            def forced(cfg, impl="mgpu"):
                return jax.jit(lambda x, p: fp8_scheme_gemm(scheme, x, p, impl=impl, config=cfg, interpret=interpret))
        else:
            def forced(cfg, impl="mgpu"):
                return jax.jit(lambda x, p: w8a16_matmul(x, p, impl=impl, config=cfg, interpret=interpret))
        out.append(("mgpu", forced(None), wt.packed, _launch(m, packed)))
        for cfg in _sweep(m, packed) if sweep else []:
            out.append((_label(cfg), forced(cfg), wt.packed, cfg))
        if m <= MAX_ROWS:   # the GEMV
            default = default_gemv_config()
            out.append(("triton", forced(None, "triton"), wt.packed, default))
            for cfg in GEMV_SWEEP if sweep else []:
                if cfg != default:
                    out.append((_label(cfg), forced(cfg, "triton"), wt.packed, cfg))
    out.append(("xla", jax.jit(lambda x, q, s=scheme: xla_apply(s, x, q, None)), wt.qweight, None))
    return out


def to_markdown(records: list[dict]) -> str:
    head = ("| scheme | W8A8 | N×K | M | impl | µs | XLA bf16 µs | vs bf16 | TB/s | TFLOP/s | % byte floor |"
            " spread % |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    rows = [f"| {r['scheme']} | {'yes' if r['w8a8'] else 'no'} | {r['N']}×{r['K']} | {r['M']} | {r['impl']} | "
            f"{r['time_us']} | {r['baselines']['xla_bf16']} | {r['speedup_vs_bf16']} | {r['tb_per_s']} | "
            f"{r['tflop_per_s']} | {r['pct_of_byte_floor']} | {max(r['spread_pct'], r['baseline_spread_pct'])} |"
            for r in records]
    return (markdown_title("8-bit GEMM benchmark", records,
                           "impl: scheme = Scheme.apply (the dispatch), mgpu = the W8A16 kernel (weight-only) or "
                           "the FP8 GEMM kernel (W8A8 FP8) forced, triton = the 8-bit GEMV forced, "
                           "xla = XLA's path for the same math")
            + head + "\n".join(rows) + "\n")

