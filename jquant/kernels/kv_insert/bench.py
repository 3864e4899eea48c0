"""The KV-insert benchmark: jquant's quantize-and-insert kernel per KV format against
``insert_reference`` (XLA quantize + scatter), timed interleaved in one run.

A cell is (tokens T, kv_cache_dtype) at Llama-3-8B's KV shape (8 KV heads, head_dim 128, page 16):
T = 8 is a decode step's batch, 4096 and 32768 a prefill's. The T slots are shuffled over a pool of
twice as many. Each timed program runs many inserts back to back with the cache donated and carried
(in place, as in a model step), the new K/V tied to the carry so XLA cannot hoist their quantization
out of the loop. Useful bytes: the new K and V read in bf16 plus the codes and side arrays written;
their byte floor is at the HBM rate measured on the device (``hbm_tb_per_s``).
After timing, each kernel's cache must equal the reference's bit for bit (``bit_exact``).
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time
from typing import Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jquant.bench.records import markdown_title, same_bits
from jquant.bench.timing import Timing, device_hbm_bytes_per_s, roofline, spread_pct, time_steadiest
from jquant.kernels.kv_insert import triton
from jquant.kernels.kv_insert.api import insert
from jquant.kernels.kv_insert.triton import InsertConfig
from jquant.kv.dtypes import kv_cache_spec
from jquant.kv.insert_reference import insert_reference
from jquant.kv.paged import allocate

KV_DTYPES = ("bf16", "fp8", "fp8_per_token_head", "int8_per_token_head", "turboquant_k8v4")
TOKENS = (8, 4096, 32768)
KV_HEADS, HEAD_DIM = 8, 128
# ``jquant bench insert --sweep``: launches timed beside the default in each cell.
SWEEP = tuple(InsertConfig(block_tokens=b, num_warps=w) for b in (16, 32, 64, 128) for w in (2, 4, 8))


def useful_bytes(kv_cache_dtype: str, tokens: int) -> int:
    """New K and V read in bf16 plus their codes and side arrays written (per-tensor scalars excluded)."""
    per_head = 2 * 2 * HEAD_DIM + kv_cache_spec(kv_cache_dtype).bytes_per_token_per_head(HEAD_DIM)
    return tokens * KV_HEADS * per_head


def inserts_per_batch(tokens: int) -> int:
    """Inserts in one timed program: enough device work (about 2M tokens) to hide its dispatch."""
    return int(min(1000, max(16, 2**21 // tokens)))


def _looped(insert_fn: Callable, inserts: int) -> Callable:
    """``(cache, *args) -> cache`` after ``inserts`` back-to-back ``insert_fn(cache, *args)``, jitted
    with the cache donated; a barrier ties args to the carry so nothing is hoisted out of the loop."""
    def body(_, carry):
        cache, args = lax.optimization_barrier(carry)
        return insert_fn(cache, *args), args
    return jax.jit(lambda cache, *args: lax.fori_loop(0, inserts, body, (cache, args))[0], donate_argnums=0)


def _time_donated(progs: dict[str, Callable], caches: dict, args: tuple, inserts: int,
                  reps: int) -> dict[str, Timing]:
    """µs per insert of each ``_looped`` program, each in turn ``reps`` times; ``caches[name]`` is
    replaced by its program's output (the input was donated)."""
    samples = {name: [] for name in progs}
    for _ in range(reps):
        for name, prog in progs.items():
            start = time.perf_counter()
            caches[name] = jax.block_until_ready(prog(caches[name], *args))
            samples[name].append(1e6 * (time.perf_counter() - start) / inserts)
    return {name: Timing(statistics.median(v), min(v), tuple(v), inserts) for name, v in samples.items()}


def run(tokens: Iterable[int] = TOKENS, kv_dtypes: Iterable[str] = KV_DTYPES, page_size: int = 16,
        reps: int = 9, hbm_bytes_per_s: float | None = None, interpret: bool = False,
        meta: dict | None = None, log: Callable[[str], None] = print,
        configs: Iterable[InsertConfig | None] = (None,), inserts: int | None = None) -> list[dict]:
    """One record per (T, kv dtype, launch config); ``configs`` (None: the default launch) are timed
    interleaved with the reference. ``inserts``: inserts per timed program (None: ``inserts_per_batch``).
    ``hbm_bytes_per_s``: the rate of the byte floor (None: this device's, ``device_hbm_bytes_per_s``)."""
    configs = tuple(configs)
    hbm_bytes_per_s = hbm_bytes_per_s or device_hbm_bytes_per_s()
    key = jax.random.key(0)
    records = []
    for t in tokens:
        k = jax.random.normal(jax.random.fold_in(key, 1), (t, KV_HEADS, HEAD_DIM), jnp.bfloat16)
        v = jax.random.normal(jax.random.fold_in(key, 2), (t, KV_HEADS, HEAD_DIM), jnp.bfloat16)
        num_pages = 2 * -(-t // page_size)
        slots = jnp.asarray(np.random.default_rng(t).permutation(num_pages * page_size)[:t].astype(np.int32))
        args, n = (k, v, slots), inserts or inserts_per_batch(t)
        for name in kv_dtypes:
            fns = {f"kernel:{i}": functools.partial(insert, impl="pallas", config=cfg, interpret=interpret)
                   for i, cfg in enumerate(configs)}
            fns["xla"] = insert_reference
            progs = {c: _looped(fn, n) for c, fn in fns.items()}
            caches = {c: allocate(name, num_pages, page_size, KV_HEADS, HEAD_DIM, k_scale=0.02, v_scale=0.02)
                      for c in progs}
            for c, prog in progs.items():      # compile and warm up
                caches[c] = jax.block_until_ready(prog(caches[c], *args))
            times, attempts = time_steadiest(lambda: _time_donated(progs, caches, args, n, reps), 25.0,
                                             0 if interpret else 1)
            nbytes = useful_bytes(name, t)
            xt = times["xla"]
            for i, cfg in enumerate(configs):
                kt = times[f"kernel:{i}"]
                roof = roofline(kt.median_us, nbytes, 0, hbm_bytes_per_s)
                rec = dict(op="kv_insert", kv_dtype=name, tokens=t, page_size=page_size, kv_heads=KV_HEADS,
                           head_dim=HEAD_DIM, kernel_covers=triton.covers(kv_cache_spec(name), HEAD_DIM),
                           config=dataclasses.asdict(cfg) if cfg else None, time_us=kt.median_us,
                           baselines={"xla": xt.median_us}, spread_pct=spread_pct(kt),
                           baseline_spread_pct={"xla": spread_pct(xt)}, attempt_spreads_pct=attempts,
                           useful_bytes=nbytes, tb_per_s=roof.tb_per_s,
                           xla_tb_per_s=nbytes / (xt.median_us * 1e-6) / 1e12,
                           speedup_vs_xla=xt.median_us / kt.median_us, byte_floor_us=roof.byte_floor_us,
                           pct_of_byte_floor=roof.pct_of_byte_floor,
                           hbm_tb_per_s=round(hbm_bytes_per_s / 1e12, 3),
                           bit_exact=same_bits(caches[f"kernel:{i}"], caches["xla"]), inserts_per_batch=n,
                           **(meta or {}))
                records.append(rec)
                log(f"  insert {name:20s} T={t:<6d} {kt.median_us:9.1f} us {rec['tb_per_s']:6.2f} TB/s  xla "
                    f"{xt.median_us:9.1f} us {rec['xla_tb_per_s']:6.2f} TB/s  bit-exact {rec['bit_exact']}  {cfg}")
    return records


def to_markdown(records: list[dict]) -> str:
    out = [markdown_title("KV insert benchmark", records, f"{KV_HEADS} KV heads, head_dim {HEAD_DIM}, new K/V in "
                          "bf16, cache donated") +
           "| kv dtype | T | launch | kernel µs | useful TB/s | % byte floor | XLA µs | XLA TB/s | vs XLA | "
           "bit-exact | spread % |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        kernel = f"{r['time_us']:.1f}" + ("" if r["kernel_covers"] else " (reference)")
        launch = "default" if r["config"] is None else f"{r['config']['block_tokens']}/{r['config']['num_warps']}w"
        spread = max([r["spread_pct"], *r["baseline_spread_pct"].values()])
        out.append(f"| {r['kv_dtype']} | {r['tokens']} | {launch} | {kernel} | {r['tb_per_s']:.2f} | "
                   f"{r['pct_of_byte_floor']:.1f} | {r['baselines']['xla']:.1f} | {r['xla_tb_per_s']:.2f} | "
                   f"{r['speedup_vs_xla']:.2f} | {r['bit_exact']} | {spread} |")
    return "\n".join(out) + "\n"
