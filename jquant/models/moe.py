"""A mixture-of-experts feed-forward layer (Flax linen) over stacked, optionally quantized, experts.

Parameters (PyTorch orientation, as checkpoints and stacked QTensors ``[E, N, K]`` hold them):

=============================  ================  ==========================================================
name                           shape             what
=============================  ================  ==========================================================
``router_weight``              ``[E, H]``        router logits ``x @ router_weightᵀ`` (float32)
``router_bias``                ``[E]``           with ``router_bias=True`` (gpt-oss)
``e_score_correction_bias``    ``[E]``           with ``scoring="sigmoid"`` (DeepSeek-V3); selection only
``gate_up_proj``               ``[E, 2I, H]``    rows ``[0, I)`` gate, ``[I, 2I)`` up (halves, not
                                                 gpt-oss's interleave, which the loader undoes)
``gate_up_bias``               ``[E, 2I]``       with ``expert_bias=True`` (gpt-oss)
``down_proj``                  ``[E, H, I]``
``down_bias``                  ``[E, H]``        with ``expert_bias=True``
``shared_expert/...``          Dense kernels     with ``shared_expert=True``: ``gate_proj``, ``up_proj``,
                                                 ``down_proj`` (SiLU SwiGLU, as DeepSeek-V3's)
=============================  ================  ==========================================================

Expert weights may be float arrays or ``QExperts`` (``quantize_experts``, ``quantize_params``,
``expert_params``); both run through ``grouped_matmul``, so float parameters compute the dense
reference and quantized ones the same product with the dequantized weights. (Any other ``[E, N, K]``
object with QExperts' ``apply(rows, group_sizes, impl=)`` runs its own grouped GEMM: how
``jquant bench moe`` times a foreign kernel inside the same layer.) The router and the biases stay float. The shared
expert's Dense kernels are ordinary ``quantize_params`` candidates (run through ``quantized_apply``).

Activations (``activation``): ``"swiglu"`` = ``silu(gate) · up``; ``"gptoss_swiglu"`` (gpt-oss
reference fact 2: transformers' ``GptOssExperts``, alpha 1.702, limit 7.0): gate clamped to
``<= limit``, up to ``[-limit, limit]``, ``(up + 1) · gate · sigmoid(alpha · gate)``. Both run in
float32 with the gate/up bias added there, and are rounded to the computation dtype once (as vLLM's
``swigluoai_and_mul`` kernel); the shared expert's SwiGLU too.
"""

from __future__ import annotations

import re
from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from jquant.checkpoint.experts import ExpertWeights
from jquant.checkpoint.writer import path_str
from jquant.kernels.moe.activations import ACTIVATIONS, activate
from jquant.kernels.moe.api import grouped_matmul
from jquant.kernels.moe.experts import QExperts, concat_rows, is_expert_stack, quantize_expert_weights
from jquant.kernels.moe.routing import (Dispatch, Routing, check_routing, combine, gather_rows, route,
                                        sort_by_expert, sort_local_experts)
from jquant.kernels.moe.slots import Slots, chains
from jquant.schemes.scheme import Scheme, get_scheme

# The scheme a loaded stack runs under, by format (gpt-oss MXFP4, DeepSeek-V3 block FP8).
LOADED_SCHEMES = {"mxfp4": "mxfp4", "fp8_e4m3": "fp8_e4m3_block128x128"}


class SharedExpert(nn.Module):
    """A dense SiLU SwiGLU MLP every token goes through (DeepSeek-V3's shared experts)."""

    hidden: int
    intermediate: int
    dtype: Any = None
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        dense = lambda n, name: nn.Dense(n, use_bias=False, dtype=self.dtype, param_dtype=self.param_dtype, name=name)
        return dense(self.hidden, "down_proj")(activate("swiglu", dense(self.intermediate, "gate_proj")(x),
                                                        dense(self.intermediate, "up_proj")(x)))


class MoE(nn.Module):
    """Routed experts (and optionally a shared one) over ``x [..., H]``; see the module docstring.

    ``scoring``, ``n_group``, ``topk_group``, ``group_score``, ``normalize_weights`` and
    ``routed_scaling_factor`` are ``jquant.kernels.moe.route``'s options. ``dtype``: the computation
    dtype (None: x's); routing runs in float32. ``impl``: the grouped GEMM's (``grouped_matmul``).

    ``expert_axis``: inside ``jax.shard_map``, the mesh axis the experts are split over (expert
    parallelism, ``jquant.parallel.moe``): the expert stacks and biases hold device i's
    ``num_experts / n`` experts ``[i·E/n, (i+1)·E/n)`` of the axis's n devices, routing still chooses among
    all E, and the output is this device's part of the sum (its experts' pairs, weighted), which the
    caller sums over the axis.
    """

    num_experts: int
    top_k: int
    hidden: int
    intermediate: int
    scoring: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    group_score: str = "auto"
    normalize_weights: bool = True
    routed_scaling_factor: float = 1.0
    router_bias: bool = False
    expert_bias: bool = False
    shared_expert: bool = False
    shared_intermediate: int | None = None
    activation: str = "swiglu"
    dtype: Any = None
    param_dtype: Any = jnp.float32
    impl: str = "auto"
    expert_axis: str | None = None

    def _param(self, name: str, shape: tuple[int, ...], init, what: str, dtype=None):
        """A parameter that may hold a QExperts (read as stored) or a float array, shape-checked;
        created in ``dtype`` (default ``param_dtype``)."""
        if self.is_initializing() and not self.has_variable("params", name):
            return self.param(name, init, shape, dtype or self.param_dtype)
        if not self.has_variable("params", name):
            raise ValueError(f"MoE parameter {name!r} is missing (expected {what} of shape {shape})")
        value = self.get_variable("params", name)
        got = tuple(getattr(value, "shape", ()))
        if got != shape:
            raise ValueError(f"MoE parameter {name!r} has shape {got}, expected {what} = {shape} (num_experts="
                             f"{self.num_experts}, intermediate={self.intermediate}, hidden={self.hidden})")
        return value

    def _correction_bias(self, e: int):
        """DeepSeek's ``e_score_correction_bias`` (sigmoid scoring only), created in float32, the dtype
        DeepSeek's checkpoints and reference keep it in: it shifts float32 selection scores."""
        if self.scoring != "sigmoid":
            return None
        return self._param("e_score_correction_bias", (e,), nn.initializers.zeros, "[E]", jnp.float32)

    def _route(self, x2, router_weight, router_bias, correction) -> Routing:
        # HIGHEST: at the default a GPU runs float32 dots at TF32, ~1e-3 off in the logits
        logits = jnp.matmul(x2.astype(jnp.float32), jnp.asarray(router_weight, jnp.float32).T,
                            precision=jax.lax.Precision.HIGHEST)
        if router_bias is not None:
            logits = logits + jnp.asarray(router_bias, jnp.float32)
        return route(logits, self.top_k, scoring=self.scoring, correction_bias=correction, n_group=self.n_group,
                     topk_group=self.topk_group, group_score=self.group_score, normalize=self.normalize_weights,
                     routed_scaling_factor=self.routed_scaling_factor)

    def routing(self, x: jax.Array) -> Routing:
        """The experts the tokens of ``x [..., H]`` go to and their weights (``Routing`` over the flattened
        tokens), as ``__call__`` routes them: ``model.apply(variables, x, method=MoE.routing)``."""
        e, h = self.num_experts, self.hidden
        zeros = nn.initializers.zeros
        router_weight = self._param("router_weight", (e, h), nn.initializers.lecun_normal(), "[E, H]")
        router_bias = self._param("router_bias", (e,), zeros, "[E]") if self.router_bias else None
        correction = self._correction_bias(e)
        return self._route(x.reshape(-1, h), router_weight, router_bias, correction)

    def _project(self, weight, rows: jax.Array, group_sizes: jax.Array) -> jax.Array:
        # QExperts, or any stack with QExperts' ``apply`` (a benchmark's foreign grouped GEMM).
        if isinstance(weight, QExperts) or callable(getattr(weight, "apply", None)):
            return weight.apply(rows, group_sizes, impl=self.impl).astype(rows.dtype)
        return grouped_matmul(rows, jnp.asarray(weight, rows.dtype), group_sizes, impl=self.impl)

    def _hidden(self, gate_up: jax.Array, bias, dtype) -> jax.Array:
        """The activation of the gate/up product ``[rows, 2I]``, with its rows' bias (float32, or None) added
        in float32 too, so the activation rounds the sum once."""
        if bias is not None:
            gate_up = gate_up.astype(jnp.float32) + bias
        i = self.intermediate
        return activate(self.activation, gate_up[:, :i], gate_up[:, i:]).astype(dtype)

    def _experts_in_slots(self, gate_up_w, down_w, gate_up_b, rows, dispatch: Dispatch, dtype) -> jax.Array:
        """Both expert GEMMs over one slot layout (``slots.chains``): the rows gathered into slots once, the
        gate/up bias and the activation applied there, the down projection reading the activated slots
        and its result gathered back once; what the two separate grouped GEMMs give, bit for bit (a row's
        product depends on that row alone, and the slots' spare rows are zeroed before the down
        projection as the separate path's gather leaves them)."""
        slots = Slots.plan(dispatch.group_sizes, rows.shape[0], gate_up_w.slot_rows(rows.shape[0]))
        xs = slots.take(rows)
        if getattr(gate_up_w, "gate_up", False):   # the kernel's epilogue applies bias and activation
            hidden = gate_up_w.apply_activated(xs, slots, self.activation, gate_up_b).astype(dtype)
        else:
            # Another device's rows (expert parallelism) sit in no slot; a slot's expert is a local one.
            bias = (None if gate_up_b is None else
                    jnp.take(jnp.asarray(gate_up_b, jnp.float32), slots.row_experts(), axis=0))
            hidden = self._hidden(gate_up_w.apply_slots(xs, slots), bias, dtype)
        hidden = jnp.where(slots.live()[:, None], hidden, jnp.zeros((), dtype))
        return slots.rows(down_w.apply_slots(hidden, slots).astype(dtype))

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        e, i, h = self.num_experts, self.intermediate, self.hidden
        check_routing(e, self.top_k, scoring=self.scoring, n_group=self.n_group, topk_group=self.topk_group,
                      group_score=self.group_score)
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        if x.shape[-1] != h:
            raise ValueError(f"MoE: x has shape {tuple(x.shape)}, but hidden={h} (the last axis of x)")
        local_e = e
        if self.expert_axis is not None:
            devices = jax.lax.axis_size(self.expert_axis)
            if e % devices:
                raise ValueError(f"MoE: num_experts={e} does not split over the {devices} devices of axis "
                                 f"{self.expert_axis!r}")
            local_e = e // devices
        dtype = self.dtype or x.dtype
        lead = x.shape[:-1]
        x2 = x.reshape(-1, h)
        experts_init = nn.initializers.lecun_normal(in_axis=-1, out_axis=-2, batch_axis=(0,))
        zeros = nn.initializers.zeros

        # Every parameter is read (and shape-checked) before any computation.
        router_weight = self._param("router_weight", (e, h), nn.initializers.lecun_normal(), "[E, H]")
        router_bias = self._param("router_bias", (e,), zeros, "[E]") if self.router_bias else None
        correction = self._correction_bias(e)
        gate_up_w = self._param("gate_up_proj", (local_e, 2 * i, h), experts_init, "[E, 2I, H]")
        down_w = self._param("down_proj", (local_e, h, i), experts_init, "[E, H, I]")
        gate_up_b = self._param("gate_up_bias", (local_e, 2 * i), zeros, "[E, 2I]") if self.expert_bias else None
        down_b = self._param("down_bias", (local_e, h), zeros, "[E, H]") if self.expert_bias else None

        routing = self._route(x2, router_weight, router_bias, correction)
        weights = routing.weights
        if local_e == e:
            dispatch = sort_by_expert(routing.indices, e)
        else:  # another device's pairs sort past this device's groups (expert id local_e)
            first = jax.lax.axis_index(self.expert_axis) * local_e
            dispatch = sort_local_experts(routing.indices, first, local_e)
            local = (routing.indices >= first) & (routing.indices < first + local_e)
            weights = jnp.where(local, weights, 0.0)
        def row_bias(bias, bias_dtype=dtype):
            # Each sorted row's expert bias; another device's rows (id local_e) get a zero row, so with the
            # grouped GEMM's zero rows past the groups and activate(0, 0) = 0 they stay exactly zero.
            bias = jnp.asarray(bias, bias_dtype)
            bias = bias if local_e == e else jnp.pad(bias, ((0, 1), (0, 0)))
            return jnp.take(bias, dispatch.experts, axis=0)

        rows = gather_rows(x2.astype(dtype), dispatch)
        if chains(gate_up_w, down_w, rows.shape[0]):
            out = self._experts_in_slots(gate_up_w, down_w, gate_up_b, rows, dispatch, dtype)
        else:
            bias = None if gate_up_b is None else row_bias(gate_up_b, jnp.float32)
            hidden = self._hidden(self._project(gate_up_w, rows, dispatch.group_sizes), bias, dtype)
            out = self._project(down_w, hidden, dispatch.group_sizes)
        if down_b is not None:
            out = out + row_bias(down_b)
        y = combine(out, dispatch, weights)
        if self.shared_expert:
            shared = SharedExpert(h, self.shared_intermediate or i, dtype=dtype, param_dtype=self.param_dtype,
                                  name="shared_expert")
            y = y + shared(x2.astype(dtype)).astype(jnp.float32)
        return y.astype(dtype).reshape(*lead, h)


# ---- quantized expert parameters -----------------------------------------------------------------

def _rules(rules) -> list[tuple[str, Scheme | None]]:
    if isinstance(rules, (str, Scheme)):
        return [(r".*", get_scheme(rules))]
    out = []
    for rule in rules:
        if not (isinstance(rule, (tuple, list)) and len(rule) == 2 and isinstance(rule[0], str)):
            raise TypeError(f"each rule must be a (regex, scheme) pair, got {rule!r}")
        out.append((rule[0], None if rule[1] is None else get_scheme(rule[1])))
    return out


def quantize_experts(params: Any, rules: str | Scheme | Sequence) -> tuple[Any, dict[str, str]]:
    """Replaces the float expert stacks (``gate_up_proj``, ``down_proj`` leaves ``[E, N, K]``) of a params
    tree by ``QExperts``; ``rules`` as ``quantize_params``'s (a scheme, or ``(regex, scheme)`` pairs on
    ``/``-joined paths, first full match wins, None keeps float). Returns ``(params, {path: scheme})``.

    ``jquant.flax.quantize_params`` gives the same stacks (its rules reach expert stacks and Dense
    kernels alike, and it reports unused rules); this one touches expert stacks only."""
    rules = _rules(rules)
    done: dict[str, str] = {}

    def visit(path, leaf):
        name = path_str(path)
        if not is_expert_stack(name, leaf):
            return leaf
        for pattern, scheme in rules:
            if re.fullmatch(pattern, name):
                if scheme is None:
                    return leaf
                done[name] = scheme.name
                return QExperts(quantize_expert_weights(leaf, scheme, name=f"parameter {name!r}"), scheme)
        return leaf

    out = jax.tree_util.tree_map_with_path(visit, params, is_leaf=lambda x: isinstance(x, QExperts))
    return out, done


def expert_params(weights: ExpertWeights, scheme: str | Scheme | None = None) -> dict[str, Any]:
    """A ``MoE``'s expert parameters from loaded ExpertWeights (``jquant.checkpoint.experts``): gate and
    up fused into ``gate_up_proj`` (exactly: codes and scales concatenated), biases as ``gate_up_bias`` /
    ``down_bias`` when present. ``scheme``: default by format (``LOADED_SCHEMES``)."""
    if scheme is None:
        if weights.gate.fmt not in LOADED_SCHEMES:
            raise ValueError(f"no default scheme for expert format {weights.gate.fmt!r}; pass scheme=")
        scheme = LOADED_SCHEMES[weights.gate.fmt]
    scheme = get_scheme(scheme)
    out = {"gate_up_proj": QExperts(concat_rows([weights.gate, weights.up]), scheme),
           "down_proj": QExperts(weights.down, scheme)}
    if weights.gate_bias is not None:
        out["gate_up_bias"] = jnp.concatenate([jnp.asarray(weights.gate_bias), jnp.asarray(weights.up_bias)], 1)
    if weights.down_bias is not None:
        out["down_bias"] = jnp.asarray(weights.down_bias)
    return out
