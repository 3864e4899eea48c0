"""The probe stages of tools/device_w4a16_mgpu.py: where an M = 1 CTA's time goes (patched
consumer and epilogue), how fast TMA streams the weight by tile shape, and the GPU's state."""

from __future__ import annotations

import dataclasses
import pathlib

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jquant.bench.timing import copies_for, time_interleaved
from jquant.pallas_kernels.w4a16_mgpu import default_mgpu_config, w4a16_mgpu, x_rows
from jquant.pallas_kernels.w4a16_mgpu_common import step_specs
from tools.device_w4a16_mgpu_ab import add_candidate, log, record_cell, weight_operands

def latency_probe(out: pathlib.Path, plan=(((28672, 8192), 1), ((8192, 8192), 1)),
                  interpret: bool = False) -> list[dict]:
    """Where an M = 1 CTA's time goes (bench/NOTES.md, sessions 4 and 5): the kernel alone (x
    unpadded), timed round-robin, as is; with an empty consumer (copies and barriers only); with
    the epilogue waiting for its store's writes too (as before session 5, not only until shared
    memory is read); and with fewer, longer CTAs whose tiles are all in flight at once. The
    variants patch this process's modules only (``out``/latency_probe.json)."""
    from jquant.pallas_kernels import w4a16_mgpu as kernel_mod
    real_step, real_wait = kernel_mod.decode_mma_step, kernel_mod.plgpu.wait_smem_to_gmem

    def empty_step(*args, **kwargs):
        del args, kwargs

    def full_wait(n, wait_read_only=False):
        del wait_read_only
        real_wait(n, wait_read_only=False)

    rows = []
    key = jax.random.PRNGKey(0)
    for (n, k), m in plan:
        _, packs, w_bf16 = weight_operands(n, k, key)
        if interpret:
            packs = packs[:1]
        base = default_mgpu_config(m, packs[0])
        steps = k // base.block_k
        alts = {"default": (base, real_step, real_wait),
                "empty_consumer": (base, empty_step, real_wait),
                "full_epilogue_wait": (base, real_step, full_wait),
                "empty_consumer_full_wait": (base, empty_step, full_wait)}
        for sp in (4, 2):
            st = min(steps // sp, 8)
            cfg = dataclasses.replace(base, split_k=sp, max_concurrent_steps=st)
            alts[f"sp{sp}_st{st}"] = (cfg, real_step, real_wait)
            alts[f"sp{sp}_st{st}_full_wait"] = (cfg, real_step, full_wait)
        xs = [jax.random.normal(jax.random.fold_in(key, c), (x_rows(m), k), jnp.bfloat16)
              for c in range(4)]
        cands = {}
        for name, (cfg, step_fn, wait_fn) in alts.items():
            kernel_mod.decode_mma_step, kernel_mod.plgpu.wait_smem_to_gmem = step_fn, wait_fn
            try:   # traced and compiled under the patch
                fn = jax.jit(lambda x, p, cfg=cfg: w4a16_mgpu(x, p, config=cfg, interpret=interpret))
                add_candidate(cands, name, fn, [(xs[c % 4], p) for c, p in enumerate(packs)],
                              f"{n}x{k} M={m} {name}")
            finally:
                kernel_mod.decode_mma_step, kernel_mod.plgpu.wait_smem_to_gmem = real_step, real_wait
        cands["xla_bf16"] = (jnp.dot, [(xs[c % 4][:m], w) for c, w in enumerate(w_bf16)])
        times = time_interleaved(cands, **(dict(warmup=1, reps=1) if interpret else {}))
        configs = {name: alts[name][0] if name in alts else None for name in times}
        record_cell(rows, times, configs, dict(N=n, K=k, M=m), f"{n}x{k} M={m} kernel alone:",
                    out / "latency_probe.json")
        del packs, w_bf16
    return rows


PIPELINE_PROBE_PIECES = {   # name: (inputs the pipeline copies, epilogue store)
    "w": (("w",), False), "w_store": (("w",), True), "w_x": (("w", "x"), False),
    "w_s": (("w", "s"), False), "w_x_s": (("w", "x", "s"), False),
    "w_x_s_store": (("w", "x", "s"), True)}


def pipeline_probe(out: pathlib.Path, plan=((28672, 8192), (8192, 8192)), m: int = 1,
                   interpret: bool = False) -> list[dict]:
    """Copies only, at the default M = 1 launch and with its own BlockSpecs (``step_specs``):
    the weight alone, plus x's tile, plus the scale rows, plus the partial's store, timed
    round-robin (``out``/pipeline_probe.json): which piece of the pipeline costs what between
    the weight stream and the empty consumer (bench/NOTES.md, session 9)."""
    rows = []
    key = jax.random.PRNGKey(0)
    for n, k in plan:
        _, packs, _ = weight_operands(n, k, key, with_bf16=False)
        packs = packs[:1] if interpret else packs
        cfg = default_mgpu_config(m, packs[0])
        steps = packs[0].k_pad // cfg.split_k // cfg.block_k
        xs = [jax.random.normal(jax.random.fold_in(key, c), (x_rows(m), k), jnp.bfloat16)
              for c in range(4)]
        cands = {}
        for name, (pieces, store) in PIPELINE_PROBE_PIECES.items():
            def kernel(x_gmem, w_gmem, s_gmem, o_gmem, o_smem, pieces=pieces, store=store):
                ni, si = jax.lax.axis_index("n"), jax.lax.axis_index("s")
                specs = dict(zip(("w", "x", "s"), step_specs(
                    cfg, group_size=packs[0].group_size, coords=lambda t: (ni, 0, si * steps + t),
                    has_zero=False, delay_all=False)))
                gmem = dict(w=w_gmem, x=x_gmem, s=s_gmem)
                plgpu.emit_pipeline(lambda idx, *refs: None, grid=(steps,),
                                    in_specs=[specs[p] for p in pieces],
                                    max_concurrent_steps=cfg.max_concurrent_steps)(
                                        *(gmem[p] for p in pieces))
                if store:
                    o_smem[...] = jnp.zeros(o_smem.shape, jnp.float32)
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[si, pl.ds(ni * cfg.block_n,
                                                                          cfg.block_n)])
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

            p0 = packs[0]
            call = plgpu.kernel(
                kernel, out_type=jax.ShapeDtypeStruct((cfg.split_k, p0.n_pad, cfg.block_m),
                                                      jnp.float32),
                scratch_types=[plgpu.SMEM((cfg.block_n, cfg.block_m), jnp.float32)],
                grid=(p0.n_pad // cfg.block_n, cfg.split_k), grid_names=("n", "s"))
            fn = jax.jit(lambda x, p, call=call: call(x, p.data, p.scale))
            if interpret:
                with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
                    jax.block_until_ready(fn(xs[0], packs[0]))
                continue
            add_candidate(cands, name, fn, [(xs[c % 4], p) for c, p in enumerate(packs)],
                          f"pipeline probe {name}")
        kern = jax.jit(lambda x, p: w4a16_mgpu(x, p, config=cfg))
        if not interpret:
            cands["default_kernel_only"] = (kern, [(xs[c % 4], p) for c, p in enumerate(packs)])
            times = time_interleaved(cands)
            record_cell(rows, times, {name: cfg for name in times}, dict(N=n, K=k, M=m),
                        f"pipeline probe {n}x{k} M={m}:", out / "pipeline_probe.json")
        del packs
    return rows


COPY_PROBE_LAYOUTS = {  # name: (dtype, block [rows, cols], tile cols, swizzle bytes or None)
    "int4_bk256_swz32": (jnp.int4, (64, 256), 64, 32),       # today's weight tile
    "int4_bk256_swz128": (jnp.int4, (64, 256), 256, 128),
    "u8_bk256_swz128": (jnp.uint8, (64, 128), 128, 128),     # the same bytes, as uint8
    "u8_bk256_plain": (jnp.uint8, (64, 128), None, None),
    "u8_bn128_bk256_swz128": (jnp.uint8, (128, 128), 128, 128),
    "u8_bk512_swz128": (jnp.uint8, (64, 256), 128, 128),
    "int4_bk512_swz32": (jnp.int4, (64, 512), 64, 32),
    "int4_bn128_bk256_swz128": (jnp.int4, (128, 256), 256, 128),
    "int4_bk512_swz128": (jnp.int4, (64, 512), 256, 128),
}


def copy_probe(out: pathlib.Path, n: int = 28672, k: int = 8192, split: int = 8,
               stages=(3, 4), interpret: bool = False, layouts=tuple(COPY_PROBE_LAYOUTS),
               file_name: str = "copy_probe.json") -> list[dict]:
    """Copies only: how fast TMA streams the weight through an emit_pipeline of one-CTA-per-tile
    launches, by smem tile shape and swizzle (box rows of 32 vs 128 bytes), with no consumer
    (``out``/``file_name``); ``layouts``: names in ``COPY_PROBE_LAYOUTS``."""
    key = jax.random.PRNGKey(0)
    codes = jax.random.randint(key, (n, k), -8, 8, jnp.int32).astype(jnp.int4)
    as_u8 = jax.random.randint(key, (n, k // 2), 0, 256, jnp.int32).astype(jnp.uint8)
    rows, cands, configs = [], {}, {}
    for name in layouts:
        dtype, block, tile_cols, swz = COPY_PROBE_LAYOUTS[name]
        w = codes if dtype == jnp.int4 else as_u8
        copies = [w] if interpret else [w] + [w.copy() for _ in range(copies_for(n * k // 2, max_copies=64) - 1)]
        transforms = (() if swz is None else
                      (plgpu.TilingTransform((8, tile_cols)), plgpu.SwizzleTransform(swz)))
        for st in stages:
            steps = w.shape[1] // split // block[1]

            def kernel(w_gmem, o_gmem, block=block, transforms=transforms, steps=steps):
                ni, si = jax.lax.axis_index("n"), jax.lax.axis_index("s")
                spec = plgpu.BlockSpec(block, lambda t: (ni, si * steps + t), transforms=transforms)
                plgpu.emit_pipeline(lambda idx, w_smem: None, grid=(steps,), in_specs=[spec],
                                    max_concurrent_steps=st)(w_gmem)
                del o_gmem

            call = plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct((8,), jnp.float32),
                                grid=(n // block[0], split), grid_names=("n", "s"))
            if interpret:
                with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
                    fn = jax.jit(lambda a, call=call: call(a))
                    jax.block_until_ready(fn(copies[0]))
                continue
            add_candidate(cands, f"{name}_st{st}", jax.jit(call), [(c,) for c in copies],
                          f"copy probe {name} st{st}")
    if interpret:
        return rows
    times = time_interleaved(cands)
    record_cell(rows, times, configs, dict(N=n, K=k, split_k=split),
                f"copy probe {n}x{k} sp{split}:", out / file_name)
    return rows


def stream_probe(out: pathlib.Path, interpret: bool = False, cells=((28672, 8192),),
                 splits=(4, 8, 16), layouts=("int4_bk256_swz128",), **kw) -> list[dict]:
    """The weight stream of the M = 1 default's tile (64 rows × 256 codes, 128-byte rows; or
    ``layouts``) by grid shape: split-K × 2 / 3 / 4 / 6 stages, copies only, for each N×K of
    ``cells`` (``out``/stream_probe.json). Session 9's pipeline probe took ~35 µs at split-K 4
    where session 5's copy probe took 30 at split-K 8 (bench/NOTES.md)."""
    rows = []
    for n, k in cells:
        for split in splits:
            rows += copy_probe(out, n=n, k=k, split=split, stages=(2, 3, 4, 6),
                               interpret=interpret, layouts=layouts,
                               file_name="stream_probe.json", **kw)
    return rows


def gpu_state(out: pathlib.Path, tag: str) -> None:
    """nvidia-smi's clocks, power and other processes on the GPU, logged (noise hunting)."""
    import subprocess
    cmd = ["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,clocks.max.sm,power.draw,temperature.gpu,"
           "utilization.gpu,clocks_throttle_reasons.active", "--format=csv"]
    try:
        text = subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout
        text += subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                                "--format=csv"], capture_output=True, text=True, timeout=20).stdout
    except Exception as e:   # the tool may be missing
        text = f"{type(e).__name__}: {e}"
    log(f"gpu state {tag}: {text.strip()}")
    with open(out / "gpu_state.txt", "a") as f:
        f.write(f"--- {tag}\n{text}\n")


def launch_overhead_probe(out: pathlib.Path, interpret: bool = False) -> list[dict]:
    """What one op costs in a program of back-to-back calls (the bench's ``time_interleaved``)
    beyond its own run: a one-element XLA fusion, an empty Mosaic GPU kernel, one that TMA-copies
    a 16 KB tile in and out, and two empty Mosaic GPU kernels per call; with the 8192×8192 M = 1
    kernel and XLA bf16 for scale (``out``/launch_overhead_probe.json). ncu timed that kernel at
    14.8 µs alone where this harness reads 19–25 (bench/NOTES.md, session 10)."""
    def empty(x_gmem, o_gmem):   # takes each call's own input, so XLA merges no two calls
        del x_gmem, o_gmem

    empty_call = plgpu.kernel(empty, out_type=jax.ShapeDtypeStruct((128,), jnp.float32),
                              grid=(1,), grid_names=("g",))

    def tma(x_gmem, o_gmem, smem, bar):
        plgpu.copy_gmem_to_smem(x_gmem, smem, bar)
        plgpu.barrier_wait(bar)
        plgpu.copy_smem_to_gmem(smem, o_gmem)
        plgpu.wait_smem_to_gmem(0)

    tile = jax.ShapeDtypeStruct((64, 128), jnp.bfloat16)
    tma_call = plgpu.kernel(tma, out_type=tile, grid=(1,), grid_names=("g",),
                            scratch_types=[plgpu.SMEM((64, 128), jnp.bfloat16), plgpu.Barrier()])
    key = jax.random.PRNGKey(0)
    small = [jax.random.normal(jax.random.fold_in(key, c), (64, 128), jnp.bfloat16)
             for c in range(4)]
    fns = {"xla_fusion": lambda x: x[:1, :1] + 1,
           "mgpu_empty": empty_call,
           "mgpu_tma_16kb": tma_call,
           "mgpu_empty_x2": lambda x: empty_call(x)[:1] + empty_call(x[1:])[1:2]}
    if interpret:
        with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
            for fn in fns.values():
                jax.block_until_ready(jax.jit(fn)(small[0]))
        return []
    cands = {name: (jax.jit(fn), [(x,) for x in small]) for name, fn in fns.items()}
    _, packs, w_bf16 = weight_operands(8192, 8192, key)
    xs = [jax.random.normal(jax.random.fold_in(key, c), (1, 8192), jnp.bfloat16) for c in range(4)]
    cfg = default_mgpu_config(1, packs[0])
    cands["w4a16_8192_m1_kernel_only"] = (jax.jit(lambda x, p: w4a16_mgpu(x, p, config=cfg)),
                                          [(xs[c % 4], p) for c, p in enumerate(packs)])
    cands["xla_bf16_8192_m1"] = (jnp.dot, [(xs[c % 4], w) for c, w in enumerate(w_bf16)])
    rows = []
    times = time_interleaved(cands)
    record_cell(rows, times, {}, dict(probe="launch overhead"), "launch overhead:",
                out / "launch_overhead_probe.json")
    return rows
