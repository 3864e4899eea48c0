"""Expert slots: rows sorted by expert, cut into tiles of ``block_m`` rows that each hold one expert's
rows, the layout the grouped Mosaic GPU GEMMs run over (``grouped_w4a16``, ``grouped_fp8``).

An expert of g rows takes ``ceil(g / block_m)`` slots; a slot's rows past its count are zero. The
number of slots ``S`` is static: at most one slot per row, and at most ``ceil(T / block_m) + E − 1``
(one partial slot per expert). ``Slots.take`` gathers sorted rows into the ``[S · block_m, K]`` slot
layout and ``Slots.rows`` gathers each row's result back; a MoE layer whose two expert GEMMs share a
``Slots`` keeps the hidden activations in the slot layout between them (``chains``), one gather each
way instead of two.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


def slot_table(group_sizes: jax.Array, rows: int, block_m: int):
    """``(ids, counts, first, slot_of_row)`` for rows sorted by expert: slot i holds ``counts[i]``
    rows of expert ``ids[i]`` from row ``first[i]`` (count 0: unused); row r sits in slot
    ``slot_of_row[r] // block_m`` at position ``slot_of_row[r] % block_m`` (-1: past the groups).

    Examples:
      >>> import jax.numpy as jnp
      >>> from jquant.kernels.moe.slots import slot_table
      >>> ids, counts, first, where = slot_table(jnp.array([3, 0, 10]), rows=14, block_m=8)
      >>> ids.tolist(), counts.tolist(), first.tolist()  # expert 2's 10 rows take two slots
      ([0, 2, 2, 0], [3, 8, 2, 0], [0, 3, 11, 0])
      >>> where.tolist()
      [0, 1, 2, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, -1]
    """
    g = jnp.asarray(group_sizes, jnp.int32)
    num_experts = g.shape[0]
    slots = max(1, min(rows, -(-rows // block_m) + num_experts - 1))
    starts = jnp.cumsum(g) - g
    per_expert = -(-g // block_m)
    slot_ends = jnp.cumsum(per_expert)
    slot_starts = slot_ends - per_expert
    s = jnp.arange(slots, dtype=jnp.int32)
    # compare_all, not the default "scan": that is a while loop of log2(E + 1) steps, each a few GPU
    # launches in every layer of a decode step; this is one fusion.
    ids = jnp.minimum(jnp.searchsorted(slot_ends, s, side="right", method="compare_all"),
                      num_experts - 1).astype(jnp.int32)
    local = (s - slot_starts[ids]) * block_m
    counts = jnp.where(s < slot_ends[-1], jnp.clip(g[ids] - local, 0, block_m), 0).astype(jnp.int32)
    first = jnp.where(counts > 0, starts[ids] + local, 0).astype(jnp.int32)
    ids = jnp.where(counts > 0, ids, 0)
    r = jnp.arange(rows, dtype=jnp.int32)
    ends = jnp.cumsum(g)
    e_r = jnp.minimum(jnp.searchsorted(ends, r, side="right", method="compare_all"), num_experts - 1)
    off = r - starts[e_r]
    where = (slot_starts[e_r] + off // block_m) * block_m + off % block_m
    return ids, counts, first, jnp.where(r < ends[-1], where, -1).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class Slots:
    """``slot_table`` of ``rows`` sorted rows as a pytree, with the gathers into and out of the slot
    layout (``block_m`` and ``rows`` static).

    Examples:
      >>> import jax.numpy as jnp
      >>> from jquant.kernels.moe.slots import Slots
      >>> slots = Slots.plan(jnp.array([1, 0, 2]), rows=4, block_m=8)
      >>> x = jnp.arange(4.0)[:, None] + 1   # row 3 is past the groups
      >>> xs = slots.take(x)
      >>> xs.shape, xs[:, 0].reshape(3, 8)[:, :2].tolist()   # 3 slots: expert 0's row, expert 2's rows, none
      ((24, 1), [[1.0, 0.0], [2.0, 3.0], [0.0, 0.0]])
      >>> slots.rows(xs)[:, 0].tolist(), slots.row_experts().reshape(3, 8)[:, 0].tolist(), slots.counts.tolist()
      ([1.0, 2.0, 3.0, 0.0], [0, 2, 0], [1, 2, 0])
    """

    ids: jax.Array      # [S] expert of each slot (0 where unused)
    counts: jax.Array   # [S] live rows of each slot
    first: jax.Array    # [S] the sorted row of each slot's first row
    where: jax.Array    # [rows] each sorted row's place in the slot layout, -1 past the groups
    block_m: int
    num_rows: int

    @classmethod
    def plan(cls, group_sizes: jax.Array, rows: int, block_m: int) -> "Slots":
        return cls(*slot_table(group_sizes, rows, block_m), block_m=block_m, num_rows=rows)

    @property
    def size(self) -> int:
        """Rows of the slot layout, ``S · block_m``."""
        return self.ids.shape[0] * self.block_m

    def live(self) -> jax.Array:
        """``[S · block_m]`` bool: the slot rows that hold a sorted row."""
        return (jnp.arange(self.block_m)[None, :] < self.counts[:, None]).reshape(-1)

    def row_experts(self) -> jax.Array:
        """``[S · block_m]`` int32: the expert of each slot row."""
        return jnp.repeat(self.ids, self.block_m, total_repeat_length=self.size)

    def take(self, x: jax.Array) -> jax.Array:
        """Sorted rows ``x [rows, ...]`` → ``[S · block_m, ...]``, zero past each slot's count."""
        if x.shape[0] != self.num_rows:
            raise ValueError(f"Slots.take: x has {x.shape[0]} rows, the slots were planned for {self.num_rows}")
        take = self.first[:, None] + jnp.arange(self.block_m, dtype=jnp.int32)[None, :]
        rows = x[jnp.clip(take.reshape(-1), 0, self.num_rows - 1)]
        live = self.live().reshape((-1,) + (1,) * (x.ndim - 1))
        return jnp.where(live, rows, jnp.zeros((), x.dtype))

    def rows(self, y: jax.Array) -> jax.Array:
        """Slot layout ``y [S · block_m, ...]`` → sorted rows ``[rows, ...]``, zero past the groups."""
        out = y[jnp.maximum(self.where, 0)]
        past = (self.where < 0).reshape((-1,) + (1,) * (y.ndim - 1))
        return jnp.where(past, jnp.zeros((), y.dtype), out)


jax.tree_util.register_dataclass(Slots, data_fields=["ids", "counts", "first", "where"],
                                 meta_fields=["block_m", "num_rows"])


def chains(first, second, rows: int) -> bool:
    """Whether two expert GEMMs (gate/up, then down) can run back to back in one slot layout: both run
    over slots (``slot_rows``), of the same height for ``rows`` sorted rows, and neither quantizes its
    activations with a scale over all rows (``rows_independent``: the slot layout leaves out rows
    past the groups, which a per-tensor scale would count).

    Examples:
      >>> from jquant.kernels.moe.slots import chains
      >>> chains(object(), object(), 8)   # the XLA reference: no slots
      False
    """
    heights = [getattr(e, "slot_rows", lambda rows: None)(rows) for e in (first, second)]
    return (heights[0] is not None and heights[0] == heights[1]
            and all(getattr(e, "rows_independent", False) for e in (first, second)))


@dataclasses.dataclass(frozen=True)
class SeparateGemms:
    """Experts run by their own ``apply`` only, so ``MoE`` runs each grouped GEMM with its own gathers
    into slots and back (``chains`` is False for them): the layer without one slot layout, as
    ``jquant bench moe`` times it beside the layer with one.

    Examples:
      >>> import numpy as np
      >>> from jquant.kernels.moe import QExperts, W4A16Experts, quantize_expert_weights
      >>> from jquant.kernels.moe.slots import SeparateGemms, chains
      >>> from jquant.schemes.scheme import get_scheme
      >>> q = QExperts(quantize_expert_weights(np.ones((2, 128, 64), np.float32), "mxfp4"), get_scheme("mxfp4"))
      >>> fast = W4A16Experts.from_qexperts(q, interpret=True)
      >>> chains(fast, fast, 8), chains(SeparateGemms(fast), SeparateGemms(fast), 8), SeparateGemms(fast).shape
      (True, False, (2, 128, 64))
    """

    experts: object

    @property
    def shape(self) -> tuple[int, ...]:
        return self.experts.shape

    def apply(self, x: jax.Array, group_sizes: jax.Array, *, impl: str = "auto") -> jax.Array:
        return self.experts.apply(x, group_sizes, impl=impl)


jax.tree_util.register_dataclass(SeparateGemms, data_fields=["experts"], meta_fields=[])
