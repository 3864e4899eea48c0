"""The grouped W4A16 GEMM for MoE on Hopper: the Mosaic GPU W4A16 kernel over *expert slots*
(``jquant.kernels.moe.slots``).

Rows of x sorted by expert (``jax.lax.ragged_dot``'s contract) are gathered into slots of ``block_m``
rows, each slot within one expert's group; the W4A16 kernel runs the slot layout as one dense ``x``
whose row tile ``i`` multiplies by expert ``ids[i]``'s weight, scales and bias
(``launch_kernel(slots=...)``: the expert indexes the stacked weight, so only the experts that hold
rows are read, once per slot); empty slots do nothing; each row's result is gathered back. Decode (few
rows per expert) pays a small gather of x, not the weight bytes of idle experts. Prefill, with many rows
per expert, takes slots as wide as an expert's share (``default_block_m``, up to 128 rows), so an
expert's weight is read once per slot of up to 128 rows; a kernel that streams its groups would read it
once.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jquant.kernels.moe.experts import check_stack, concat_rows, expert, split_rows
from jquant.kernels.moe.slots import Slots
from jquant.kernels.w4a16.config import MgpuConfig, default_mgpu_config
from jquant.kernels.w4a16.from_qtensor import prepack_for_kernels, unified_w4
from jquant.kernels.w4a16.layout import PackedW4NK
from jquant.qtensor import QTensor


def prepack_experts(experts: QTensor) -> PackedW4NK:
    """A stacked 4-bit expert QTensor ``[E, N, K]`` laid out for the W4A16 kernel, each expert as
    ``prepack_nk`` lays out a 2-D weight, stacked: ``data`` ``[E, N_pad, K_pad]``, scales ``[E, K_pad /
    G, N_pad]``, per-expert global scales ``[E, 1]``.

    Examples:
      >>> import numpy as np
      >>> from jquant.kernels.moe import quantize_expert_weights
      >>> from jquant.kernels.moe.grouped_w4a16 import prepack_experts
      >>> stack = quantize_expert_weights(np.ones((3, 8, 64), np.float32), "int4_g32")
      >>> packed = prepack_experts(stack)
      >>> packed.data.shape, packed.scale.shape, packed.n, packed.k
      ((3, 128, 64), (3, 2, 128), 8, 64)
    """
    def pack(one):
        args = unified_w4(one)
        packed = None if args is None else prepack_for_kernels(args)
        if packed is not None and packed.perm is not None:   # act-order would permute x's columns per expert
            raise ValueError("prepack_experts: act-order (g_idx) experts are not supported")
        return packed

    return pack_each_expert(experts, pack, "prepack_experts", "W4A16 kernel layout (4-bit codes in groups of "
                            "16, 32 or 64·j along K, or per channel)")


def pack_each_expert(experts: QTensor, pack, who: str, layout: str):
    """``pack`` (a 2-D ``[N, K]`` QTensor → a kernel layout, or None) of every expert of a stack, the
    layouts' arrays stacked along a new leading axis; a ValueError from ``who`` naming ``layout`` where
    ``pack`` gives None."""
    check_stack(experts, "experts")
    parts = [pack(expert(experts, e)) for e in range(experts.shape[0])]
    if any(part is None for part in parts):
        raise ValueError(f"{who}: {experts.fmt} experts of shape {experts.shape} and block {experts.block} have "
                         f"no {layout}")
    return jax.tree_util.tree_map(lambda *leaves: jnp.stack(leaves), *parts)


def default_block_m(rows: int, num_experts: int) -> int:
    """Rows per slot for ``rows`` sorted rows over ``num_experts``: the power of two (8 to 128) that
    holds an expert's share under even routing. Decode (≤ 8 rows an expert) keeps 8-row slots, the
    launch timed on the H200; prefill takes wider slots, because every slot reads its expert's whole
    weight: gpt-oss-20b at 4096 tokens (512 rows an expert) made 2079 slots of 8 rows, ~26 GB of
    weight reads, and took 13.2 ms on the H200 (bench/results/h200/moe.md); 128-row slots make 159.

    Examples:
      >>> from jquant.kernels.moe.grouped_w4a16 import default_block_m
      >>> default_block_m(4, 32), default_block_m(256, 32), default_block_m(2048, 32), default_block_m(16384, 32)
      (8, 8, 64, 128)
    """
    per_expert = -(-rows // max(num_experts, 1))
    block_m = 8
    while block_m < min(per_expert, 128):
        block_m *= 2
    return block_m


def default_grouped_config(block_m: int, packed: PackedW4NK, *, activation: bool = False) -> MgpuConfig:
    """The dense kernel's launch for ``block_m`` rows (``default_mgpu_config``), one compute
    warpgroup (the slot's row tile is the CTA's whole x); ``activation``: 128-row tiles, a gate half
    and an up half (``gate_up_tiles``)."""
    cfg = default_mgpu_config(block_m, packed)
    if cfg.compute_wgs > 1:
        cfg = dataclasses.replace(cfg, block_n=128, block_k=128, compute_wgs=1, max_concurrent_steps=3)
    if activation:
        cfg = dataclasses.replace(cfg, block_n=GATE_UP_TILE * 2)
    return dataclasses.replace(cfg, block_m=block_m)


GATE_UP_TILE = 64   # gate (then up) rows of one 128-row output tile: a tile of wgmma's accumulator layout


def gate_up_order(n: int) -> np.ndarray:
    """Rows of a gate/up stack (``[E, 2I, K]``: gate rows, then up rows) in ``gate_up_tiles`` order:
    stored row r is original row ``order[r]``, so every 128-row tile holds 64 gate features and the
    up features of the same 64 outputs.

    Examples:
      >>> from jquant.kernels.moe.grouped_w4a16 import gate_up_order
      >>> order = gate_up_order(256)   # I = 128: tiles (gate 0-63, up 0-63), (gate 64-127, up 64-127)
      >>> order[:2].tolist(), order[62:66].tolist(), order[128:130].tolist()
      ([0, 1], [62, 63, 128, 129], [64, 65])
    """
    if n % (2 * GATE_UP_TILE):
        raise ValueError(f"gate_up_order: a gate/up pair of {n} rows is not whole tiles of {2 * GATE_UP_TILE} "
                         f"(gate and up each a multiple of {GATE_UP_TILE})")
    i = n // 2
    tiles = np.arange(i // GATE_UP_TILE)[:, None] * GATE_UP_TILE + np.arange(GATE_UP_TILE)[None, :]
    return np.concatenate([tiles, tiles + i], axis=1).reshape(-1)


def gate_up_tiles(stack: QTensor) -> QTensor:
    """A gate/up expert stack ``[E, 2I, K]`` with its rows in ``gate_up_order`` (exact: whole rows move).

    Examples:
      >>> import jax.numpy as jnp, numpy as np
      >>> from jquant.kernels.moe import quantize_expert_weights
      >>> from jquant.kernels.moe.grouped_w4a16 import gate_up_order, gate_up_tiles
      >>> stack = quantize_expert_weights(np.random.default_rng(0).standard_normal((2, 256, 64)).astype(np.float32),
      ...                                 "mxfp4")
      >>> bool(jnp.array_equal(gate_up_tiles(stack).dequantize(), stack.dequantize()[:, gate_up_order(256)]))
      True
    """
    order = gate_up_order(stack.shape[1])
    parts = split_rows(stack, [GATE_UP_TILE] * (stack.shape[1] // GATE_UP_TILE))
    return concat_rows([parts[r // GATE_UP_TILE] for r in order[::GATE_UP_TILE]])


def grouped_w4a16(x: jax.Array, packed: PackedW4NK, group_sizes: jax.Array, *, bias=None,
                  block_m: int | None = None, config: MgpuConfig | None = None,
                  interpret: bool = False) -> jax.Array:
    """``y [T, N]``, ``y[t] = W[e] @ x[t] (+ bias[e])`` for the rows of expert e (x sorted by expert, bf16
    or fp16), with the W4A16 kernel over expert slots of ``block_m`` rows (None: ``default_block_m``);
    rows past the groups are 0.

    Examples:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> from jquant.kernels.moe import quantize_expert_weights
      >>> from jquant.kernels.moe.grouped_w4a16 import grouped_w4a16, prepack_experts
      >>> rng = np.random.default_rng(0)
      >>> stack = quantize_expert_weights(rng.standard_normal((3, 8, 64)).astype(np.float32), "int4_g32")
      >>> x = jnp.asarray(rng.standard_normal((5, 64)), jnp.bfloat16)
      >>> sizes = jnp.array([2, 0, 3], jnp.int32)
      >>> y = grouped_w4a16(x, prepack_experts(stack), sizes, interpret=True)
      >>> ref = jax.lax.ragged_dot(x.astype(jnp.float32), jnp.swapaxes(stack.dequantize(), 1, 2), sizes)
      >>> y.shape, bool(jnp.allclose(y.astype(jnp.float32), ref, rtol=2e-2, atol=5e-2))
      ((5, 8), True)
    """
    if x.dtype not in (jnp.bfloat16, jnp.float16) or x.ndim != 2 or x.shape[1] != packed.k:
        raise ValueError(f"grouped_w4a16: x must be bf16 or fp16 rows [T, K={packed.k}], got {x.dtype} "
                         f"{tuple(x.shape)}")
    if block_m is None:
        block_m = default_block_m(x.shape[0], packed.data.shape[0])
    if block_m % 8 or not 8 <= block_m <= 128:
        raise ValueError(f"grouped_w4a16: block_m must be a multiple of 8 in [8, 128], got {block_m}")
    slots = Slots.plan(group_sizes, x.shape[0], block_m)
    return slots.rows(grouped_w4a16_slots(slots.take(x), packed, slots, bias=bias, config=config,
                                          interpret=interpret))


def grouped_w4a16_slots(xs: jax.Array, packed: PackedW4NK, slots: Slots, *, bias=None,
                        config: MgpuConfig | None = None, interpret: bool = False,
                        activation: str | None = None) -> jax.Array:
    """``grouped_w4a16`` in the slot layout: ``xs [S · block_m, K]`` (``slots.take`` of the sorted rows)
    → ``[S · block_m, N]``, slot i's rows times expert ``slots.ids[i]``'s weight (+ bias); rows past a
    slot's count are the product of whatever they hold (zero rows give the bias). ``activation``:
    ``packed`` is a gate/up pair in ``gate_up_tiles`` order and the result is ``activation(gate, up)``
    ``[S · block_m, N / 2]``, applied by the kernel's epilogue (``store_final_output``).

    Examples:
      >>> import jax.numpy as jnp, numpy as np
      >>> from jquant.kernels.moe import quantize_expert_weights
      >>> from jquant.kernels.moe.grouped_w4a16 import grouped_w4a16, grouped_w4a16_slots, prepack_experts
      >>> from jquant.kernels.moe.slots import Slots
      >>> rng = np.random.default_rng(0)
      >>> packed = prepack_experts(quantize_expert_weights(rng.standard_normal((3, 8, 64)).astype(np.float32),
      ...                                                  "int4_g32"))
      >>> x, sizes = jnp.asarray(rng.standard_normal((5, 64)), jnp.bfloat16), jnp.array([2, 0, 3], jnp.int32)
      >>> slots = Slots.plan(sizes, rows=5, block_m=8)
      >>> ys = grouped_w4a16_slots(slots.take(x), packed, slots, interpret=True)
      >>> ys.shape, bool((slots.rows(ys) == grouped_w4a16(x, packed, sizes, interpret=True)).all())
      ((24, 8), True)
    """
    from jquant.kernels.w4a16.mosaic_gpu import w4a16_mgpu   # Mosaic GPU loads only where it runs

    if xs.dtype not in (jnp.bfloat16, jnp.float16) or xs.shape != (slots.size, packed.k):
        raise ValueError(f"grouped_w4a16_slots: xs must be bf16 or fp16 slot rows [{slots.size}, K={packed.k}], "
                         f"got {xs.dtype} {tuple(xs.shape)}")
    k_cols = packed.k if packed.k % 64 == 0 else packed.k_pad
    if k_cols != xs.shape[1]:
        xs = jnp.pad(xs, ((0, 0), (0, k_cols - xs.shape[1])))
    cfg = config or default_grouped_config(slots.block_m, packed, activation=activation is not None)
    if not cfg.final_output:
        raise ValueError("grouped_w4a16 runs the kernel's own final output (MgpuConfig.final_output)")
    if cfg.block_m != slots.block_m:
        raise ValueError(f"grouped_w4a16: the launch's block_m={cfg.block_m} is not the slots' {slots.block_m}")
    if bias is not None:
        bias = jnp.asarray(bias)
        if not jnp.issubdtype(bias.dtype, jnp.floating):
            bias = bias.astype(jnp.float32)
    y = w4a16_mgpu(xs, packed, config=cfg, bias=bias, interpret=interpret, slots=(slots.ids, slots.counts),
                   activation=activation)
    return y[:, :packed.n // 2] if activation else y[:, :packed.n]


@dataclasses.dataclass(frozen=True)
class W4A16Experts:
    """4-bit experts laid out for the grouped W4A16 kernel (``prepack_experts``), run by ``MoE`` as it runs
    ``QExperts``: ``apply(x, group_sizes)`` is ``grouped_w4a16`` (``interpret``: Pallas interpret mode, any
    device).

    Examples:
      >>> import jax.numpy as jnp, numpy as np
      >>> from jquant.kernels.moe import QExperts, quantize_expert_weights
      >>> from jquant.kernels.moe.grouped_w4a16 import W4A16Experts
      >>> from jquant.schemes.scheme import get_scheme
      >>> rng = np.random.default_rng(0)
      >>> q = QExperts(quantize_expert_weights(rng.standard_normal((3, 8, 64)).astype(np.float32), "mxfp4"),
      ...              get_scheme("mxfp4"))
      >>> fast = W4A16Experts.from_qexperts(q, interpret=True)
      >>> x, sizes = jnp.asarray(rng.standard_normal((4, 64)), jnp.bfloat16), jnp.array([1, 3, 0], jnp.int32)
      >>> y = fast.apply(x, sizes)
      >>> y.shape, bool(jnp.allclose(y.astype(jnp.float32), q.apply(x, sizes).astype(jnp.float32), rtol=2e-2, atol=0.1))
      ((4, 8), True)
    """

    packed: PackedW4NK
    shape: tuple[int, int, int]
    interpret: bool = False
    gate_up: bool = False    # rows in gate_up_order: the kernel can apply the activation (apply_activated)
    rows_independent = True   # weight-only: a row's product never depends on another row

    @classmethod
    def from_qexperts(cls, experts, interpret: bool = False, gate_up: bool = False) -> "W4A16Experts":
        """``gate_up``: ``experts`` is a MoE gate/up pair (gate rows, then up rows), laid out in
        ``gate_up_tiles`` so that ``apply_activated`` can run the activation in the kernel."""
        weight = gate_up_tiles(experts.weight) if gate_up else experts.weight
        return cls(prepack_experts(weight), tuple(experts.shape), interpret, gate_up)

    def _in_order(self, y: jax.Array) -> jax.Array:
        """The product's columns in the stack's own row order."""
        return y[:, np.argsort(gate_up_order(self.shape[1]))] if self.gate_up else y

    def apply(self, x: jax.Array, group_sizes: jax.Array, *, impl: str = "auto") -> jax.Array:
        del impl
        return self._in_order(grouped_w4a16(x, self.packed, group_sizes, interpret=self.interpret))

    def slot_rows(self, rows: int) -> int:
        """The slot height ``apply`` takes for ``rows`` sorted rows."""
        return default_block_m(rows, self.shape[0])

    def apply_slots(self, xs: jax.Array, slots: Slots) -> jax.Array:
        """``apply`` in the slot layout (``grouped_w4a16_slots``)."""
        return self._in_order(grouped_w4a16_slots(xs, self.packed, slots, interpret=self.interpret))

    def apply_activated(self, xs: jax.Array, slots: Slots, activation: str, bias=None) -> jax.Array:
        """``activate(activation, gate, up)`` of the gate/up product in the slot layout, ``[S · block_m, I]``,
        with ``bias [E, 2I]`` (the stack's own row order) added in float32 to the product rounded to x's
        dtype, as ``MoE`` does; the kernel's epilogue applies it (``gate_up`` stacks only)."""
        if not self.gate_up:
            raise ValueError("W4A16Experts.apply_activated needs a gate/up stack (from_qexperts(..., gate_up=True))")
        if bias is not None:
            bias = jnp.asarray(bias, jnp.float32)[:, gate_up_order(self.shape[1])]
        return grouped_w4a16_slots(xs, self.packed, slots, bias=bias, interpret=self.interpret,
                                   activation=activation)


jax.tree_util.register_dataclass(W4A16Experts, data_fields=["packed"], meta_fields=["shape", "interpret", "gate_up"])
