"""The activation-quantization benchmark: the e4m3 kernel against the formats' XLA functions, per token
and per 1 × 128 group, timed interleaved in one run on bf16 activations.

Each timed program runs many quantizations of one x back to back in a loop, the output carried (its buffers
reused: a program per call would time the host, ~40 µs a call on the H100, not the device) and x tied to
the carry so nothing is hoisted. x is read each time from where the last call left it: shapes whose bytes
exceed the L2 (50 MB on the H100) measure HBM, smaller ones the L2. Useful bytes: x read in bf16 plus the
codes and float32 scales written; the byte floor is at the HBM rate measured on the device. After timing,
the kernel's QTensor must equal XLA's bit for bit (``bit_exact``).
"""

from __future__ import annotations

import functools
import statistics
import time
from typing import Callable, Iterable

import jax
import jax.numpy as jnp
from jax import lax

from jquant.bench.records import markdown_title, same_bits
from jquant.bench.timing import Timing, device_hbm_bytes_per_s, roofline, spread_pct
from jquant.kernels.act_quant.api import quantize_fp8_activations
from jquant.kernels.act_quant.triton import ActQuantConfig

# (M, K): a decode batch, then prefills past the L2 at Llama-3-70B's hidden, Llama-3-8B's intermediate and
# DeepSeek-V3's hidden widths.
SHAPES = ((16, 4096), (4096, 8192), (4096, 14336), (4096, 7168))
GROUPS = (None, 128)


def sweep(rows: int, group: int) -> tuple[ActQuantConfig, ...]:
    """``jquant bench act-quant --sweep``: launches of 2K to 32K values a program, 4 to 16 warps."""
    width = 1 << max(0, group - 1).bit_length()
    block_rows = sorted({max(1, min(rows, e // width)) for e in (2048, 8192, 32768)})
    return tuple(ActQuantConfig(block_rows=1 << (b.bit_length() - 1), num_warps=w)
                 for b in block_rows for w in (4, 8, 16))


def useful_bytes(m: int, k: int, group: int | None) -> int:
    return m * k * (2 + 1) + m * (1 if group is None else k // group) * 4


def calls_per_program(nbytes: int) -> int:
    """Quantizations in one timed program: about 1 GiB of useful bytes, 16 to 2000 calls."""
    return int(min(2000, max(16, 2**30 // nbytes)))


def _looped(fn: Callable, calls: int) -> Callable:
    """``x -> fn(x)`` after ``calls`` back-to-back calls in one jitted program (see the module's note)."""
    def body(_, carry):
        x, _ = lax.optimization_barrier(carry)
        return x, fn(x)

    def program(x):
        out = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(fn, x))
        return lax.fori_loop(0, calls, body, (x, out))[1]
    return jax.jit(program)


def _time_looped(progs: dict[str, Callable], x, calls: int, reps: int) -> dict[str, Timing]:
    """µs per call of each ``_looped`` program, each in turn ``reps`` times (after one warm-up)."""
    for prog in progs.values():
        jax.block_until_ready(prog(x))
    samples = {name: [] for name in progs}
    for _ in range(reps):
        for name, prog in progs.items():
            start = time.perf_counter()
            jax.block_until_ready(prog(x))
            samples[name].append(1e6 * (time.perf_counter() - start) / calls)
    return {name: Timing(statistics.median(v), min(v), tuple(v), calls) for name, v in samples.items()}


def run(shapes: Iterable[tuple[int, int]] = SHAPES, groups: Iterable[int | None] = GROUPS, reps: int = 9,
        with_sweep: bool = False, interpret: bool = False, meta: dict | None = None,
        log: Callable[[str], None] = print, calls: int | None = None) -> list[dict]:
    """One record per (shape, group, launch): the default launch and, ``with_sweep``, those of ``sweep``,
    timed interleaved with XLA. ``calls``: quantizations a timed program runs (None: ``calls_per_program``)."""
    hbm = device_hbm_bytes_per_s()
    records = []
    for m, k in shapes:
        x = jax.random.normal(jax.random.key(m * k), (m, k), jnp.bfloat16)
        for group in groups:
            configs = (None,) + (sweep(m, group or k) if with_sweep else ())
            quant = functools.partial(quantize_fp8_activations, group_size=group)
            fns = {f"kernel:{i}": functools.partial(quant, impl="pallas", config=cfg, interpret=interpret)
                   for i, cfg in enumerate(configs)}
            fns["xla"] = functools.partial(quant, impl="xla")
            nbytes = useful_bytes(m, k, group)
            n = calls or calls_per_program(nbytes)
            times = _time_looped({name: _looped(fn, n) for name, fn in fns.items()}, x, n, reps)
            ref = jax.jit(fns["xla"])(x)
            xt = times["xla"]
            for i, cfg in enumerate(configs):
                kt = times[f"kernel:{i}"]
                roof = roofline(kt.median_us, nbytes, 0, hbm)
                rec = dict(op="act_quant", rows=m, k=k, group=group or k, mode="token" if group is None else "group",
                           config=None if cfg is None else dict(block_rows=cfg.block_rows, num_warps=cfg.num_warps),
                           time_us=kt.median_us, baselines={"xla": xt.median_us}, spread_pct=spread_pct(kt),
                           baseline_spread_pct={"xla": spread_pct(xt)}, useful_bytes=nbytes,
                           tb_per_s=roof.tb_per_s, xla_tb_per_s=nbytes / (xt.median_us * 1e-6) / 1e12,
                           speedup_vs_xla=xt.median_us / kt.median_us, byte_floor_us=roof.byte_floor_us,
                           pct_of_byte_floor=roof.pct_of_byte_floor, hbm_tb_per_s=round(hbm / 1e12, 3),
                           bit_exact=same_bits(jax.jit(fns[f"kernel:{i}"])(x), ref), calls_per_program=n,
                           **(meta or {}))
                records.append(rec)
                log(f"  act_quant {rec['mode']:5s} {m}x{k} {kt.median_us:8.1f} us {rec['tb_per_s']:5.2f} TB/s  xla "
                    f"{xt.median_us:8.1f} us  bit-exact {rec['bit_exact']}  {cfg}")
    return records


def to_markdown(records: list[dict]) -> str:
    title = markdown_title("e4m3 activation quantization benchmark", records, "bf16 x; codes e4m3, scales float32")
    out = [title +
           "| mode | M × K | launch | kernel µs | useful TB/s | % byte floor | XLA µs | XLA TB/s | vs XLA | bit-exact "
           "| spread % |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        launch = "default" if r["config"] is None else f"{r['config']['block_rows']}/{r['config']['num_warps']}w"
        mode = "token" if r["mode"] == "token" else f"1 × {r['group']}"
        spread = max([r["spread_pct"], *r["baseline_spread_pct"].values()])
        out.append(f"| {mode} | {r['rows']} × {r['k']} | {launch} | {r['time_us']:.1f} | {r['tb_per_s']:.2f} | "
                   f"{r['pct_of_byte_floor']:.1f} | {r['baselines']['xla']:.1f} | {r['xla_tb_per_s']:.2f} | "
                   f"{r['speedup_vs_xla']:.2f} | {r['bit_exact']} | {spread} |")
    return "\n".join(out) + "\n"
