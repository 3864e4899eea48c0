"""The A/B stages of tools/device_w4a16_mgpu.py: each cell's default launch against variants,
timed round-robin with XLA bf16, and the helpers the device script's stages share."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import time

import jax
import jax.numpy as jnp

from jquant.bench import w4a16 as bench
from jquant.bench.timing import copies_for, time_interleaved
from jquant.pallas_kernels.w4a16_layout import _round_up
from jquant.pallas_kernels.w4a16_mgpu import (MgpuConfig, default_mgpu_config, kernel_x,
                                              prepack_nk, w4a16_mgpu, w4a16_mgpu_matmul)

START = time.time()


def log(msg):
    print(f"[{time.time() - START:7.1f}s] {msg}", flush=True)


def weight_operands(n: int, k: int, key, scheme: str = "int4_g128", with_bf16: bool = True,
                    word_order: bool = True):
    """A random ``scheme`` weight (int4 g128 unless named), L2-defeating copies of its NK
    packing (in word order unless told), and (``with_bf16``; else []) bf16 weights for XLA."""
    weight = bench.make_weight(scheme, n, k, key)
    packed = prepack_nk(weight["q"], weight["scale"], group_size=weight["group_size"],
                        lut=weight["lut"], global_scale=weight["global_scale"],
                        word_order=word_order)
    packs = [packed] + [jax.tree_util.tree_map(lambda a: a.copy(), packed)
                        for _ in range(copies_for(packed.nbytes, max_copies=64) - 1)]
    # As many bf16 copies as the bench takes (≥ 1 GiB per program): with 4, XLA's calls on the
    # small shapes were timed at the host's dispatch pace (bench/NOTES.md, session 10).
    w_bf16 = [jax.random.normal(jax.random.fold_in(key, 50 + c), (k, n), jnp.bfloat16)
              for c in range(copies_for(k * n * 2, max_copies=64) if with_bf16 else 0)]
    return weight, packs, w_bf16


def add_candidate(cands: dict, name: str, fn, args_list, label: str, check=None):
    """Runs ``fn`` once on ``args_list[0]`` (compiling it; ``check(output)`` raises for a wrong
    output) and adds ``(fn, args_list)`` to ``cands`` as ``name``; a launch that fails is logged
    with ``label`` and left out, so it does not sink the cell. Returns that first output, or
    None."""
    try:
        got = jax.block_until_ready(fn(*args_list[0]))
        if check is not None:
            check(got)
    except Exception as e:
        log(f"  FAILED {label}: {type(e).__name__}: {str(e)[:300]}")
        return None
    cands[name] = (fn, args_list)
    return got


def record_cell(rows: list[dict], times: dict, configs: dict, cell: dict, header: str,
                 path: pathlib.Path) -> None:
    """Appends one record per timed candidate of a cell, logs the cell on one line and
    rewrites ``path`` (so a run cut short keeps what it measured)."""
    line = header
    for name, t in times.items():
        cfg = configs.get(name)
        rows.append(dict(cell, name=name, time_us=t.median_us, batches_us=list(t.batches_us),
                         config=dataclasses.asdict(cfg) if cfg else None))
        line += f" {name} {t.median_us:6.1f} |"
    log(line)
    path.write_text(json.dumps(rows, indent=1))


def ws_launches(m: int, packed) -> list[MgpuConfig]:
    """Warp-specialized launches (2 compute warpgroups sharing x) worth timing at ``m``."""
    bm = min(_round_up(m, 8), 128)
    out = []
    if bm <= 16:
        for bn, sp, st in ((128, 8, 3), (128, 4, 4), (256, 4, 3), (256, 8, 2), (128, 16, 2)):
            out.append(MgpuConfig(block_n=bn, block_k=256, block_m=bm, split_k=sp,
                                  max_concurrent_steps=st, compute_wgs=2))
    else:
        for bn, bk, sp, st in ((256, 128, 1, 3), (256, 64, 1, 4), (256, 128, 2, 2),
                               (128, 128, 2, 3), (256, 64, 2, 4)):
            out.append(MgpuConfig(block_n=bn, block_k=bk, block_m=bm, split_k=sp,
                                  max_concurrent_steps=st, compute_wgs=2))
    return [c for c in out if not packed.n_pad % c.block_n
            and not packed.k_pad % (c.split_k * c.block_k)]


def launch_ab(out: pathlib.Path, plan, variants, file_name: str, kernel_only=("default",),
              interpret: bool = False, every_kernel_alone: bool = False) -> list[dict]:
    """Per (scheme, N, K, M) cell of ``plan``: the default launch and ``variants(base, packed,
    m)`` (name → MgpuConfig), whole calls (and the kernel alone for the names in
    ``kernel_only``, or for every launch), timed round-robin with XLA bf16
    (``out``/``file_name``, rewritten per cell)."""
    rows = []
    key = jax.random.PRNGKey(0)
    for scheme, n, k, m in plan:
        _, packs, w_bf16 = weight_operands(n, k, key, scheme)
        packed = packs[0]
        if interpret:
            packs, w_bf16 = packs[:1], w_bf16[:1]
        base = default_mgpu_config(m, packed)
        alts = {"default": base, **variants(base, packed, m)}
        xs = [jax.random.normal(jax.random.fold_in(key, c), (m, k), jnp.bfloat16) for c in range(4)]
        cands = {"xla_bf16": (jnp.dot, [(xs[c % 4], w) for c, w in enumerate(w_bf16)])}
        args = [(xs[c % 4], p) for c, p in enumerate(packs)]
        want = None

        def same_as_default(got):   # a launch that computes something else must not win
            if want is not None:
                err = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
                if not err <= 1e-2:
                    raise ValueError(f"output differs from the default's: rel. err. {err}")

        for name, cfg in list(alts.items()):
            fn = jax.jit(lambda x, p, cfg=cfg: w4a16_mgpu_matmul(x, p, config=cfg,
                                                                 interpret=interpret))
            got = add_candidate(cands, name, fn, args, f"{scheme} {n}x{k} M={m} {name} {cfg}",
                                check=same_as_default)
            if got is None:
                del alts[name]
                continue
            if name == "default":
                want = got.astype(jnp.float32)
            if every_kernel_alone or name in kernel_only:
                kern = jax.jit(lambda x, p, cfg=cfg: w4a16_mgpu(
                    kernel_x(x, p), p, config=cfg, interpret=interpret))
                cands[name + "_kernel_only"] = (kern, args)
        times = time_interleaved(cands, **(dict(warmup=1, reps=1) if interpret else {}))
        configs = {name: alts.get(name.replace("_kernel_only", "")) for name in times}
        record_cell(rows, times, configs, dict(scheme=scheme, N=n, K=k, M=m),
                    f"{scheme} {n}x{k} M={m}:", out / file_name)
        del packs, w_bf16
    return rows


WIDE_ROWS_PLAN = tuple(("int4_g128", 28672, 8192, m) for m in (1, 16, 64, 128)) + (
    ("int4_g128", 8192, 8192, 1), ("int4_g128", 8192, 8192, 128),
    ("int4_g128", 8192, 28672, 1), ("int4_g128", 8192, 28672, 128),
    ("mxfp4", 28672, 8192, 1), ("nvfp4", 28672, 8192, 1))


WS_WIDE_PLAN = (("int4_g128", 28672, 8192, 64), ("int4_g128", 28672, 8192, 128),
                ("int4_g128", 8192, 28672, 128))


def ws_wide_variants(base, packed, m) -> dict:
    """The warp-specialized default (64-code steps, 32-byte rows) against 128- and 256-code
    steps with wide rows."""
    del packed, m
    return {"ws_bk128_wide": dataclasses.replace(base, block_k=128, wide_rows=True,
                                                 max_concurrent_steps=4),
            "ws_bk256_wide": dataclasses.replace(base, block_k=256, wide_rows=True,
                                                 max_concurrent_steps=2)}


WS_SMALL_M_PLAN = (("int4_g128", 28672, 8192, 1), ("int4_g128", 28672, 8192, 16),
                   ("int4_g128", 8192, 28672, 1), ("int4_g128", 8192, 8192, 1))


def ws_small_m_variants(base, packed, m) -> dict:
    """Warp-specialized launches at M ≤ 16 (``ws_launches``), each with 32-byte and with
    128-byte weight rows: a copy-only warpgroup keeps the TMA queue full while the compute
    warpgroups decode, which the one-warpgroup pipeline cannot (bench/NOTES.md, session 5)."""
    del base
    alts = {}
    for cfg in ws_launches(m, packed):
        name = f"ws_bn{cfg.block_n}_sp{cfg.split_k}_st{cfg.max_concurrent_steps}"
        alts[name] = cfg
        alts[name + "_wide"] = dataclasses.replace(cfg, wide_rows=True)
    return alts


def wide_rows_variants(base, packed, m) -> dict:
    """The weight tile staged with 128-byte swizzle rows (``MgpuConfig.wide_rows``) and with
    32-byte rows (one per 64-code chunk), and the wide one a stage deeper and (M ≤ 16) with
    512-code steps. Since session 5 the one-warpgroup default is the wide one."""
    wide = dataclasses.replace(base, wide_rows=True)
    alts = {"wide_rows": wide, "narrow_rows": dataclasses.replace(base, wide_rows=False),
            "wide_rows_st+1": dataclasses.replace(wide, max_concurrent_steps=base.max_concurrent_steps + 1)}
    if m <= 16 and packed.k_pad % (512 * base.split_k) == 0:
        alts["wide_rows_bk512"] = dataclasses.replace(wide, block_k=512)
    return alts


SMALL_M_LAUNCH_PLAN = (("int4_g128", 28672, 8192, 1), ("int4_g128", 8192, 28672, 1),
                       ("int4_g128", 8192, 8192, 1), ("int4_g128", 28672, 8192, 16))


def small_m_launch_variants(base, packed, m) -> dict:
    """Around the M ≤ 16 default (64 rows, 256-code steps, 3 stages, split-K 8 at M = 1): the
    split, the depth, the step and the x tile one notch either way, now that the decode takes
    fewer instructions (word order)."""
    del m
    alts = {f"sp{sp}": dataclasses.replace(base, split_k=sp) for sp in (2, 4, 8, 16)
            if sp != base.split_k}
    alts.update({f"st{st}": dataclasses.replace(base, max_concurrent_steps=st) for st in (2, 4, 6)})
    alts["bk512"] = dataclasses.replace(base, block_k=512)
    alts["bk128"] = dataclasses.replace(base, block_k=128)
    alts["bn128"] = dataclasses.replace(base, block_n=128)
    alts["bm16"] = dataclasses.replace(base, block_m=16)
    return {name: cfg for name, cfg in alts.items() if splits_k_evenly(cfg, packed)}


def splits_k_evenly(cfg, packed) -> bool:
    """Whether ``cfg``'s split-K ranges tile K_pad in whole steps, at least 2 per CTA."""
    step = cfg.split_k * cfg.block_k
    return not packed.k_pad % step and packed.k_pad // step >= 2


def final_output_variants(base, packed, m) -> dict:
    """Around the default: the kernel's own final output and fp32 partials summed by XLA, at
    split-K 1, 2 and (M ≤ 16) 4 (a cluster per output tile), at M ≤ 16 also the final output
    4 and 6 stages deep."""
    if base.compute_wgs != 1:   # split-K 1 only: the final output or fp32 partials
        flipped = dataclasses.replace(base, final_output=not base.final_output)
        return {"partials" if base.final_output else "final": flipped}
    alts = {}
    for sp in (1, 2, 4) if m <= 16 else (1, 2):
        if not splits_k_evenly(dataclasses.replace(base, split_k=sp), packed):
            continue
        for final in (True, False):
            cfg = dataclasses.replace(base, split_k=sp, final_output=final)
            if cfg != base:
                alts[f"{'final' if final else 'partials'}_sp{sp}"] = cfg
        if m <= 16:   # fewer, longer CTAs per tile may want a deeper pipeline (stream probe)
            for st in (4, 6):
                cfg = dataclasses.replace(base, split_k=sp, final_output=True,
                                          max_concurrent_steps=st)
                if cfg != base:
                    alts[f"final_sp{sp}_st{st}"] = cfg
    return alts


def decode_default_variants(base, packed, m) -> dict:
    """The M ≤ 16 default (session 11: the final output at split-K 2, 4 stages) against the one
    before it (fp32 partials at split-K 4, 3 stages, summed by XLA) and its nearest rivals in
    session 11's first A/B."""
    del m
    alts = {"partials_sp4_st3": dataclasses.replace(base, split_k=4, max_concurrent_steps=3,
                                                    final_output=False),
            "final_sp2_st3": dataclasses.replace(base, split_k=2, max_concurrent_steps=3,
                                                 final_output=True),
            "final_sp1_st6": dataclasses.replace(base, split_k=1, max_concurrent_steps=6)}
    return {name: cfg for name, cfg in alts.items()
            if cfg != base and splits_k_evenly(cfg, packed)}


# Session 9: where the split is 1 or 2 (M ≥ 32, and the small shapes) the final output saves
# the partials' fp32 round trip and the second kernel without a large cluster (session 8's
# M = 1 cells: --ab-cells).
FINAL_OUTPUT_PLAN = tuple(("int4_g128", n, k, m) for n, k, m in (
    (1536, 576, 1), (1536, 576, 16), (1536, 576, 64), (1536, 576, 128), (4096, 4096, 1),
    (4096, 4096, 32), (4096, 4096, 128), (8192, 8192, 32), (8192, 8192, 128), (8192, 8192, 256),
    (8192, 28672, 64), (8192, 28672, 128), (28672, 8192, 32)))


CODEBOOK_AB_PLAN = ((28672, 8192, 1), (28672, 8192, 16), (8192, 28672, 1), (8192, 8192, 1))


def codebook_ab(out: pathlib.Path, plan=CODEBOOK_AB_PLAN, schemes=("int4_g128", "mxfp4",
                "nvfp4", "nf4"), orders=(True,), file_name: str = "codebook_ab.json",
                interpret: bool = False) -> list[dict]:
    """Each code book's default launch, whole call and kernel alone, with XLA bf16, in one
    round-robin per cell (``out``/``file_name``, rewritten per cell): the issue's "FP4 / NF4
    within 15 % of int4" is a ratio of two of these. ``orders``: weight orders to time (word
    order ``True``, K order ``False``); with both, the kernels alone are named ``…_word_…`` /
    ``…_k_…`` and the whole call is the first order's."""
    rows = []
    key = jax.random.PRNGKey(0)
    for n, k, m in plan:
        xs = [jax.random.normal(jax.random.fold_in(key, c), (m, k), jnp.bfloat16) for c in range(4)]
        cands, configs = {}, {}
        for scheme in schemes:
            for word_order in orders:
                first = "xla_bf16" not in cands   # one XLA baseline per cell
                _, packs, w_bf16 = weight_operands(n, k, key, scheme, with_bf16=first,
                                                   word_order=word_order)
                if interpret:
                    packs, w_bf16 = packs[:1], w_bf16[:1]
                if first:
                    cands["xla_bf16"] = (jnp.dot, [(xs[c % 4], w) for c, w in enumerate(w_bf16)])
                cfg = default_mgpu_config(m, packs[0])
                args = [(xs[c % 4], p) for c, p in enumerate(packs)]
                order = "" if len(orders) == 1 else "_word" if word_order else "_k"
                name = f"{scheme}{order}_kernel_only"
                configs[name] = cfg
                cands[name] = (jax.jit(lambda x, p, cfg=cfg: w4a16_mgpu(
                    x, p, config=cfg, interpret=interpret)), args)
                if word_order == orders[0]:
                    configs[scheme] = cfg
                    cands[scheme] = (jax.jit(lambda x, p, cfg=cfg: w4a16_mgpu_matmul(
                        x, p, config=cfg, interpret=interpret)), args)
        times = time_interleaved(cands, **(dict(warmup=1, reps=1) if interpret else {}))
        record_cell(rows, times, configs, dict(N=n, K=k, M=m), f"{n}x{k} M={m}:",
                    out / file_name)
        del cands
    return rows


# Word order against K order (session 7).
WORD_ORDER_AB_PLAN = ((28672, 8192, 1), (28672, 8192, 16), (8192, 8192, 1), (8192, 28672, 1),
                      (28672, 8192, 64), (28672, 8192, 128))
