"""The memory ledger: where a quantized model's bytes go (codes, scales, float tensors, KV cache).

Answers questions like "the weights halved, so why did concurrency only grow 10%?": the ledger splits
weight memory into quantized codes, quantization metadata (scales, zeros, global scales, act-order
indices) and tensors left in float (embeddings, norms, biases), then adds the KV cache of a serving
configuration and shows how many sequences fit in a memory budget.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jquant.flax import quantize_params
from jquant.schemes.qparam import QParam
from jquant.qtensor import QTensor

from jquant.kv.cache import token_bytes
from jquant.kv.dtypes import kv_cache_spec


@dataclasses.dataclass(frozen=True)
class WeightLedger:
    codes: int  # packed quantized codes
    metadata: int  # scales, zero points, global scales, group indices (nested levels included)
    float_params: int  # parameters left unquantized
    quantized_params: int  # number of weights stored as codes
    float_param_count: int

    @property
    def total(self) -> int:
        return self.codes + self.metadata + self.float_params

    @property
    def bits_per_quantized_weight(self) -> float:
        return 8 * (self.codes + self.metadata) / max(self.quantized_params, 1)

    @property
    def bits_per_weight(self) -> float:
        """``bits_per_quantized_weight``; with nothing quantized, the float tensors' bits per weight (32 for
        float32), so an unquantized model's row shows what its weights cost rather than 0."""
        if self.quantized_params:
            return self.bits_per_quantized_weight
        return 8 * self.float_params / max(self.float_param_count, 1)


def _nbytes(leaf) -> int:
    return int(np.prod(leaf.shape)) * jnp.dtype(leaf.dtype).itemsize


def weight_ledger(params) -> WeightLedger:
    """Accounts every leaf of a (possibly quantized) parameter tree."""
    codes = metadata = floats = qcount = fcount = 0
    for leaf in jax.tree_util.tree_leaves(params, is_leaf=lambda l: isinstance(l, (QParam, QTensor))):
        qt = leaf.qtensor if isinstance(leaf, QParam) else leaf
        if isinstance(qt, QTensor):
            codes += _nbytes(qt.data)
            metadata += qt.nbytes - _nbytes(qt.data)
            qcount += qt.size
        else:
            floats += _nbytes(leaf)
            fcount += int(np.prod(leaf.shape))
    return WeightLedger(codes, metadata, floats, qcount, fcount)


def kv_cache_bytes(*, num_layers: int, num_kv_heads: int, head_dim: int, batch: int, context: int,
                   kv_dtype: str = "bf16", page_size: int = 16) -> int:
    """Bytes of the K and V pages and per-token side arrays that ``jquant.kv.PagedCache.allocate``
    makes for ``batch`` sequences of ``context`` tokens (whole pages; TurboQuant's bf16 boundary
    layers included). Its per-tensor scalars, block tables and lengths are not counted."""
    try:
        spec = kv_cache_spec(kv_dtype)
    except ValueError as e:
        raise ValueError(f"kv_dtype: {e}") from None
    for name, v in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                    ("batch", batch), ("context", context), ("page_size", page_size)):
        if not isinstance(v, (int, np.integer)) or v <= 0:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    tokens = -(-context // page_size) * page_size
    return batch * tokens * token_bytes(spec.name, num_layers=num_layers, kv_heads=num_kv_heads, head_dim=head_dim)


@dataclasses.dataclass(frozen=True)
class ServingLedger:
    name: str
    weights: WeightLedger
    kv_cache: int  # for the requested batch × context
    kv_per_sequence: int

    @property
    def total(self) -> int:
        return self.weights.total + self.kv_cache

    def max_sequences(self, budget_bytes: int) -> int:
        """Sequences of the ledger's context that fit in ``budget_bytes`` next to the weights."""
        return max(0, (budget_bytes - self.weights.total) // self.kv_per_sequence)


def serving_ledger(name: str, params, *, num_layers: int, num_kv_heads: int, head_dim: int, batch: int,
                   context: int, kv_dtype: str = "bf16") -> ServingLedger:
    kv = dict(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim, context=context,
              kv_dtype=kv_dtype)
    return ServingLedger(name, weight_ledger(params), kv_cache_bytes(batch=batch, **kv),
                         kv_cache_bytes(batch=1, **kv))


@dataclasses.dataclass(frozen=True)
class NotApplicable:
    """A scheme that does not fit the model, with the reason (a row of its own in ``format_table``)."""
    name: str
    reason: str


def scheme_ledger(name: str, params, pattern: str, **kv) -> ServingLedger | NotApplicable:
    """``serving_ledger`` of ``params`` with the kernels matching ``pattern`` quantized by scheme ``name``
    (``kv``: ``serving_ledger``'s keywords), or why that scheme cannot quantize them."""
    try:
        qparams, _ = quantize_params(params, [(pattern, name)], prepare=False)
    except ValueError as e:   # e.g. a group size that does not divide a kernel's K
        return NotApplicable(name, str(e))
    return serving_ledger(name, qparams, **kv)


def format_table(rows: list[ServingLedger | NotApplicable], budget_bytes: int | None = None) -> str:
    """A side-by-side table; the first row is the baseline for the ratios."""
    mib = 1 << 20
    head = (f"{'scheme':<24}{'codes MiB':>11}{'scales MiB':>12}{'float MiB':>11}{'weights MiB':>13}"
            f"{'KV MiB':>10}{'total MiB':>11}{'bits/w':>8}")
    if budget_bytes:
        head += f"{'max seqs':>10}{'vs base':>9}"
    lines = [head, "-" * len(head)]
    base = rows[0].max_sequences(budget_bytes) if budget_bytes else None
    for r in rows:
        if isinstance(r, NotApplicable):
            lines.append(f"{r.name:<24}n/a: {r.reason}")
            continue
        w = r.weights
        line = (f"{r.name:<24}{w.codes / mib:>11.2f}{w.metadata / mib:>12.2f}{w.float_params / mib:>11.2f}"
                f"{w.total / mib:>13.2f}{r.kv_cache / mib:>10.2f}{r.total / mib:>11.2f}"
                f"{w.bits_per_weight:>8.2f}")
        if budget_bytes:
            n = r.max_sequences(budget_bytes)
            line += f"{n:>10d}" + (f"{n / base:>8.2f}x" if base else f"{'-':>9}")   # no base sequence fits
        lines.append(line)
    return "\n".join(lines)
