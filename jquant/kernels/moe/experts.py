"""Stacked expert weights: one QTensor ``[E, N, K]`` per projection of a MoE layer.

A stack is an ordinary QTensor with a leading expert axis: each expert is a PyTorch-oriented
``[N, K]`` weight quantized along K (``k_axis == 2``), blocks of ``(1, 1, g)`` for groups along K,
``(1, bh, bw)`` for 2-D tiles (block FP8), ``(blocksize,)`` over the flattened stack for
bitsandbytes. Formats whose blocks stay inside one expert (int4 / uint4 groups, MXFP4, NF4 without
double quantization, block FP8, per-channel int8 / FP8) give every expert exactly the codes and
scales quantizing it alone gives. Per-tensor statistics are per expert too, as ModelOpt's NVFP4 MoE
checkpoints store them (one ``weight_scale_2`` per expert and projection) and vLLM's fused MoE reads
them (``w2_weight_scale_2 [E]``; per-tensor FP8 ``w2_weight_scale [E]`` likewise): NVFP4's global
scale is a ``[E, 1, 1]`` leaf (it broadcasts against the block scales ``[E, N, K/16]`` as any
per-block leaf does), per-tensor FP8 has blocks ``(1, N, K)`` and a scale ``[E, 1, 1]``, and each
expert again holds what quantizing it alone gives. Only bitsandbytes double quantization's absmax
offset stays one per stack.

``QExperts`` pairs a stack with the scheme it was quantized under, as ``QParam`` does for a Dense
kernel (a sibling, not a QParam: ``prepare_params`` and ``Scheme.apply`` take 2-D weights only).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp

from jquant.formats import quantize
from jquant.qtensor import QTensor
from jquant.schemes.scheme import Scheme, get_scheme

# The float parameters of a MoE layer (``jquant.models.moe``) that hold expert stacks ``[E, N, K]``.
EXPERT_PARAMS = ("gate_up_proj", "down_proj")


def is_expert_stack(path: str, leaf: Any) -> bool:
    """True for a float ``[E, N, K]`` leaf named (last path component) one of ``EXPERT_PARAMS``: what
    ``quantize_params`` and ``quantize_experts`` may turn into ``QExperts``."""
    dtype = getattr(leaf, "dtype", None)
    return (path.split("/")[-1] in EXPERT_PARAMS and getattr(leaf, "ndim", None) == 3 and dtype is not None
            and jnp.issubdtype(dtype, jnp.floating))


def _quantize_each_expert(w: jax.Array, scheme: Scheme) -> QTensor:
    """Every expert quantized alone, stacked: a per-expert scalar leaf becomes ``[E, 1, 1]``.

    ``lax.map``, not ``vmap``: batching turns the formats' exact divisions by a broadcast constant into
    reciprocal multiplies (an ulp off), while a loop body is the single-expert program itself. The loop
    also holds one expert's intermediates at a time: quantizing a DeepSeek-V3 gate/up stack (7.5G
    values) whole needs tens of GB of temporaries."""
    one = jax.lax.map(lambda we: quantize(we, scheme.weight.format, axis=1, **scheme.weight.quantize_kwargs()), w)
    e = w.shape[0]

    def lift(leaf):
        return None if leaf is None else leaf.reshape(e, 1, 1) if leaf.ndim == 1 else leaf

    return QTensor(data=one.data, scale=lift(one.scale), zero=lift(one.zero), global_scale=lift(one.global_scale),
                   fmt=one.fmt, shape=(e,) + one.shape, dtype=one.dtype, block=(1,) + one.block,
                   pack_axis=None if one.pack_axis is None else one.pack_axis + 1, options=one.options, k_axis=2)


def quantize_expert_weights(w: Any, scheme: str | Scheme, *, name: str = "w") -> QTensor:
    """Quantizes float expert weights ``w [E, N, K]`` under ``scheme`` along K; returns a stacked
    QTensor of shape ``[E, N, K]`` with ``k_axis == 2`` (``dequantize()`` gives ``[E, N, K]``).

    Each expert is quantized as it would be alone, one at a time (``lax.map``; so a stack of any size
    needs one expert's temporaries), except for bitsandbytes formats, whose blocks run over the
    flattened stack. ``name`` is the parameter named in errors.

    Examples:
      >>> import numpy as np
      >>> from jquant.kernels.moe import quantize_expert_weights
      >>> w = np.random.default_rng(0).standard_normal((4, 8, 64)).astype(np.float32)
      >>> qt = quantize_expert_weights(w, "mxfp4")
      >>> qt.fmt, qt.shape, qt.block, qt.k_axis
      ('mxfp4', (4, 8, 64), (1, 1, 32), 2)
      >>> qt.dequantize().shape
      (4, 8, 64)

      NVFP4 keeps one global (per-tensor) scale per expert, ``[E, 1, 1]``:

      >>> w[2] *= 1000.0  # one expert far larger than the others
      >>> qt = quantize_expert_weights(w, "nvfp4")
      >>> qt.global_scale.shape, bool(qt.global_scale[2, 0, 0] < qt.global_scale[0, 0, 0] / 100)
      ((4, 1, 1), True)
    """
    scheme = get_scheme(scheme)
    shape = tuple(getattr(w, "shape", ()))
    dtype = getattr(w, "dtype", None)
    if len(shape) != 3:
        raise ValueError(f"{name} must be stacked expert weights [E, N, K] (3-D), got shape {shape}")
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"{name} must be a floating array [E, N, K], got dtype {dtype}")
    if 0 in shape:
        raise ValueError(f"{name} has an empty axis: shape {shape} (E, N and K must be positive)")
    group = scheme.activation.group_size
    if scheme.activation.mode == "dynamic_per_token_group" and shape[2] % group:
        raise ValueError(f"scheme {scheme.name!r} quantizes activations in groups of {group} along K, but "
                         f"{name} {shape} has K={shape[2]}, not a multiple of {group}")
    try:
        if scheme.weight.family == "bnb":  # blocks of the flattened stack: quantized whole
            qt = quantize(w, scheme.weight.format, axis=2, **scheme.weight.quantize_kwargs())
        else:
            qt = _quantize_each_expert(jnp.asarray(w), scheme)
    except (ValueError, TypeError) as e:
        raise type(e)(f"{name} {shape} cannot be quantized with scheme {scheme.name!r}: {e}") from e
    return qt if qt.k_axis == 2 else qt.replace(k_axis=2)


def check_stack(qt: Any, name: str = "experts", *, pieces: bool = False) -> QTensor:
    """Raises unless ``qt`` is a stacked expert QTensor ``[E, N, K]`` with K (if recorded) on axis 2.

    ``pieces``: the leaves may hold several devices' pieces one after the other along the expert axis
    while the metadata describes one piece (``jquant.parallel``'s ``Sharded``), so a per-expert global
    scale is checked as ``[*, 1, 1]``."""
    if not isinstance(qt, QTensor):
        raise TypeError(f"{name} must be a stacked expert QTensor [E, N, K], got {type(qt).__name__}")
    if qt.ndim != 3:
        raise ValueError(f"{name} must be a stacked expert QTensor [E, N, K] (3-D), got shape {qt.shape}")
    if qt.k_axis not in (None, 2):
        raise ValueError(f"{name} records K on axis {qt.k_axis} of {qt.shape}; stacked experts are [E, N, K] "
                         "with K on axis 2 (quantize with quantize_expert_weights)")
    gs = qt.global_scale
    # Only arrays are checked: a tree of shardings or specs shaped like a stack passes through.
    if hasattr(gs, "shape") and tuple(gs.shape) not in ((), (gs.shape[0] if pieces and gs.ndim == 3 else qt.shape[0], 1, 1)):
        raise ValueError(f"{name} has a global scale of shape {tuple(gs.shape)}; a stack holds one per expert, "
                         f"{(qt.shape[0], 1, 1)} (or one shared, 0-d)")
    return qt


def _blocked_per_axis(qt: QTensor, what: str) -> None:
    if len(qt.block) != qt.ndim:
        raise ValueError(f"{what}: fmt {qt.fmt!r} blocks the flattened tensor (block {qt.block}); quantize "
                         "the [E, N, K] float weights with quantize_expert_weights instead")
    if qt.group_index is not None:
        raise ValueError(f"{what}: act-order group_index is per expert; stacks keep groups in order")


def stack_experts(experts: Sequence[QTensor]) -> QTensor:
    """Stacks per-expert QTensors ``[N, K]`` (same format, shape, blocks, options, scale dtypes) into one
    ``[E, N, K]`` QTensor, exactly: the codes and scales are stacked, not requantized, and per-tensor
    global scales (NVFP4) become the stack's per-expert ``[E, 1, 1]``.

    Examples:
      >>> import jax.numpy as jnp, numpy as np, jquant
      >>> from jquant.kernels.moe import stack_experts
      >>> w = np.random.default_rng(0).standard_normal((3, 8, 32)).astype(np.float32)
      >>> parts = [jquant.quantize(w[e], "int4", group_size=32) for e in range(3)]  # each [N, K]
      >>> stack = stack_experts(parts)
      >>> stack.shape, stack.block, stack.k_axis
      ((3, 8, 32), (1, 1, 32), 2)
      >>> bool(jnp.array_equal(stack.dequantize()[1], parts[1].dequantize()))  # the codes, not requantized
      True
    """
    experts = list(experts)
    if not experts:
        raise ValueError("stack_experts: experts is empty (at least one expert)")
    first = experts[0]
    for e, qt in enumerate(experts):
        if not isinstance(qt, QTensor) or qt.ndim != 2:
            raise ValueError(f"stack_experts: experts[{e}] must be a 2-D QTensor [N, K], got "
                             f"{type(qt).__name__} {getattr(qt, 'shape', '')}")
        _blocked_per_axis(qt, f"stack_experts: experts[{e}]")
        if qt.k_axis not in (None, 1):
            raise ValueError(f"stack_experts: experts[{e}] records K on axis {qt.k_axis}; experts are [N, K]")
        same = (qt.fmt, qt.shape, qt.block, qt.pack_axis, qt.options, qt.dtype)
        want = (first.fmt, first.shape, first.block, first.pack_axis, first.options, first.dtype)
        if same != want or jax.tree.structure(qt) != jax.tree.structure(first):
            raise ValueError(f"stack_experts: experts[{e}] (fmt {qt.fmt!r}, shape {qt.shape}, block {qt.block}) "
                             f"differs from experts[0] (fmt {first.fmt!r}, shape {first.shape}, block {first.block})")
        if isinstance(qt.scale, QTensor):
            raise ValueError(f"stack_experts: experts[{e}] has double-quantized scales; not stackable")
    global_scale = None
    if first.global_scale is not None:
        global_scale = jnp.stack([jnp.asarray(qt.global_scale).reshape(1, 1) for qt in experts])

    def stack(field):
        return None if getattr(first, field) is None else jnp.stack([getattr(qt, field) for qt in experts])

    return QTensor(data=stack("data"), scale=stack("scale"), zero=stack("zero"), global_scale=global_scale,
                   fmt=first.fmt, shape=(len(experts),) + first.shape, dtype=first.dtype,
                   block=(1,) + first.block, pack_axis=None if first.pack_axis is None else first.pack_axis + 1,
                   options=first.options, k_axis=2)


def expert(qt: QTensor, e: int) -> QTensor:
    """Expert ``e`` of a stack as a 2-D QTensor ``[N, K]`` (``k_axis == 1``), sharing its codes and scales.

    Examples:
      >>> import jax.numpy as jnp, numpy as np
      >>> from jquant.kernels.moe import expert, quantize_expert_weights
      >>> w = np.random.default_rng(0).standard_normal((3, 8, 32)).astype(np.float32)
      >>> stack = quantize_expert_weights(w, "int4_g32")
      >>> one = expert(stack, 1)
      >>> one.shape, one.block, one.k_axis
      ((8, 32), (1, 32), 1)
      >>> bool(jnp.array_equal(one.dequantize(), stack.dequantize()[1]))
      True
    """
    check_stack(qt, "qt")
    _blocked_per_axis(qt, "expert")
    if qt.block[0] != 1:
        raise ValueError(f"expert: block {qt.block} spans experts; only per-expert blocks can be sliced")
    if not 0 <= e < qt.shape[0]:
        raise ValueError(f"expert: e={e} is out of range for {qt.shape[0]} experts")

    def take(leaf):
        return None if leaf is None else leaf[e]

    gs = qt.global_scale
    gs = gs if gs is None or gs.ndim == 0 else gs[e].reshape(())
    return QTensor(data=take(qt.data), scale=take(qt.scale), zero=take(qt.zero), global_scale=gs,
                   fmt=qt.fmt, shape=qt.shape[1:], dtype=qt.dtype, block=qt.block[1:],
                   pack_axis=None if qt.pack_axis is None else qt.pack_axis - 1, options=qt.options, k_axis=1)


def unstack_experts(qt: QTensor) -> list[QTensor]:
    """The inverse of ``stack_experts``: one 2-D QTensor ``[N, K]`` per expert.

    Examples:
      >>> import jax.numpy as jnp, numpy as np
      >>> from jquant.kernels.moe import quantize_expert_weights, stack_experts, unstack_experts
      >>> w = np.random.default_rng(0).standard_normal((3, 8, 32)).astype(np.float32)
      >>> stack = quantize_expert_weights(w, "int4_g32")
      >>> parts = unstack_experts(stack)
      >>> len(parts), parts[0].shape, parts[0].k_axis
      (3, (8, 32), 1)
      >>> bool(jnp.array_equal(stack_experts(parts).data, stack.data))  # round trip
      True
    """
    return [expert(qt, e) for e in range(check_stack(qt, "qt").shape[0])]


def _row_blocks(qt: QTensor, what: str) -> int:
    check_stack(qt, what)
    _blocked_per_axis(qt, what)
    if qt.pack_axis == 1:
        raise ValueError(f"{what}: codes packed along N cannot be split by rows")
    if qt.shape[1] % qt.block[1]:
        raise ValueError(f"{what}: N={qt.shape[1]} is not a multiple of the block's {qt.block[1]} rows")
    return qt.block[1]


def concat_rows(parts: Sequence[QTensor]) -> QTensor:
    """Concatenates stacks ``[E, N_i, K]`` along N into ``[E, sum N_i, K]`` (gate and up into the fused
    ``gate_up``), exactly; every part's N must hold whole blocks (128-row tiles for block FP8), and the
    parts' per-expert global scales (NVFP4) must agree. Eager (it compares them).

    Examples:
      Gate and up projections, each ``[E, N, K]``, fused into one ``[E, 2N, K]`` stack:

      >>> import jax.numpy as jnp, numpy as np
      >>> from jquant.kernels.moe import concat_rows, quantize_expert_weights
      >>> rng = np.random.default_rng(0)
      >>> gate, up = (quantize_expert_weights(rng.standard_normal((3, 8, 32)).astype(np.float32), "int4_g32")
      ...             for _ in range(2))
      >>> gate_up = concat_rows([gate, up])
      >>> gate_up.shape
      (3, 16, 32)
      >>> bool(jnp.array_equal(gate_up.dequantize()[:, 8:], up.dequantize()))
      True
    """
    parts = _check_row_parts(parts, "concat_rows")
    first = parts[0]
    for i, part in enumerate(parts):
        if part.global_scale is not None and not bool(jnp.all(part.global_scale == first.global_scale)):
            # One global scale per expert covers all its rows: gate and up must share it (vLLM's fused
            # w13 likewise keeps one, after warning when a ModelOpt checkpoint's two differ).
            differ = jnp.nonzero(jnp.broadcast_to(part.global_scale != first.global_scale,
                                                  (first.shape[0], 1, 1)).reshape(-1))[0]
            raise ValueError(f"concat_rows: parts[{i}] has other per-tensor global scales than parts[0] (experts "
                             f"{differ[:8].tolist()}); the rows of one expert share one global scale")
    return join_rows(parts)


def _check_row_parts(parts: Sequence[QTensor], what: str) -> list[QTensor]:
    parts = list(parts)
    if not parts:
        raise ValueError(f"{what}: parts is empty (at least one stack)")
    first = parts[0]
    for i, part in enumerate(parts):
        _row_blocks(part, f"{what}: parts[{i}]")
        key = lambda q: (q.fmt, q.shape[0], q.shape[2], q.block, q.pack_axis, q.options, q.dtype)
        if key(part) != key(first) or jax.tree.structure(part) != jax.tree.structure(first):
            raise ValueError(f"{what}: parts[{i}] (fmt {part.fmt!r}, shape {part.shape}, block {part.block}) "
                             f"does not match parts[0] (fmt {first.fmt!r}, shape {first.shape}, block {first.block})")
    return parts


def join_rows(parts: Sequence[QTensor]) -> QTensor:
    """``concat_rows`` without comparing the parts' global scales (so it traces, under jit or inside
    ``shard_map``): the stack keeps ``parts[0]``'s, so the caller vouches that they agree, as for pieces
    cut from one stack (``jquant.parallel.moe`` joins a device's gate and up rows so)."""
    parts = _check_row_parts(parts, "join_rows")
    first = parts[0]

    def cat(field):
        return None if getattr(first, field) is None else jnp.concatenate([getattr(p, field) for p in parts], 1)

    return first.replace(data=cat("data"), scale=cat("scale"), zero=cat("zero"),
                         shape=(first.shape[0], sum(p.shape[1] for p in parts), first.shape[2]))


def split_rows(qt: QTensor, sizes: Sequence[int]) -> list[QTensor]:
    """The inverse of ``concat_rows``: ``[E, N, K]`` into stacks of ``sizes`` rows (whole blocks each).

    Examples:
      >>> import jax.numpy as jnp, numpy as np
      >>> from jquant.kernels.moe import quantize_expert_weights, split_rows
      >>> w = np.random.default_rng(0).standard_normal((3, 16, 32)).astype(np.float32)
      >>> gate_up = quantize_expert_weights(w, "int4_g32")
      >>> gate, up = split_rows(gate_up, [8, 8])
      >>> gate.shape, up.shape
      ((3, 8, 32), (3, 8, 32))
      >>> bool(jnp.array_equal(up.dequantize(), gate_up.dequantize()[:, 8:]))
      True
    """
    rows = _row_blocks(qt, "split_rows")
    if sum(sizes) != qt.shape[1] or any(s <= 0 or s % rows for s in sizes):
        raise ValueError(f"split_rows: sizes {list(sizes)} must be positive multiples of {rows} summing to "
                         f"N={qt.shape[1]}")
    out, start = [], 0
    for size in sizes:
        lo, hi = start // rows, (start + size) // rows
        out.append(qt.replace(data=qt.data[:, start:start + size], scale=qt.scale[:, lo:hi],
                              zero=None if qt.zero is None else qt.zero[:, lo:hi],
                              shape=(qt.shape[0], size, qt.shape[2])))
        start += size
    return out


@dataclasses.dataclass(frozen=True)
class QExperts:
    """A stack of expert weights ``[E, N, K]`` quantized under ``scheme`` (static under jit).

    ``apply(x, group_sizes)`` is the grouped product of rows of x sorted by expert with each expert's
    weight (``jquant.kernels.moe.grouped_matmul``); a scheme that quantizes activations (block FP8's
    per-token groups) quantizes x first, as ``Scheme.apply``'s XLA path does.

    Examples:
      >>> import jax.numpy as jnp, numpy as np
      >>> from jquant.kernels.moe import QExperts, grouped_matmul, quantize_expert_weights
      >>> from jquant.schemes.scheme import get_scheme
      >>> rng = np.random.default_rng(0)
      >>> scheme = get_scheme("int4_g32")
      >>> layer = QExperts(quantize_expert_weights(rng.standard_normal((3, 8, 32)).astype(np.float32), scheme),
      ...                  scheme)
      >>> layer.num_experts, layer.shape
      (3, (3, 8, 32))
      >>> x = jnp.asarray(rng.standard_normal((5, 32)), jnp.float32)
      >>> sizes = jnp.array([2, 0, 3], jnp.int32)  # rows per expert, x sorted by expert
      >>> y = layer.apply(x, sizes)
      >>> y.shape, bool(jnp.allclose(y, grouped_matmul(x, layer.weight, sizes)))  # weight-only: no x quantization
      ((5, 8), True)
    """

    weight: QTensor
    scheme: Scheme

    def __post_init__(self):
        check_stack(self.weight, "QExperts.weight", pieces=True)  # a Sharded parameter's pieces: see check_stack
        if not isinstance(self.scheme, Scheme):
            raise TypeError(f"QExperts.scheme must be a Scheme, got {type(self.scheme).__name__}")
        if self.weight.fmt != self.scheme.weight.format:
            raise ValueError(f"QExperts: scheme {self.scheme.name!r} runs {self.scheme.weight.format!r} weights, "
                             f"got a {self.weight.fmt!r} stack")

    @property
    def shape(self) -> tuple[int, ...]:
        return self.weight.shape

    @property
    def num_experts(self) -> int:
        return self.weight.shape[0]

    def apply(self, x: jax.Array, group_sizes: jax.Array, *, impl: str = "auto") -> jax.Array:
        """``x [T, K]`` (rows sorted by expert, ``group_sizes[e]`` rows for expert e) → ``[T, N]``."""
        from jquant.kernels.moe.api import grouped_matmul  # api imports this module
        if self.scheme.weight_only:
            return grouped_matmul(x, self.weight, group_sizes, impl=impl)
        from jquant.schemes.xla import quantize_activation
        xq = quantize_activation(self.scheme, x).dequantize(jnp.float32)
        return grouped_matmul(xq, self.weight, group_sizes, impl=impl).astype(x.dtype)


jax.tree_util.register_dataclass(QExperts, data_fields=["weight"], meta_fields=["scheme"])
