"""MoE routing as pure functions: router logits → (weights, expert indices), and the token sort,
gather and combine on either side of the grouped GEMM.

Scoring (reference facts numbered as in ``docs/design/moe.md``):

* ``"softmax"`` (gpt-oss, Mixtral): with ``normalize=True`` the k largest logits are chosen and the
  weights are the softmax over those k (gpt-oss reference fact 3: top-k first, softmax second; equal
  to renormalizing the full softmax's probabilities); with ``normalize=False`` the weights are the
  full softmax's probabilities of the chosen experts. Selection runs on the logits themselves unless
  groups or a correction bias need the probabilities.
* ``"sigmoid"`` (DeepSeek-V3 reference fact 4): scores ``sigmoid(logits)``; experts are chosen by
  ``scores + correction_bias`` (the ``e_score_correction_bias``), weights are the unbiased scores of
  the chosen experts, divided by their sum (+1e-20) when ``normalize``.
* Group-limited selection (``n_group > 1``): experts split into ``n_group`` equal groups; each group
  scores the sum of its two best selection scores (``group_score="top2_sum"``, DeepSeek-V3 reference
  fact 4) or its best one (``"max"``, DeepSeek-V2); ``"auto"`` (the default) takes the sum with a
  correction bias and the best one without, as DeepSeek's reference and vLLM's ``grouped_topk`` do.
  Only the ``topk_group`` best groups compete, the others are masked to -inf (DeepSeek-V3 reference
  fact 5).
* Weights end multiplied by ``routed_scaling_factor``; everything is computed in float32.

Ties go to the lowest expert (and group) index: ``jax.lax.top_k`` is stable, and the chosen experts
come out in order of decreasing selection score.

NaN logits: inside jit nothing can raise, so ``route`` keeps going with defined output. A NaN
selection score counts as -inf (the expert indices stay valid, so sort and gather never go out of
range), and every weight of a token with any NaN logit is NaN, so the NaN reaches that token's output
and no other token's. ``check_router_logits`` (eager, outside jit) raises a ValueError naming the
tokens instead; ``route_checked`` runs it before ``route``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

SCORINGS = ("softmax", "sigmoid")
GROUP_SCORES = ("auto", "top2_sum", "max")


@dataclasses.dataclass(frozen=True)
class Routing:
    """Per token, the chosen experts and their weights: ``indices [T, k]`` int32 (best first),
    ``weights [T, k]`` float32.

    Examples:
      >>> import jax.numpy as jnp
      >>> from jquant.kernels.moe import Routing, route
      >>> r = route(jnp.array([[0.0, 2.0, 1.0], [3.0, 0.0, 0.0]]), 2)
      >>> isinstance(r, Routing), r.indices.shape, str(r.indices.dtype), str(r.weights.dtype)
      (True, (2, 2), 'int32', 'float32')
      >>> r.indices.tolist()  # best first
      [[1, 2], [0, 1]]
    """

    weights: jax.Array
    indices: jax.Array


jax.tree_util.register_dataclass(Routing, data_fields=["weights", "indices"], meta_fields=[])


def check_routing(num_experts: int, top_k: int, *, scoring: str = "softmax", n_group: int = 1,
                  topk_group: int = 1, group_score: str = "auto") -> None:
    """The static checks of ``route``: a ValueError naming the parameter that is out of range."""
    for name, value in (("num_experts", num_experts), ("top_k", top_k), ("n_group", n_group),
                        ("topk_group", topk_group)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if top_k > num_experts:
        raise ValueError(f"top_k={top_k} exceeds the number of experts num_experts={num_experts}")
    if scoring not in SCORINGS:
        raise ValueError(f"scoring must be one of {SCORINGS}, got {scoring!r}")
    if group_score not in GROUP_SCORES:
        raise ValueError(f"group_score must be one of {GROUP_SCORES}, got {group_score!r}")
    if num_experts % n_group:
        raise ValueError(f"n_group={n_group} does not divide num_experts={num_experts} into equal groups")
    if topk_group > n_group:
        raise ValueError(f"topk_group={topk_group} exceeds n_group={n_group}")
    reachable = topk_group * (num_experts // n_group)
    if top_k > reachable:
        raise ValueError(f"top_k={top_k} exceeds the {reachable} experts of the topk_group={topk_group} groups "
                         f"of {num_experts // n_group} that can be selected")


def _group_mask(choice: jax.Array, n_group: int, topk_group: int, group_score: str) -> jax.Array:
    """``choice [T, E]`` with the experts outside each token's ``topk_group`` best groups set to -inf."""
    t, e = choice.shape
    grouped = choice.reshape(t, n_group, e // n_group)
    if group_score == "max":
        scores = grouped.max(-1)
    else:
        scores = jax.lax.top_k(grouped, min(2, e // n_group))[0].sum(-1)
    _, best = jax.lax.top_k(scores, topk_group)
    keep = jnp.zeros((t, n_group), bool).at[jnp.arange(t)[:, None], best].set(True)
    return jnp.where(keep[:, :, None], grouped, -jnp.inf).reshape(t, e)


@functools.partial(jax.jit, static_argnames=("top_k", "scoring", "n_group", "topk_group", "group_score",
                                             "normalize", "routed_scaling_factor"))
def route(logits: jax.Array, top_k: int, *, scoring: str = "softmax", correction_bias: jax.Array | None = None,
          n_group: int = 1, topk_group: int = 1, group_score: str = "auto", normalize: bool = True,
          routed_scaling_factor: float = 1.0) -> Routing:
    """Chooses ``top_k`` experts per token from router ``logits [T, E]`` (see the module docstring).

    One compiled program (``top_k``, ``scoring``, ``n_group``, ``topk_group``, ``group_score``,
    ``normalize`` and ``routed_scaling_factor`` static); argument errors raise while tracing.
    ``correction_bias [E]`` shifts the selection only.

    Examples:
      >>> import jax.numpy as jnp
      >>> from jquant.kernels.moe import route
      >>> r = route(jnp.array([[1.0, 3.0, 3.0, 0.0]]), 2)  # a tie: the lower expert comes first
      >>> r.indices.tolist(), r.weights.tolist()
      ([[1, 2]], [[0.5, 0.5]])
      >>> route(jnp.zeros((1, 4)), 5)
      Traceback (most recent call last):
          ...
      ValueError: top_k=5 exceeds the number of experts num_experts=4 ...
    """
    if getattr(logits, "ndim", None) != 2:
        raise ValueError(f"logits must be router logits [T, E] (2-D), got shape {tuple(getattr(logits, 'shape', ()))}")
    num_experts = logits.shape[1]
    check_routing(num_experts, top_k, scoring=scoring, n_group=n_group, topk_group=topk_group,
                  group_score=group_score)
    if correction_bias is not None and tuple(correction_bias.shape) != (num_experts,):
        raise ValueError(f"correction_bias must have shape ({num_experts},) (one per expert), got "
                         f"{tuple(correction_bias.shape)}")
    logits = logits.astype(jnp.float32)
    bad = jnp.any(jnp.isnan(logits), axis=-1, keepdims=True)
    if scoring == "sigmoid":
        scores = jax.nn.sigmoid(logits)
    else:
        scores = jax.nn.softmax(logits, axis=-1)
    on_logits = scoring == "softmax" and correction_bias is None and n_group == 1
    choice = logits if on_logits else scores
    if correction_bias is not None:
        choice = choice + correction_bias.astype(jnp.float32)
    choice = jnp.where(jnp.isnan(choice), -jnp.inf, choice)
    if n_group > 1:
        if group_score == "auto":
            group_score = "max" if correction_bias is None else "top2_sum"
        choice = _group_mask(choice, n_group, topk_group, group_score)
    _, indices = jax.lax.top_k(choice, top_k)
    if scoring == "softmax" and normalize:
        weights = jax.nn.softmax(jnp.take_along_axis(logits, indices, axis=-1), axis=-1)
    else:
        weights = jnp.take_along_axis(scores, indices, axis=-1)
        if normalize:
            weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    weights = jnp.where(bad, jnp.nan, weights * jnp.float32(routed_scaling_factor))
    return Routing(weights=weights, indices=indices.astype(jnp.int32))


def check_router_logits(logits) -> None:
    """Raises a ValueError naming the tokens whose router logits hold a NaN. Eager only: inside jit
    (traced logits) it raises a TypeError, since there ``route`` propagates NaN instead.

    Examples:
      >>> import numpy as np
      >>> from jquant.kernels.moe import check_router_logits
      >>> check_router_logits(np.zeros((2, 4)))  # no NaN: nothing happens
      >>> check_router_logits(np.array([[0.0, 1.0], [np.nan, 0.0]]))
      Traceback (most recent call last):
          ...
      ValueError: router logits hold NaN for 1 of 2 tokens (first: token 1); their routing is undefined
    """
    if isinstance(logits, jax.core.Tracer):
        raise TypeError("check_router_logits needs concrete logits: call it outside jit (inside, route gives "
                        "NaN weights to tokens with NaN logits)")
    values = np.asarray(logits, np.float32)
    if values.ndim != 2:
        raise ValueError(f"logits must be router logits [T, E] (2-D), got shape {values.shape}")
    bad = np.flatnonzero(np.isnan(values).any(-1))
    if bad.size:
        raise ValueError(f"router logits hold NaN for {bad.size} of {values.shape[0]} tokens "
                         f"(first: token {int(bad[0])}); their routing is undefined")


def route_checked(logits, top_k: int, **options) -> Routing:
    """``check_router_logits`` then ``route`` (eager).

    Examples:
      >>> import numpy as np
      >>> from jquant.kernels.moe import route_checked
      >>> route_checked(np.array([[0.0, 1.0, 2.0]]), 2).indices.tolist()
      [[2, 1]]
      >>> route_checked(np.array([[np.nan, 1.0, 2.0]]), 2)  # route would give this token NaN weights
      Traceback (most recent call last):
          ...
      ValueError: router logits hold NaN for 1 of 1 tokens (first: token 0); their routing is undefined
    """
    check_router_logits(logits)
    return route(jnp.asarray(logits), top_k, **options)


# ---- token sort, gather and combine ---------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Dispatch:
    """Token-expert pairs sorted by expert (stable: by token within an expert).

    ``order [T·k]``: the flat pair ``t·k + j`` at each sorted position; ``group_sizes [E]`` int32: pairs
    per expert; ``experts [T·k]``: the expert of each sorted row. ``top_k`` is static.

    Examples:
      Token 0 chose experts 2 and 0, token 1 experts 0 and 1:

      >>> import jax.numpy as jnp
      >>> from jquant.kernels.moe import sort_by_expert
      >>> d = sort_by_expert(jnp.array([[2, 0], [0, 1]]), 3)
      >>> d.order.tolist(), d.experts.tolist(), d.tokens.tolist(), d.top_k
      ([1, 2, 3, 0], [0, 0, 1, 2], [0, 1, 1, 0], 2)
    """

    order: jax.Array
    group_sizes: jax.Array
    experts: jax.Array
    top_k: int = 1

    @property
    def tokens(self) -> jax.Array:
        """The token of each sorted row."""
        return self.order // self.top_k


jax.tree_util.register_dataclass(Dispatch, data_fields=["order", "group_sizes", "experts"], meta_fields=["top_k"])


@functools.partial(jax.jit, static_argnames=("num_experts",))
def sort_by_expert(indices: jax.Array, num_experts: int) -> Dispatch:
    """Sorts the pairs of ``indices [T, k]`` (expert ids in ``[0, num_experts)``) by expert.

    Examples:
      >>> import jax.numpy as jnp
      >>> from jquant.kernels.moe import sort_by_expert
      >>> d = sort_by_expert(jnp.array([[2, 0], [0, 1], [2, 1]]), 4)
      >>> d.group_sizes.tolist()  # pairs per expert: the group_sizes of grouped_matmul
      [2, 2, 2, 0]
      >>> d.experts.tolist(), d.tokens.tolist()  # by token within an expert
      ([0, 0, 1, 1, 2, 2], [0, 1, 1, 2, 0, 2])
    """
    if getattr(indices, "ndim", None) != 2:
        raise ValueError(f"indices must be [T, k] expert ids, got shape {tuple(getattr(indices, 'shape', ()))}")
    flat = indices.reshape(-1).astype(jnp.int32)
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    return Dispatch(order=order, group_sizes=group_sizes, experts=flat[order], top_k=indices.shape[1])


@functools.partial(jax.jit, static_argnames=("num_local",))
def sort_local_experts(indices: jax.Array, first: jax.Array | int, num_local: int) -> Dispatch:
    """``sort_by_expert`` for a device that holds experts ``[first, first + num_local)`` only (expert
    parallelism): pairs of those experts are sorted by local id (``expert - first``) into
    ``group_sizes [num_local]``; every other pair sorts after them with local id ``num_local``, rows past
    the groups' sum that ``grouped_matmul`` leaves at zero. ``first`` may be traced (a device's index
    times ``num_local`` inside ``shard_map``).

    Examples:
      Experts 2 and 3 of 4 on this device: token 0 chose 2 and 0, token 1 chose 3 and 2:

      >>> import jax.numpy as jnp
      >>> from jquant.kernels.moe import sort_local_experts
      >>> d = sort_local_experts(jnp.array([[2, 0], [3, 2]]), 2, 2)
      >>> d.group_sizes.tolist(), d.experts.tolist(), d.tokens.tolist()  # local ids; 2 marks another device's
      ([2, 1], [0, 0, 1, 2], [0, 1, 1, 0])
    """
    local = indices.astype(jnp.int32) - first
    mine = (local >= 0) & (local < num_local)
    d = sort_by_expert(jnp.where(mine, local, num_local), num_local + 1)
    return Dispatch(order=d.order, group_sizes=d.group_sizes[:num_local], experts=d.experts, top_k=d.top_k)


@jax.jit
def gather_rows(x: jax.Array, dispatch: Dispatch) -> jax.Array:
    """``x [T, H]`` → ``[T·k, H]``: each sorted pair's token row.

    Examples:
      >>> import jax.numpy as jnp
      >>> from jquant.kernels.moe import gather_rows, sort_by_expert
      >>> x = jnp.array([[1.0, 1.0], [2.0, 2.0]])  # two tokens
      >>> d = sort_by_expert(jnp.array([[1, 0], [0, 1]]), 2)
      >>> gather_rows(x, d).tolist()  # expert 0's rows (tokens 0, 1), then expert 1's
      [[1.0, 1.0], [2.0, 2.0], [1.0, 1.0], [2.0, 2.0]]
    """
    return jnp.take(x, dispatch.tokens, axis=0)


@jax.jit
def combine(y: jax.Array, dispatch: Dispatch, weights: jax.Array) -> jax.Array:
    """Sorted expert outputs ``y [T·k, N]`` → ``[T, N]``: each token's rows weighted by ``weights [T, k]``
    and summed over its k experts in float32 (returned in float32).

    Examples:
      A whole MoE layer: route, sort, gather, grouped GEMM, combine; equal to each token's weighted sum
      of its experts' outputs:

      >>> import jax.numpy as jnp, numpy as np
      >>> from jquant.kernels.moe import (combine, gather_rows, grouped_matmul, quantize_expert_weights, route,
      ...                                 sort_by_expert)
      >>> rng = np.random.default_rng(0)
      >>> experts = quantize_expert_weights(rng.standard_normal((3, 8, 32)).astype(np.float32), "int4_g32")
      >>> x = jnp.asarray(rng.standard_normal((4, 32)), jnp.float32)
      >>> r = route(jnp.asarray(rng.standard_normal((4, 3)), jnp.float32), 2)
      >>> d = sort_by_expert(r.indices, 3)
      >>> y = combine(grouped_matmul(gather_rows(x, d), experts, d.group_sizes), d, r.weights)
      >>> w = experts.dequantize()
      >>> dense = sum(r.weights[:, j, None] * jnp.einsum("tnk,tk->tn", w[r.indices[:, j]], x) for j in range(2))
      >>> y.shape, str(y.dtype), bool(jnp.allclose(y, dense, atol=1e-4))
      ((4, 8), 'float32', True)
    """
    t, k = weights.shape
    pairs = jnp.zeros(y.shape, jnp.float32).at[dispatch.order].set(y.astype(jnp.float32))
    # HIGHEST keeps the sum float32 on GPUs, where a float32 dot defaults to TF32
    return jnp.einsum("tkn,tk->tn", pairs.reshape(t, k, y.shape[-1]), weights.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)
