"""``jquant bench gptq``: GPTQ of one Llama-3-8B-shaped decoder layer, as ``calibrate_llama`` runs it.

The seven projections (q/k/v share the attention input, gate/up the MLP input) with calibration
activations of ``rows × seq_len`` tokens (default 128 × 2048), streamed into the four Hessians in
batches of ``batch_rows`` rows, then ``gptq_quantize_kernel`` per projection. Activations are random
heavy-tailed bf16 (Student-t with a few 20× outlier channels); GPTQ's cost does not depend on their
values, and they are made before the clock starts. Times are wall clock, every result blocked on, compilation excluded (one untimed warm-up run
of the same shapes), and the Hessian and GPTQ stages are reported apart.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp

from jquant.algorithms.gptq import Hessian, gptq_quantize_kernel
from jquant.bench.records import markdown_title

# Llama-3-8B: hidden 4096, intermediate 14336, 32 query / 8 KV heads of 128.
PROJECTIONS = {"q_proj": (4096, 4096), "k_proj": (4096, 1024), "v_proj": (4096, 1024), "o_proj": (4096, 4096),
               "gate_proj": (4096, 14336), "up_proj": (4096, 14336), "down_proj": (14336, 4096)}
INPUTS = {"q_proj": "attention", "k_proj": "attention", "v_proj": "attention", "o_proj": "attention_out",
          "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp_hidden"}


@dataclasses.dataclass(frozen=True)
class LayerShape:
    """Kernel shapes ``[K, N]`` per projection (scaled down for a plumbing check)."""

    projections: dict

    def scaled(self, divisor: int) -> "LayerShape":
        return LayerShape({n: (k // divisor, m // divisor) for n, (k, m) in self.projections.items()})


LLAMA3_8B = LayerShape(PROJECTIONS)


def _activations(key, rows: int, seq_len: int, k: int) -> jax.Array:
    x = jax.random.t(key, 4.0, (rows, seq_len, k), jnp.float32)
    outliers = jnp.zeros((k,)).at[jnp.arange(0, k, max(1, k // 6))].set(19.0) + 1.0
    return (x * outliers).astype(jnp.bfloat16)


def run(shape: LayerShape = LLAMA3_8B, *, rows: int = 128, seq_len: int = 2048, batch_rows: int = 8,
        scheme: str = "int4_g128", act_order: bool = True, meta: dict | None = None) -> dict:
    """One timed GPTQ of the layer (after an untimed warm-up of the same shapes): a record with the
    Hessian and GPTQ seconds, per projection too."""
    if rows % batch_rows:
        raise ValueError(f"rows={rows} must be a multiple of batch_rows={batch_rows}")
    kernels = {n: jax.random.normal(jax.random.key(i), s, jnp.bfloat16) * 0.02
               for i, (n, s) in enumerate(shape.projections.items())}
    widths = {INPUTS[n]: k for n, (k, _) in shape.projections.items()}

    # Made before the clock starts (14 GB of bf16 at the default size): a model's forward makes them.
    batches = [{name: _activations(jax.random.key(1000 * b + i), batch_rows, seq_len, k)
                for i, (name, k) in enumerate(widths.items())} for b in range(rows // batch_rows)]
    jax.block_until_ready(batches)

    def once():
        t0 = time.perf_counter()
        hessians = {name: Hessian.zeros(k) for name, k in widths.items()}
        for batch in batches:
            for name, x in batch.items():
                hessians[name] = hessians[name].update(x)
        jax.block_until_ready(hessians)
        t1 = time.perf_counter()
        per = {}
        for n, kernel in kernels.items():
            s = time.perf_counter()
            jax.block_until_ready(gptq_quantize_kernel(kernel, hessians[INPUTS[n]], scheme=scheme, act_order=act_order))
            per[n] = time.perf_counter() - s
        return t1 - t0, per

    once()
    hessian_s, per = once()
    return dict(meta or {}, op="gptq_layer", bench="gptq_layer", scheme=scheme, act_order=act_order, rows=rows, seq_len=seq_len,
                batch_rows=batch_rows, shapes={n: list(s) for n, s in shape.projections.items()},
                hessian_s=round(hessian_s, 3), gptq_s=round(sum(per.values()), 3),
                total_s=round(hessian_s + sum(per.values()), 3), per_projection_s={n: round(v, 3) for n, v in per.items()})


def to_markdown(records: list[dict]) -> str:
    # --shrink's factor, from the first record's shapes: a shrunk run must not read as Llama-3-8B's timings.
    shrink = PROJECTIONS["q_proj"][0] // records[0]["shapes"]["q_proj"][0] if records else 1
    shrunk = f", every dimension shrunk {shrink}× (a plumbing check)" if shrink > 1 else ""
    lines = [markdown_title("GPTQ of one Llama-3-8B-shaped layer", records,
                            f"7 projections{shrunk}, Hessians streamed from bf16 activations, compilation excluded"),
             "| scheme | act-order | tokens | Hessians | GPTQ | total | slowest projection |",
             "|---|---|---|---|---|---|---|"]
    for r in records:
        slowest = max(r["per_projection_s"], key=r["per_projection_s"].get)
        lines.append(f"| {r['scheme']} | {r['act_order']} | {r['rows']} × {r['seq_len']} | {r['hessian_s']:.2f} s | "
                     f"{r['gptq_s']:.2f} s | {r['total_s']:.2f} s | {slowest} {r['per_projection_s'][slowest]:.2f} s |")
    return "\n".join(lines) + "\n"
