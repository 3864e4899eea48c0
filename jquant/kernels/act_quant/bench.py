"""The activation-quantization benchmark: the e4m3 kernel against the formats' XLA functions, per token
and per 1 × 128 group, timed interleaved in one run on bf16 activations.

Useful bytes: x read in bf16 plus the codes and float32 scales written; the byte floor is at the HBM rate
measured on the device. Inputs rotate over enough copies to miss the L2 (``copies_for``). After timing,
the kernel's QTensor must equal XLA's bit for bit (``bit_exact``).
"""

from __future__ import annotations

import functools
from typing import Callable, Iterable

import jax
import jax.numpy as jnp

from jquant.bench.records import markdown_title, same_bits
from jquant.bench.timing import copies_for, device_hbm_bytes_per_s, roofline, spread_pct, time_interleaved
from jquant.kernels.act_quant.api import quantize_fp8_activations
from jquant.kernels.act_quant.triton import ActQuantConfig

# (M, K): a decode batch and prefills at Llama-3-8B's hidden and intermediate widths.
SHAPES = ((16, 4096), (1024, 8192), (4096, 8192), (4096, 14336))
GROUPS = (None, 128)


def sweep(rows: int, group: int) -> tuple[ActQuantConfig, ...]:
    """``jquant bench act-quant --sweep``: launches of 2K to 32K values a program, 4 to 16 warps."""
    width = 1 << max(0, group - 1).bit_length()
    block_rows = sorted({max(1, min(rows, e // width)) for e in (2048, 8192, 32768)})
    return tuple(ActQuantConfig(block_rows=1 << (b.bit_length() - 1), num_warps=w)
                 for b in block_rows for w in (4, 8, 16))


def useful_bytes(m: int, k: int, group: int | None) -> int:
    return m * k * (2 + 1) + m * (1 if group is None else k // group) * 4


def run(shapes: Iterable[tuple[int, int]] = SHAPES, groups: Iterable[int | None] = GROUPS, reps: int = 9,
        with_sweep: bool = False, interpret: bool = False, meta: dict | None = None,
        log: Callable[[str], None] = print, copies: int | None = None) -> list[dict]:
    """One record per (shape, group, launch): the default launch and, ``with_sweep``, those of ``sweep``,
    timed interleaved with XLA. ``copies``: input copies a timed program rotates over (None:
    ``copies_for``)."""
    hbm = device_hbm_bytes_per_s()
    records = []
    for m, k in shapes:
        xs = [(jax.random.normal(jax.random.key(i), (m, k), jnp.bfloat16),)
              for i in range(copies or copies_for(m * k * 2))]
        for group in groups:
            configs = (None,) + (sweep(m, group or k) if with_sweep else ())
            quant = functools.partial(quantize_fp8_activations, group_size=group)
            fns = {f"kernel:{i}": functools.partial(quant, impl="pallas", config=cfg, interpret=interpret)
                   for i, cfg in enumerate(configs)}
            times = time_interleaved({**{n: (f, xs) for n, f in fns.items()}, "xla": (functools.partial(
                quant, impl="xla"), xs)}, reps=reps)
            ref = jax.jit(functools.partial(quant, impl="xla"))(*xs[0])
            nbytes = useful_bytes(m, k, group)
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
                           bit_exact=same_bits(jax.jit(fns[f"kernel:{i}"])(*xs[0]), ref), **(meta or {}))
                records.append(rec)
                log(f"  act_quant {rec['mode']:5s} {m}x{k} {kt.median_us:8.1f} us {rec['tb_per_s']:5.2f} TB/s  xla "
                    f"{xt.median_us:8.1f} us  bit-exact {rec['bit_exact']}  {cfg}")
    return records


def to_markdown(records: list[dict]) -> str:
    out = [markdown_title("e4m3 activation quantization benchmark", records, "bf16 x; codes e4m3, scales float32") +
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
