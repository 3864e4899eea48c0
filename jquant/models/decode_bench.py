"""The decode-step benchmark: one jitted, cache-donating step of a Llama-3-8B-shaped stack.

A cell is (weight scheme, kv_cache_dtype, batch, context). Weights are random (bf16, or quantized by
``quantize_params`` with the scheme on the projections, as a user would), q/k/v and gate/up fused into
one GEMM each by default (``jquant.models.fused``, as vLLM loads them); the paged cache is
filled with random codes so every sequence holds ``ctx`` tokens. The step is what ``decode_step``
runs: embed, 8 (or more) layers with the weight GEMMs, quantize-and-insert of the new token and
paged decode attention, the tied lm_head. In the same run: the bf16 model on a bf16 paged cache, and
the bf16 model on the dense cache (``KVCache``: attention over the whole masked ``max_len``).

The byte floor of a step is the bytes it must read once (every weight, lm_head included, and the
ctx tokens of cache per sequence and layer) at the HBM rate measured in the same run.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from typing import Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np

from jquant.bench.profile import trace_steps
from jquant.bench.records import markdown_title
from jquant.bench.timing import Timing, array_bytes, device_bytes, device_hbm_bytes_per_s, spread_pct
from jquant.checkpoint.hf_checkpoint import PROJECTIONS
from jquant.kernels.decode_attention.bench import random_pages
from jquant.kv.cache import PagedCache, token_bytes
from jquant.models.llama import KVCache, LlamaConfig, LlamaForCausalLM, decode_step, new_cache

STEPS_PER_BATCH = 16


def llama3_8b_shape(num_layers: int = 8, max_len: int = 8192) -> LlamaConfig:
    """Llama-3-8B's layer shapes (hidden 4096, intermediate 14336, 32 query / 8 KV heads of 128) with a
    32000-token vocabulary and ``num_layers`` layers."""
    return LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_layers=num_layers,
                       num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0, rms_norm_eps=1e-5,
                       max_position_embeddings=max_len)


def random_bf16_params(model: LlamaForCausalLM, key) -> dict:
    """Random bf16 parameters (made on the device): weights N(0, 0.02²), norm scales 1."""
    shapes = jax.eval_shape(model.init, key, jnp.zeros((1, 1), jnp.int32))["params"]
    leaves, tree = jax.tree.flatten(shapes)
    keys = jax.random.split(key, len(leaves))

    @jax.jit
    def make(ks):
        return [jnp.ones(s.shape, jnp.bfloat16) if s.ndim == 1 else
                (0.02 * jax.random.normal(k, s.shape, jnp.float32)).astype(jnp.bfloat16)
                for k, s in zip(ks, leaves)]
    return jax.tree.unflatten(tree, make(keys))


def weights_for(scheme: str, bf16_params: dict, prepare: bool = True) -> dict:
    """bf16 params as they are, or their projections quantized with ``scheme`` (and prepared, unless
    ``prepare=False``: tensor-parallel placement prepares each device's piece itself)."""
    if scheme == "bf16":
        return bf16_params
    from jquant.flax.rules import quantize_params
    qparams, _ = quantize_params(bf16_params, [(PROJECTIONS, scheme)], prepare=prepare)
    return qparams


def filled_cache(model: LlamaForCausalLM, kv_cache_dtype: str | None, batch: int, ctx: int, max_len: int,
                 key):
    """A cache whose sequences each hold ``ctx`` random tokens (dense ``KVCache`` when None)."""
    cache = new_cache(model, batch, max_len, kv_cache_dtype)
    if kv_cache_dtype is None:
        rand = lambda i, a: 0.5 * jax.random.normal(jax.random.fold_in(key, i), a.shape, a.dtype)
        return KVCache(tuple(rand(i, k) for i, k in enumerate(cache.keys)),
                       tuple(rand(1000 + i, v) for i, v in enumerate(cache.values)), jnp.int32(ctx))
    layers = tuple(random_pages(layer, jax.random.fold_in(key, i)) for i, layer in enumerate(cache.layers))
    return PagedCache(layers, cache.block_tables, jnp.full((batch,), ctx, jnp.int32))


def _at_ctx(cache, ctx: int):
    """The same buffers with every sequence reset to ``ctx`` tokens (so each batch times the same step)."""
    if isinstance(cache, KVCache):
        return KVCache(cache.keys, cache.values, jnp.int32(ctx))
    return dataclasses.replace(cache, lengths=jnp.full_like(cache.lengths, ctx))


def step_bytes(params: dict, kv_cache_dtype: str | None, batch: int, ctx: int, config: LlamaConfig) -> int:
    """Weights (every leaf once; the tied embedding is lm_head's read) plus ctx cached tokens per
    sequence. A dense cache (``kv_cache_dtype`` None, bf16) counts the ctx tokens it needs, not its max_len."""
    per_token = token_bytes(kv_cache_dtype or "bf16", num_layers=config.num_layers, kv_heads=config.num_kv_heads,
                            head_dim=config.head_dim)
    return array_bytes(params) + batch * ctx * per_token


def time_decode(model, variables, cache, batch: int, ctx: int, reps: int, warmup: int = 2,
                step: Callable | None = None, in_loop: bool = False):
    """µs per step over ``reps`` batches of back-to-back donated steps; returns (``Timing``, cache).
    ``step(variables, token_ids, cache)``: the step to time (default ``decode_step`` of ``model``).
    ``in_loop``: a batch is one jitted call running its steps inside ``lax.scan``, each feeding its
    greedy token to the next, as ``generate`` runs them (no host dispatch between steps)."""
    token = jnp.ones((batch, 1), jnp.int32)
    # check=False: the cells never pass the cache's end, and check_room's read of the lengths would
    # make the host wait for each step before dispatching the next, which is not the step's time.
    decode = functools.partial(decode_step, model, check=False) if step is None else step
    calls = STEPS_PER_BATCH
    if in_loop:
        decode, calls = _greedy_loop(decode, STEPS_PER_BATCH), 1
    for _ in range(warmup):
        cache = _at_ctx(cache, ctx)
        for _ in range(calls):
            logits, cache = decode(variables, token, cache)
        logits.block_until_ready()
    samples = []
    for _ in range(reps):
        cache = _at_ctx(cache, ctx)
        jax.block_until_ready(cache)
        t0 = time.perf_counter()
        for _ in range(calls):
            logits, cache = decode(variables, token, cache)
        logits.block_until_ready()
        samples.append(1e6 * (time.perf_counter() - t0) / STEPS_PER_BATCH)
    if not np.isfinite(np.asarray(logits, np.float32)).all():
        raise FloatingPointError("the decode step produced non-finite logits")
    return Timing(float(np.median(samples)), min(samples), tuple(samples), STEPS_PER_BATCH), cache


def _greedy_loop(step: Callable, steps: int) -> Callable:
    """``steps`` calls of ``step`` inside one jitted ``lax.scan`` (the cache donated), the argmax of each
    step's logits the next step's token: ``generate``'s loop. Returns the last step's logits."""
    @functools.partial(jax.jit, donate_argnums=2)
    def loop(variables, token, cache):
        def body(carry, _):
            logits, cache = carry
            return step(variables, jnp.argmax(logits[:, -1:], axis=-1).astype(jnp.int32), cache), None
        (logits, cache), _ = jax.lax.scan(body, step(variables, token, cache), None, length=steps - 1)
        return logits, cache
    return loop


def _trace(folder: str, model, variables, cache, batch: int, ctx: int, steps: int = 4) -> dict:
    """Traces ``steps`` decode steps into ``folder``; returns ``summarize_trace`` of it."""
    token = jnp.ones((batch, 1), jnp.int32)
    cache = _at_ctx(cache, ctx)

    def run():
        c = cache
        for _ in range(steps):
            logits, c = decode_step(model, variables, token, c, check=False)
        return logits
    return trace_steps(folder, run, steps)


def run(num_layers: int = 8, batches: Iterable[int] = (1, 16), ctxs: Iterable[int] = (1024, 8192),
        schemes: Iterable[str] = ("bf16", "int4_g128"), kv_dtypes: Iterable[str] = ("bf16", "fp8"),
        reps: int = 7, meta: dict | None = None, log: Callable[[str], None] = print,
        shape: Callable[[int, int], LlamaConfig] = llama3_8b_shape, profile_dir: str | None = None,
        fused: bool = True, in_loop: bool = False) -> list[dict]:
    """Every (scheme, kv dtype) cell at every (batch, ctx), with the bf16/bf16 and dense-cache baselines
    of the same (batch, ctx) timed in the same rounds. ``shape(num_layers, max_len)`` gives the model.
    ``profile_dir``: also write a ``jax.profiler`` trace of a few steps of each cell there (one folder a cell),
    to see where a step's time goes. ``fused``: q/k/v and gate/up as one GEMM each. ``in_loop``: also
    time each cell's steps inside one jitted loop, as ``generate`` runs them (``loop_time_us``)."""
    schemes, kv_dtypes = tuple(schemes), tuple(kv_dtypes)
    hbm = device_hbm_bytes_per_s()
    log(f"  HBM copy rate {hbm / 1e12:.2f} TB/s")
    key = jax.random.key(0)
    records = []
    for batch in batches:
        for ctx in ctxs:
            max_len = ctx + (reps + 2) * STEPS_PER_BATCH + 16
            config = shape(num_layers, max_len)
            model = LlamaForCausalLM(config, dtype=jnp.bfloat16, fused_projections=fused)
            bf16 = random_bf16_params(model, key)
            weights = {s: weights_for(s, bf16) for s in dict.fromkeys(("bf16",) + schemes)}
            # The two baselines first, then every (scheme, kv dtype) asked for.
            cells = {("bf16", "dense"): None, ("bf16", "bf16"): "bf16"}
            cells.update({(s, kv): kv for s in schemes for kv in kv_dtypes})
            timed = {}
            for (scheme, kv), kv_name in cells.items():
                cache = None
                try:  # the cache inside: a (batch, ctx) whose dense cache outgrows the GPU still times the rest
                    cache = filled_cache(model, kv_name, batch, ctx, max_len, jax.random.fold_in(key, 7))
                    step_time, cache = time_decode(model, {"params": weights[scheme]}, cache, batch, ctx, reps)
                    loop = None
                    if in_loop:
                        loop, cache = time_decode(model, {"params": weights[scheme]}, cache, batch, ctx, reps,
                                                  in_loop=True)
                    profile = {}
                    if profile_dir:
                        profile = _trace(f"{profile_dir}/{scheme}_{kv}_b{batch}_ctx{ctx}", model,
                                         {"params": weights[scheme]}, cache, batch, ctx)
                        log(f"  profile {scheme} kv={kv}: " + json.dumps(profile))
                except Exception as e:  # one failing cell must not end the run
                    log(f"  FAILED {scheme} kv={kv} B={batch} ctx={ctx}: {type(e).__name__}: {e}")
                    continue
                timed[(scheme, kv)] = (step_time, step_bytes(weights[scheme], kv_name, batch, ctx, config), profile,
                                       loop)
                del cache
            base, _, _, base_loop = timed.get(("bf16", "bf16"), (None,) * 4)
            base, base_loop = (x and x.median_us for x in (base, base_loop))
            dense = timed.get(("bf16", "dense"), (None,))[0]
            dense = dense and dense.median_us
            for (scheme, kv), (step_time, nbytes, profile, loop) in timed.items():
                t = step_time.median_us
                floor_us = 1e6 * nbytes / hbm
                rec = dict(op="decode_step", scheme=scheme, kv_dtype=kv, batch=batch, ctx=ctx, layers=num_layers,
                           fused_projections=fused,
                           time_us=round(t, 1), tokens_per_s=round(batch * 1e6 / t, 1),
                           baselines={"bf16_weights_bf16_kv": base and round(base, 1),
                                      "bf16_weights_dense_cache": dense and round(dense, 1)},
                           spread_pct=spread_pct(step_time),
                           step_bytes=nbytes, byte_floor_us=round(floor_us, 1),
                           pct_of_byte_floor=round(100 * floor_us / t, 1), hbm_tb_per_s=round(hbm / 1e12, 3),
                           speedup_vs_bf16=base and round(base / t, 3), **(meta or {}))
                if loop:
                    rec.update(loop_time_us=round(loop.median_us, 1), loop_spread_pct=spread_pct(loop),
                               loop_speedup_vs_bf16=base_loop and round(base_loop / loop.median_us, 3))
                if profile:
                    rec["profile"] = profile
                records.append(rec)
                log(f"  decode {scheme:10s} kv={kv:20s} B={batch:<3d} ctx={ctx:<6d} {t:9.1f} us  floor "
                    f"{floor_us:8.1f}  x{rec['speedup_vs_bf16'] or float('nan'):.2f} vs bf16")
    return records


def to_markdown(records: list[dict]) -> str:
    meta = records[0] if records else {}
    detail = (f"Llama-3-8B-shaped, {meta.get('layers', '')} layers, random weights, "
              f"{'fused' if meta.get('fused_projections', True) else 'separate'} q/k/v and gate/up GEMMs")
    loop = any("loop_time_us" in r for r in records)
    if loop:
        detail += ("; in-loop: the step inside one jitted lax.scan of 16 greedy steps, as generate runs it "
                   "(no host dispatch between steps)")
    extra = " in-loop µs | in-loop vs bf16 | in-loop spread % |" if loop else ""
    out = [markdown_title("Decode step benchmark", records, detail) +
           "| weights | KV | B | ctx | step µs | tokens/s | byte floor µs | % floor | vs bf16+bf16 KV | "
           "bf16 dense-cache µs | spread % |" + extra, "|---|---|---|---|---|---|---|---|---|---|---|" +
           "---|---|---|" * loop]
    for r in records:
        row = (f"| {r['scheme']} | {r['kv_dtype']} | {r['batch']} | {r['ctx']} | {r['time_us']} | "
               f"{r['tokens_per_s']} | {r['byte_floor_us']} | {r['pct_of_byte_floor']} | "
               f"{r['speedup_vs_bf16']} | {r['baselines']['bf16_weights_dense_cache']} | {r['spread_pct']} |")
        if loop:
            row += f" {r.get('loop_time_us')} | {r.get('loop_speedup_vs_bf16')} | {r.get('loop_spread_pct')} |"
        out.append(row)
    return "\n".join(out) + "\n"


# ---- tensor parallel -----------------------------------------------------------------------------


def shrunk_llama3_8b_shape(factor: int) -> Callable[[int, int], LlamaConfig]:
    """``llama3_8b_shape`` with hidden size, head dim, intermediate size and vocabulary divided by
    ``factor`` (1, 2, 4 or 8; head counts kept, so every tensor-parallel split of the full shape stays
    possible): a plumbing check on CPU, whose timings mean nothing."""
    if factor not in (1, 2, 4, 8):
        raise ValueError(f"the shrink factor must be 1, 2, 4 or 8 (head_dim 128 / factor >= 16), got {factor}")

    def shape(num_layers: int, max_len: int) -> LlamaConfig:
        c = llama3_8b_shape(num_layers, max_len)
        return dataclasses.replace(c, hidden_size=c.hidden_size // factor, head_dim=c.head_dim // factor,
                                   intermediate_size=c.intermediate_size // factor,
                                   vocab_size=c.vocab_size // factor)
    return shape


def run_tp(num_layers: int = 8, batches: Iterable[int] = (16,), ctxs: Iterable[int] = (1024,),
           schemes: Iterable[str] = ("bf16", "int4_g128"), kv_dtypes: Iterable[str] = ("bf16",),
           tps: Iterable[int] = (1, 2, 4, 8), collectives: Iterable[str] = ("psum",), reps: int = 7,
           meta: dict | None = None, log: Callable[[str], None] = print,
           shape: Callable[[int, int], LlamaConfig] = llama3_8b_shape, fused: bool = True) -> list[dict]:
    """The decode step run tensor-parallel (``jquant.parallel``) at every tp of ``tps``, per (scheme, kv
    dtype, batch, ctx) and every ``collectives`` mode (``"psum"``, ``"fp8"``, ``"fp8_rs"``).

    The collectives' time is measured by difference: each cell is timed as it runs and again with every
    exchange replaced by a local stand-in of the same shapes that moves nothing
    (``TensorParallel.local_collectives``); ``collective_us`` is the difference, the communication time
    that overlapping with compute did not hide. At tp = 1 nothing is exchanged and the two are one.
    ``device_bytes``: what one device reads per step (its weights and its heads of ctx cached tokens)."""
    from jquant.parallel import decode_step as tp_decode_step, shard_cache, shard_params, tensor_parallel

    # Contents are random only; XLA compiles rbg's sampling far faster than threefry's on CPU.
    key = jax.random.key(0, impl="rbg")
    records = []
    for batch in batches:
        for ctx in ctxs:
            max_len = ctx + (reps + 2) * STEPS_PER_BATCH + 16
            config = shape(num_layers, max_len)
            model = LlamaForCausalLM(config, dtype=jnp.bfloat16, fused_projections=fused)
            # Separate q/k/v and gate/up: shard_params fuses each device's pieces when the model fuses.
            bf16 = random_bf16_params(model.clone(fused_projections=False), key)
            for scheme in schemes:
                weights = {"params": weights_for(scheme, bf16, prepare=False)}
                for kv in kv_dtypes:
                    filled = filled_cache(model, kv, batch, ctx, max_len, jax.random.fold_in(key, 7))
                    per_token = token_bytes(kv, num_layers=num_layers, kv_heads=config.num_kv_heads,
                                            head_dim=config.head_dim)
                    group = []
                    for tp in tps:
                        try:
                            params = shard_params(tensor_parallel(model, tp), weights)
                        except Exception as e:  # a split this shape does not allow must not end the run
                            log(f"  FAILED {scheme} kv={kv} tp={tp}: {type(e).__name__}: {e}")
                            continue
                        nbytes = device_bytes(params) + batch * ctx * per_token // tp
                        for mode in (("psum",) if tp == 1 else tuple(collectives)):
                            timed = {}
                            for local in ((False,) if tp == 1 else (False, True)):
                                plan = tensor_parallel(model, tp, collectives=mode, local_collectives=local)
                                cache = shard_cache(plan, jax.tree.map(jnp.copy, filled))
                                step = functools.partial(tp_decode_step, plan)
                                try:
                                    timed[local], cache = time_decode(model, params, cache, batch, ctx, reps,
                                                                      step=step)
                                except Exception as e:  # one failing cell must not end the run
                                    log(f"  FAILED {scheme} kv={kv} tp={tp} {mode}: {type(e).__name__}: {e}")
                                del cache
                            if False not in timed:
                                continue
                            t = timed[False].median_us
                            alone = timed.get(True, timed[False]).median_us
                            group.append(dict(
                                op="decode_step", scheme=scheme, kv_dtype=kv, batch=batch, ctx=ctx,
                                layers=num_layers, fused_projections=fused, tp=tp, collectives=mode,
                                time_us=round(t, 1), no_collectives_us=round(alone, 1),
                                collective_us=round(t - alone, 1), collective_pct=round(100 * (t - alone) / t, 1),
                                tokens_per_s=round(batch * 1e6 / t, 1), device_bytes=nbytes,
                                spread_pct=spread_pct(timed[False]),
                                **(meta or {})))
                    tp1 = next((r["time_us"] for r in group if r["tp"] == 1), None)
                    for r in group:
                        psum = next((p["time_us"] for p in group if p["tp"] == r["tp"] and p["collectives"] == "psum"),
                                    None)
                        r["baselines"] = {"tp1_us": tp1, "psum_us": psum}
                        r["vs_tp1"] = tp1 and round(r["time_us"] / tp1, 3)
                        r["speedup_vs_psum"] = psum and round(psum / r["time_us"], 3)
                        log(f"  decode {scheme:10s} kv={kv:10s} B={batch:<3d} ctx={ctx:<6d} tp={r['tp']} "
                            f"{r['collectives']:6s} {r['time_us']:9.1f} us  collectives {r['collective_us']:8.1f}"
                            f"  x{r['vs_tp1'] or float('nan'):.2f} of tp=1")
                    records += group
    return records


def tp_to_markdown(records: list[dict]) -> str:
    """The table of ``run_tp``'s records."""
    meta = records[0] if records else {}
    detail = (f"Llama-3-8B-shaped, {meta.get('layers', '')} layers, random weights, tensor parallel; collective "
              "time = step time - the same step with every exchange replaced by a local stand-in")
    out = [markdown_title("Tensor-parallel decode step benchmark", records, detail) +
           "| weights | KV | B | ctx | TP | collectives | step µs | without collectives µs | collectives µs | "
           "× of TP=1 | vs psum | tokens/s | bytes/device | spread % |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        out.append(f"| {r['scheme']} | {r['kv_dtype']} | {r['batch']} | {r['ctx']} | {r['tp']} | {r['collectives']} | "
                   f"{r['time_us']} | {r['no_collectives_us']} | {r['collective_us']} | {r['vs_tp1']} | "
                   f"{r['speedup_vs_psum']} | {r['tokens_per_s']} | {r['device_bytes']} | {r['spread_pct']} |")
    return "\n".join(out) + "\n"
