"""The decode-attention benchmark: jquant's paged kernel per KV format against JAX's own
``paged_attention`` (bf16 and fp8 pages) and the XLA path, timed interleaved in one run.

A cell is (batch, context, kv_cache_dtype) at 32 query / 8 KV heads, head_dim 128 (Llama-3-8B). Every
sequence holds ``ctx`` tokens in shuffled pages. The byte floor counts the K and V pages and side
arrays each call must read once, at the HBM rate measured on the device (``hbm_tb_per_s``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np

from jquant.bench.records import markdown_title
from jquant.bench.timing import (copies_for, device_hbm_bytes_per_s, roofline, spread_pct, time_interleaved,
                                 time_steadiest)
from jquant.kernels.decode_attention.config import SHARED_BYTES, TuningConfig, shared_bytes
from jquant.kernels.decode_attention.paged_cache import cache_decode_attention
from jquant.kv.dtypes import kv_cache_spec
from jquant.kv.paged import PagedKVCache, allocate

KV_DTYPES = ("bf16", "fp8_e4m3", "fp8_per_token_head", "int8_per_token_head", "turboquant_3bit_nc")
HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
# ``jquant bench attention --sweep``: launches timed beside the default in each cell. The fp8 kernel waits
# on its loads more than it issues (float16 operands cut its instructions by a fifth and its time by 2-5 %
# on the H100, bench/results/h100/attention_operands.md), so the sweep puts more bytes in flight (deeper
# pipelines, 256-token steps over 8 warps) beside the bfloat16-operand launch and 9 splits (what
# TARGET_PROGRAMS = 528 gave at B = 8, 8 KV heads; the H200's split sweep, attention_sweep.md, is why the
# default now takes ~2048 programs). TurboQuant cells (their own kernel, one head a program, their own
# operands) time every launch but the operand one.
SWEEP = (TuningConfig(operand_dtype="bfloat16"), TuningConfig(num_splits=9), TuningConfig(num_stages=3),
         TuningConfig(num_stages=4),
         TuningConfig(num_warps=8), TuningConfig(block_tokens=256, num_warps=8),
         TuningConfig(block_tokens=256, num_warps=8, num_stages=3))


def random_pages(layer: PagedKVCache, key) -> PagedKVCache:
    """Random contents of every page array and per-(token, head) side array (never zeros: a kernel
    can run faster on zeros than on data). Per-tensor scalars keep their value."""
    leaves, tree = jax.tree.flatten(layer)
    keys = jax.random.split(key, len(leaves))
    out = []
    for k, a in zip(keys, leaves):
        if a.ndim == 0:
            out.append(a)
        elif jnp.issubdtype(a.dtype, jnp.integer):
            info = jnp.iinfo(a.dtype)
            out.append(jax.random.randint(k, a.shape, info.min, info.max, jnp.int32).astype(a.dtype))
        elif a.ndim == 3:   # scales, norms, mins: positive, small
            out.append((jax.random.uniform(k, a.shape, jnp.float32, 0.01, 0.03)).astype(a.dtype))
        else:
            out.append(jax.random.normal(k, a.shape, jnp.float32).astype(a.dtype))
    return jax.tree.unflatten(tree, out)


def paged_inputs(kv_cache_dtype: str, batch: int, ctx: int, page_size: int, key):
    """A filled layer, shuffled block tables ``[batch, ctx / page_size]`` and lengths = ctx."""
    pages_per_seq = -(-ctx // page_size)
    layer = allocate(kv_cache_dtype, batch * pages_per_seq, page_size, KV_HEADS, HEAD_DIM,
                     k_scale=0.02, v_scale=0.02)
    layer = random_pages(layer, key)
    perm = np.random.default_rng(0).permutation(batch * pages_per_seq).astype(np.int32)
    tables = jnp.asarray(perm.reshape(batch, pages_per_seq))
    return layer, tables, jnp.full((batch,), ctx, jnp.int32)


def kv_bytes(layer: PagedKVCache, batch: int, ctx: int) -> int:
    """Bytes one call reads from the cache: ctx tokens of every sequence, all KV heads."""
    return batch * ctx * KV_HEADS * kv_cache_spec(layer.spec.name).bytes_per_token_per_head(HEAD_DIM)


def _jax_paged_attention_fn(page_size: int, ctx: int) -> Callable:
    """JAX's Triton paged_attention on its own layout ``[kv_heads, pages, page_size, D]``."""
    from jax.experimental.pallas.ops.gpu import paged_attention as jax_pa

    pages_per_seq = -(-ctx // page_size)
    splits = max(s for s in (1, 2, 4, 8, 16, 32) if pages_per_seq % s == 0)
    block = min(8, pages_per_seq // splits)
    return functools.partial(jax_pa.paged_attention, k_splits=splits, pages_per_compute_block=block)


def _to_jax_layout(pages):
    return jnp.transpose(pages, (2, 0, 1, 3))


def run(batches: Iterable[int] = (8,), ctxs: Iterable[int] = (32768,), kv_dtypes: Iterable[str] = KV_DTYPES,
        page_size: int = 16, reps: int = 9, hbm_bytes_per_s: float | None = None,
        interpret: bool = False, meta: dict | None = None, log: Callable[[str], None] = print,
        configs: Iterable[TuningConfig | None] = (None,)) -> list[dict]:
    """One record per (batch, ctx, kv dtype, launch config); ``configs`` (None: the default launch)
    are timed interleaved with the baselines, so a sweep compares them within one cell.
    ``hbm_bytes_per_s``: the rate of the byte floor (None: this device's, ``device_hbm_bytes_per_s``)."""
    configs = tuple(configs)
    hbm_bytes_per_s = hbm_bytes_per_s or device_hbm_bytes_per_s()
    key = jax.random.key(0)
    records = []
    for batch in batches:
        for ctx in ctxs:
            q = jax.random.normal(key, (batch, HEADS, HEAD_DIM), jnp.bfloat16)
            bf16, tables, lengths = paged_inputs("bf16", batch, ctx, page_size, key)
            base = {}
            if not interpret:   # JAX's kernel compiles for the GPU only
                jpa = _jax_paged_attention_fn(page_size, ctx)
                kj, vj = _to_jax_layout(bf16.k_pages), _to_jax_layout(bf16.v_pages)
                base["jax_paged_attention_bf16"] = (jpa, [(q, kj, vj, tables, lengths)])
                fp8 = lambda a: (a.astype(jnp.float32) * 10).astype(jnp.float8_e4m3fn)
                ones = jnp.full(kj.shape[:-1], 0.1, jnp.float32)
                base["jax_paged_attention_fp8"] = (jpa, [(q, fp8(kj), fp8(vj), tables, lengths, ones, ones)])
            for name in kv_dtypes:
                layer = bf16 if name == "bf16" else paged_inputs(name, batch, ctx, page_size, key)[0]
                n_copies = copies_for(kv_bytes(layer, batch, ctx), max_copies=1 if interpret else 8)
                copies = [layer] + [jax.tree.map(jnp.copy, layer) for _ in range(n_copies - 1)]
                # the kernel forced, as bench gemm8 does: a sweep times the kernel whatever auto would pick
                impl = "xla" if interpret else "pallas"
                cands = dict(base)
                cell_configs = [c for c in configs if c is None or layer.spec.kind != "turboquant"
                                or (c.kv_heads_per_program == 1 and c.operand_dtype is None)]
                too_big = [c for c in cell_configs if c is not None and layer.spec.kind != "turboquant"
                           and shared_bytes(c, layer.head_dim, layer.k_pages.dtype.itemsize) > SHARED_BYTES]
                for c in too_big:
                    log(f"  attention {name}: skipped {c}, its tiles do not fit in shared memory")
                cell_configs = [c for c in cell_configs if c not in too_big]
                for i, cfg in enumerate(cell_configs):
                    ours = jax.jit(functools.partial(cache_decode_attention, impl=impl, config=cfg))
                    cands[f"kernel:{i}"] = (ours, [(q, c, tables, lengths) for c in copies])
                cands["xla"] = (jax.jit(functools.partial(cache_decode_attention, impl="xla")),
                                [(q, layer, tables, lengths)])
                times, attempts = time_steadiest(
                    lambda cands=cands: time_interleaved(cands, warmup=1 if interpret else 3, reps=reps),
                    25.0, 0 if interpret else 1)
                nbytes = kv_bytes(layer, batch, ctx)
                baselines = {b: round(times[b].median_us, 2) for b in times if not b.startswith("kernel:")}
                for i, cfg in enumerate(cell_configs):
                    t = times[f"kernel:{i}"]
                    records.append(_record(name, batch, ctx, page_size, cfg, t, times, baselines, attempts,
                                           nbytes, hbm_bytes_per_s, meta))
                    log(f"  attention {name:20s} B={batch:<3d} ctx={ctx:<6d} {t.median_us:9.1f} us  floor "
                        f"{1e6 * nbytes / hbm_bytes_per_s:8.1f}  {cfg}  "
                        + "  ".join(f"{b} {v:.1f}" for b, v in baselines.items()))
    return records


def _record(name, batch, ctx, page_size, cfg, t, times, baselines, attempts, nbytes, hbm_bytes_per_s, meta):
    """One cell's record; ``config`` is the launch (null: the default ``TuningConfig`` for the shape)."""
    roof = roofline(t.median_us, nbytes, 4 * batch * HEADS * ctx * HEAD_DIM, hbm_bytes_per_s)
    rec = dict(op="decode_attention", kv_dtype=name, batch=batch, ctx=ctx, page_size=page_size,
               heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, time_us=round(t.median_us, 2),
               baselines=baselines, spread_pct=spread_pct(t),
               baseline_spread_pct={b: spread_pct(times[b]) for b in baselines},
               attempt_spreads_pct=attempts, kv_bytes=nbytes,
               config=dataclasses.asdict(cfg) if cfg else None,
               byte_floor_us=round(roof.byte_floor_us, 2), tb_per_s=round(roof.tb_per_s, 3),
               pct_of_byte_floor=round(roof.pct_of_byte_floor, 1),
               hbm_tb_per_s=round(hbm_bytes_per_s / 1e12, 3), **(meta or {}))
    if "jax_paged_attention_bf16" in baselines:
        rec["speedup_vs_jax_bf16"] = round(baselines["jax_paged_attention_bf16"] / t.median_us, 3)
    return rec


def to_markdown(records: list[dict]) -> str:
    out = [markdown_title("Decode attention benchmark", records) +
           "| kv dtype | B | ctx | launch | µs | byte floor µs | % floor | JAX paged bf16 µs | JAX paged fp8 µs | "
           "XLA µs | vs JAX bf16 | spread % |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        b = r["baselines"]
        spread = max([r["spread_pct"], *r["baseline_spread_pct"].values()])
        out.append(f"| {r['kv_dtype']} | {r['batch']} | {r['ctx']} | {_launch(r.get('config'))} | {r['time_us']} | "
                   f"{r['byte_floor_us']} | "
                   f"{r['pct_of_byte_floor']} | {b.get('jax_paged_attention_bf16', '')} | "
                   f"{b.get('jax_paged_attention_fp8', '')} | {b.get('xla', '')} | "
                   f"{r.get('speedup_vs_jax_bf16', '')} | {spread} |")
    return "\n".join(out) + "\n"


def _launch(config: dict | None) -> str:
    """A launch config in a table cell: ``default``, or tokens a step and KV heads a program, then each
    other field the sweep set away from its default (splits, warps, stages, operand dtype)."""
    if not config:
        return "default"
    default = dataclasses.asdict(TuningConfig())
    names = {"num_splits": "splits", "num_warps": "warps", "num_stages": "stages", "operand_dtype": ""}
    rest = "".join(f", {v} {names[k]}".rstrip() for k, v in config.items()
                   if k in names and v != default[k])
    return f"{config['block_tokens']} tok, {config.get('kv_heads_per_program', 1)} heads{rest}"
