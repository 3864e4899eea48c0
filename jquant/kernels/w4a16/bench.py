"""The W4A16 benchmark: 4-bit weight-only schemes as a model runs them, against XLA bf16 ``x @ W``
and XLA dequant+dot, in one run.

A cell's weight comes from the public API: ``get_scheme(name).quantize_weight(w)`` of a random
``[N, K]`` weight, then ``process_weights_after_loading``; the timed candidate is
``scheme.apply(x, prepared)``. ``impls`` may add ``w4a16_matmul`` impls on the weight's kernel
layout, for kernel-level A/Bs.

Each record (JSON) holds op, impl, prepared_impl, scheme, M, N, K, time_us, baselines
{name: time_us}, device, jax_version, commit, date, the launch config, TB/s, TFLOP/s, speedup vs
bf16, % of the byte floor at the HBM rate measured on the device (``hbm_tb_per_s``), and the batch
spread ((slowest − fastest) / median, %) of the kernel and of each baseline. The baselines and
kernels of one cell are timed interleaved, a batch of each in turn (``time_interleaved``).
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Callable, Iterable

import jax
import jax.numpy as jnp

import jquant
from jquant.bench.timing import (array_bytes, copies_for, device_hbm_bytes_per_s, roofline,
                                 spread_pct, time_interleaved, time_steadiest)
from jquant.kernels.w4a16 import (IMPLS, MgpuConfig, PackedW4NK, default_mgpu_config,
                                   resolve_impl, w4a16_matmul)
from jquant.kernels.w4a16.from_qtensor import prepack_for_kernels, unified_w4
from jquant.bench.records import markdown_title, run_meta, write_records

SHAPES = ((28672, 8192), (8192, 28672), (8192, 8192), (4096, 4096), (1536, 576))
MS = (1, 4, 16, 32, 64, 128, 256, 1024, 4096)
QUICK_SHAPES = ((28672, 8192), (8192, 8192), (4096, 4096))
QUICK_MS = (1, 16, 128, 1024)
# Registered scheme names timed by default; int4 is GPTQ-style symmetric uint4b8, groups of 128.
SCHEMES = ("int4_g128", "mxfp4", "nvfp4", "nf4")
M1_ONLY_SCHEMES = ("mxfp4", "nvfp4", "nf4")
# Decode launches (M ≤ 16) timed beside the default by ``--sweep``, as changes to it: the decode
# step's small weights (Llama-3-8B's 4096×4096 o and 6144×4096 q/k/v projections) run far below
# their byte floor at the default's 128 CTAs of 8 steps each (docs/design/w4a16.md).
DECODE_SWEEP = (dict(split_k=1), dict(split_k=4), dict(block_k=128, max_concurrent_steps=6),
                dict(block_k=128, split_k=4), dict(block_n=128), dict(max_concurrent_steps=2),
                dict(block_k=512, max_concurrent_steps=2))


def sweep_configs(m: int, packed: PackedW4NK) -> list[MgpuConfig]:
    """The ``DECODE_SWEEP`` launches other than the default that can run ``packed`` at ``m`` rows: the
    default with each change applied, where the split K range still holds two steps and
    ``group_acc`` still fits (else off).

    Examples:
      >>> import numpy as np
      >>> from jquant.kernels.w4a16 import prepack_nk
      >>> packed = prepack_nk(np.zeros((4096, 128), np.int32), np.ones((32, 128), np.float32), group_size=128)
      >>> [(c.block_n, c.block_k, c.split_k, c.max_concurrent_steps) for c in sweep_configs(1, packed)][:3]
      [(64, 256, 1, 4), (64, 256, 4, 4), (64, 128, 2, 6)]
      >>> sweep_configs(64, packed)  # decode launches only
      []
    """
    from jquant.kernels.w4a16.config import group_acc_fits

    base = default_mgpu_config(m, packed)
    if m > 16 or base.compute_wgs != 1:
        return []
    out = []
    for change in DECODE_SWEEP:
        cfg = dataclasses.replace(base, **change)
        g = packed.group_size
        if (packed.n_pad % cfg.block_n or packed.k_pad % (cfg.split_k * cfg.block_k)
                or packed.k_pad // (cfg.split_k * cfg.block_k) < 2
                or (g % cfg.block_k if g >= cfg.block_k else cfg.block_k % g)):
            continue
        cfg = dataclasses.replace(cfg, group_acc=cfg.group_acc and group_acc_fits(g, cfg.block_k, 1))
        if cfg != base and cfg not in out:
            out.append(cfg)
    return out


def _int4_baseline_weight(n: int, k: int, key) -> tuple[jax.Array, jax.Array]:
    """Inputs of the ``xla_dequant_dot`` baseline: random int4 codes packed two per byte along K
    (``[K/2, N]``, low nibble first) and bf16 scales in groups of 128 (made on the device)."""
    kq, ks = jax.random.split(key)
    q = jax.random.randint(kq, (k, n), 0, 16, jnp.int32).astype(jnp.uint8)
    scale = (jax.random.uniform(ks, (-(-k // 128), n), jnp.float32, 0.5, 2.0) * 0.01).astype(jnp.bfloat16)
    codes = jnp.pad(q, ((0, k % 2), (0, 0)))
    return (codes[0::2] | (codes[1::2] << 4)).astype(jnp.uint8), scale


def _xla_dequant_dot_fn(k: int, group: int) -> Callable:
    """The checkpoint-style baseline: int4 codes packed two per byte along K (low nibble first),
    bf16 scales; XLA converts, scales (materializing W) and dots."""
    def fn(x, packed_rows, scale):
        lo, hi = packed_rows & 15, packed_rows >> 4
        q = jnp.stack([lo, hi], axis=1).reshape(k, -1).astype(jnp.bfloat16)
        w = (q - 8) * jnp.repeat(scale, group, axis=0)[:k]
        return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)
    return jax.jit(fn)


def known_schemes() -> tuple[str, ...]:
    """Registered weight-only schemes: what a cell can time through ``Scheme.apply``."""
    return tuple(s for s in jquant.schemes() if jquant.get_scheme(s).weight_only)


@dataclasses.dataclass
class _SchemeWeight:
    """One scheme's weight for a shape, as users get it, with copies for L2-defeating rotation."""

    scheme: jquant.Scheme
    prepared: list[jquant.Prepared]                  # process_weights_after_loading, then copies
    packed: list[PackedW4NK] | None = None           # the kernel layout, for --impls A/Bs


def _scheme_weight(name: str, w: jax.Array, max_copies: int, kernel_impls: bool) -> _SchemeWeight:
    """``get_scheme → quantize_weight → process_weights_after_loading`` on ``w`` ``[N, K]``."""
    scheme = jquant.get_scheme(name)
    # One jitted program: eager quantization of a 28672×8192 weight materializes every
    # intermediate of 235M elements.
    qw = jax.jit(scheme.quantize_weight)(w)
    prepared = _copies(scheme.process_weights_after_loading(qw), max_copies)
    packed = None
    if kernel_impls:
        if isinstance(prepared[0].data, PackedW4NK):
            packed = [p.data for p in prepared]
        else:   # the device took the XLA reference: lay the weight out for the kernel here
            args = unified_w4(qw)
            one = None if args is None else prepack_for_kernels(args)
            packed = None if one is None else _copies(one, max_copies)
    return _SchemeWeight(scheme, prepared, packed)


def _copies(tree, max_copies: int) -> list:
    """``tree`` and copies of it: distinct buffers holding the same values, so the L2 never has the
    next one."""
    n = copies_for(array_bytes(tree), max_copies=max_copies)
    return [tree] + [jax.tree_util.tree_map(lambda a: a.copy(), tree) for _ in range(n - 1)]


def _scheme_op(prepared: jquant.Prepared, m: int) -> str:
    """What ``scheme.apply`` runs at ``m`` rows: with the Mosaic GPU impl's layout, the path
    ``w4a16_matmul(impl="auto")`` picks (``w4a16_mgpu`` or ``w4a16_xla``); else the impl's name
    (``xla``: the scheme's XLA reference, dequantize + dot)."""
    if isinstance(prepared.data, PackedW4NK):
        return f"w4a16_{resolve_impl('auto', m, weight_elems=prepared.data.n * prepared.data.k)}"
    return prepared.impl


def run(shapes: Iterable[tuple[int, int]] = SHAPES, ms: Iterable[int] = MS,
        schemes: Iterable[str] = SCHEMES, configs: dict | None = None,
        impls: Iterable[str] = ("scheme",), interpret: bool = False, reps: int = 9,
        hbm_bytes_per_s: float | None = None, log: Callable[[str], None] = print,
        max_copies: int = 64, max_spread_pct: float = 25.0, retries: int = 2,
        sweep: bool = False) -> list[dict]:
    """Measures every (shape, M) for int4 (and the M=1 row for the other schemes).

    ``impls``: ``"scheme"`` times ``scheme.apply(x, prepared)``, what a model runs; the names of
    ``w4a16_matmul`` impls (``IMPLS``: auto, mgpu, xla, ...) time that function on the weight's
    kernel layout, a kernel-level A/B. ``configs`` maps ``(N, K, M)`` to an ``MgpuConfig`` for
    those (e.g. a sweep's winners); missing entries use ``default_mgpu_config``. ``sweep``: the
    ``mgpu`` impl also times the ``sweep_configs`` launches of each decode cell (M ≤ 16).
    A cell whose widest batch spread (kernel or baseline) exceeds ``max_spread_pct`` is timed
    again, up to ``retries`` times; its record keeps the steadiest attempt and lists every
    attempt's widest spread (``attempt_spreads_pct``). ``hbm_bytes_per_s``: the rate of the byte floor
    (None: this device's, ``device_hbm_bytes_per_s``).
    """
    configs = configs or {}
    impls = tuple(impls)
    bad = [i for i in impls if i != "scheme" and i not in IMPLS]
    if bad:
        raise ValueError(f"impls {bad} unknown; use 'scheme' or w4a16_matmul impls {IMPLS}")
    if interpret:   # interpret mode measures nothing real: one copy, one warm-up, just the plumbing
        max_copies, warmup, retries = 1, 1, 0
    else:
        warmup = 3
    records = []
    key = jax.random.PRNGKey(0)
    meta = run_meta()
    how = _Timing(impls, configs, interpret, key, max_copies, warmup, reps,
                  hbm_bytes_per_s or device_hbm_bytes_per_s(),
                  max_spread_pct, retries, meta, log, sweep)
    for n, k in shapes:
        w_bf16 = [jax.random.normal(jax.random.fold_in(key, c), (k, n), jnp.bfloat16)
                  for c in range(copies_for(k * n * 2, max_copies=max_copies))]
        rows, int4_scale = _int4_baseline_weight(n, k, key)
        dequant_fn = _xla_dequant_dot_fn(k, 128)
        w = jax.random.normal(jax.random.fold_in(key, 7), (n, k), jnp.bfloat16)
        for scheme in schemes:
            try:
                weight = _scheme_weight(scheme, w, max_copies, any(i != "scheme" for i in impls))
            except Exception as e:  # one failing scheme must not end the run
                log(f"  FAILED {scheme} {n}x{k}: quantize/prepare: {type(e).__name__}: {e}")
                continue
            for m in ms:
                if scheme in M1_ONLY_SCHEMES and m != 1:
                    continue
                records += _cell(weight, n, k, m, w_bf16, (dequant_fn, rows, int4_scale), how)
        del w   # before the next shape's weights are made
    return records


@dataclasses.dataclass(frozen=True)
class _Timing:
    """How ``run`` times its cells (its arguments, and the records' common fields)."""

    impls: tuple[str, ...]
    configs: dict
    interpret: bool
    key: jax.Array
    max_copies: int
    warmup: int
    reps: int
    hbm_bytes_per_s: float
    max_spread_pct: float
    retries: int
    meta: dict
    log: Callable[[str], None]
    sweep: bool = False


def _cell(weight: _SchemeWeight, n: int, k: int, m: int, w_bf16: list, dequant: tuple,
          how: _Timing) -> list[dict]:
    """Times one (shape, M, scheme) cell: its baselines and every impl, interleaved."""
    scheme = weight.scheme.name
    impls, configs, interpret, key, max_copies, log = (how.impls, how.configs, how.interpret, how.key,
                                                       how.max_copies, how.log)
    # As many distinct x as a program has calls of the dequant+dot (which reads one copy of the
    # codes), so XLA merges none of them.
    n_x = copies_for(k * n // 2 + m * k * 2, max_copies=max_copies)
    xs = [jax.random.normal(jax.random.fold_in(key, 100 + c), (m, k), jnp.bfloat16) for c in range(n_x)]
    # Baselines and impls of a cell are timed in turn, so a drift of the device's clocks falls on
    # all of them alike and their ratios hold.
    cands = {}
    if scheme == "int4_g128" or m == 1:
        dequant_fn, rows, int4_scale = dequant
        cands["xla_bf16"] = (jnp.dot, [(xs[c % n_x], w) for c, w in enumerate(w_bf16)])
        cands["xla_dequant_dot"] = (dequant_fn, [(x, rows, int4_scale) for x in xs])
    timed = {}
    for impl, label, sweep_cfg in _candidates(weight, impls, m, how.sweep):
        if impl == "scheme":
            op = _scheme_op(weight.prepared[0], m)
            cfg = default_mgpu_config(m, weight.prepared[0].data) if op == "w4a16_mgpu" else None
            fn = jax.jit(lambda x, p, _s=weight.scheme: _s.apply(x, p))
            copies = weight.prepared
        else:
            if weight.packed is None:
                log(f"  SKIPPED {scheme} {n}x{k} M={m} impl={impl}: no 4-bit kernel layout for this weight")
                continue
            op = f"w4a16_{resolve_impl(impl, m, interpret, weight_elems=n * k)}"
            cfg = (sweep_cfg or configs.get((n, k, m)) or default_mgpu_config(m, weight.packed[0])
                   if op == "w4a16_mgpu" else None)
            fn = jax.jit(lambda x, p, _impl=impl, _cfg=cfg: w4a16_matmul(
                x, p, impl=_impl, config=_cfg, interpret=interpret))
            copies = weight.packed
        args = [(xs[c % n_x], p) for c, p in enumerate(copies)]
        try:
            jax.block_until_ready(fn(*args[0]))
        except Exception as e:  # one failing cell must not end the run
            log(f"  FAILED {scheme} {n}x{k} M={m} impl={label}: {type(e).__name__}: {e}")
            continue
        cands[f"impl:{label}"] = (fn, args)
        timed[label] = (impl, op, cfg, copies[0])
    if not timed:
        return []
    # 10 ms batches: the H200 A/Bs timed with them ran steady, the two H200 runs with 2 ms
    # batches did not (batch spreads in bench/results/h200/w4a16.md).
    times, attempts = time_steadiest(
        lambda: time_interleaved(cands, warmup=how.warmup, reps=how.reps,
                                 min_batch_s=1e-3 if interpret else 10e-3),
        how.max_spread_pct, how.retries)
    baselines = {b: times[b].median_us for b in ("xla_bf16", "xla_dequant_dot") if b in times}
    spread = {b: spread_pct(times[b]) for b in baselines}
    records = []
    for label, (impl, op, cfg, one) in timed.items():
        t = times[f"impl:{label}"]
        nbytes = array_bytes(one, xs[0]) + m * n * 2
        roof = roofline(t.median_us, nbytes, 2 * m * n * k, how.hbm_bytes_per_s)
        rec = dict(op=op, impl=label, scheme=scheme, M=m, N=n, K=k,
                   prepared_impl=weight.prepared[0].impl,
                   time_us=round(t.median_us, 2),
                   baselines={b: round(v, 2) for b, v in baselines.items()},
                   spread_pct=spread_pct(t), baseline_spread_pct=spread,
                   attempt_spreads_pct=attempts,
                   config=dataclasses.asdict(cfg) if cfg else None,
                   tb_per_s=round(roof.tb_per_s, 3),
                   tflop_per_s=round(roof.tflop_per_s, 2),
                   pct_of_byte_floor=round(roof.pct_of_byte_floor, 1),
                   hbm_tb_per_s=round(how.hbm_bytes_per_s / 1e12, 3), **how.meta)
        if "xla_bf16" in baselines:
            rec["speedup_vs_bf16"] = round(baselines["xla_bf16"] / t.median_us, 3)
        records.append(rec)
        log(f"  {scheme:9s} {n}x{k} M={m:<5d} {label:6s} {rec['op']:11s} {rec['time_us']:9.1f} us"
            f"  bf16 {baselines.get('xla_bf16', float('nan')):9.1f}"
            f"  x{rec.get('speedup_vs_bf16', float('nan')):.2f}"
            f"  {rec['tb_per_s']:.2f} TB/s")
    return records


def _candidates(weight: _SchemeWeight, impls: tuple[str, ...], m: int, sweep: bool):
    """``(impl, label, config)`` of each timed candidate: every impl with its default launch, and with
    ``sweep`` the ``mgpu`` impl's ``sweep_configs`` too, labelled ``mgpu#i`` (the record's config says
    which launch)."""
    for impl in impls:
        yield impl, impl, None
        if sweep and impl == "mgpu" and weight.packed is not None:
            for i, cfg in enumerate(sweep_configs(m, weight.packed[0]), 1):
                yield impl, f"mgpu#{i}", cfg


def to_markdown(records: list[dict]) -> str:
    head = ("| scheme | N×K | M | op | µs | XLA bf16 µs | XLA dequant+dot µs | vs bf16 | TB/s | "
            "% byte floor | spread % |\n|---|---|---|---|---|---|---|---|---|---|---|\n")
    rows = []
    for r in records:
        b = r["baselines"]
        op = r["op"] if r.get("impl", "scheme") == "scheme" else f"{r['op']} ({r['impl']}{_launch(r)})"
        rows.append(f"| {r['scheme']} | {r['N']}×{r['K']} | {r['M']} | {op} | {r['time_us']} | "
                    f"{b.get('xla_bf16', '')} | {b.get('xla_dequant_dot', '')} | "
                    f"{r.get('speedup_vs_bf16', '')} | {r['tb_per_s']} | {r['pct_of_byte_floor']} | "
                    f"{_cell_spread(r)} |")
    return markdown_title("W4A16 benchmark", records) + head + "\n".join(rows) + "\n"


def _launch(record: dict) -> str:
    """A swept launch's config, briefly: ``: block_n×block_k, split-K, stages``."""
    c = record.get("config")
    if "#" not in record.get("impl", "") or not c:
        return ""
    return f": {c['block_n']}×{c['block_k']}, split-K {c['split_k']}, {c['max_concurrent_steps']} stages"


def _cell_spread(record: dict) -> str:
    """The widest batch spread among a cell's kernel and baselines ('' for older records)."""
    spreads = [record.get("spread_pct"), *record.get("baseline_spread_pct", {}).values()]
    spreads = [v for v in spreads if v is not None]
    return str(max(spreads)) if spreads else ""


def write(records: list[dict], out_dir, stem: str = "w4a16") -> tuple[pathlib.Path, pathlib.Path]:
    return write_records(records, out_dir, stem, to_markdown)
