"""Loop references for the MoE tests: routing one token at a time with Python's sort (ties to the
lowest index), the grouped GEMM one row at a time, and the MoE layer one (token, expert) pair at a
time in float64."""

from __future__ import annotations

import jax
import ml_dtypes
import numpy as np

MODULE = "model.layers.0.mlp.experts"


def ranked(values, candidates) -> list[int]:
    """``candidates`` by decreasing value, ties to the lowest index."""
    return sorted(candidates, key=lambda e: (-values[e], e))


def route_loop(logits, top_k, *, scoring="softmax", correction_bias=None, n_group=1, topk_group=1,
               group_score="auto", normalize=True, routed_scaling_factor=1.0):
    """(weights float64 [T, k], indices [T, k]) token by token; the scores come from jax's own
    softmax / sigmoid (float32), so selection sees exactly the values ``route`` sees."""
    logits = np.asarray(logits, np.float32)
    t, e = logits.shape
    if scoring == "sigmoid":
        scores = np.asarray(jax.nn.sigmoid(logits))
    else:
        scores = np.asarray(jax.nn.softmax(logits, axis=-1))
    on_logits = scoring == "softmax" and correction_bias is None and n_group == 1
    choice = (logits if on_logits else scores).copy()
    if correction_bias is not None:
        choice = choice + np.asarray(correction_bias, np.float32)
    per = e // n_group
    if group_score == "auto":
        group_score = "max" if correction_bias is None else "top2_sum"
    weights, indices = np.zeros((t, top_k)), np.zeros((t, top_k), np.int64)
    for i in range(t):
        allowed = list(range(e))
        if n_group > 1:
            groups = []
            for g in range(n_group):
                members = sorted(choice[i, g * per:(g + 1) * per], reverse=True)
                groups.append(members[0] if group_score == "max" else sum(members[:min(2, per)]))
            best = ranked(groups, range(n_group))[:topk_group]
            allowed = [x for x in allowed if x // per in best]
        chosen = ranked(choice[i], allowed)[:top_k]
        indices[i] = chosen
        if scoring == "softmax" and normalize:
            sel = logits[i, chosen].astype(np.float64)
            w = np.exp(sel - sel.max())
            w = w / w.sum()
        else:
            w = scores[i, chosen].astype(np.float64)
            if normalize:
                w = w / w.sum()
        weights[i] = w * routed_scaling_factor
    return weights, indices


def grouped_matmul_loop(x, w, group_sizes):
    """Row by row: ``y[r] = w[e] @ x[r]`` for the rows of expert e, zeros past the groups (float64)."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    y = np.zeros((x.shape[0], w.shape[1]))
    start = 0
    for e, size in enumerate(np.asarray(group_sizes)):
        for r in range(start, start + int(size)):
            y[r] = w[e] @ x[r]
        start += int(size)
    return y


def silu(v):
    return v / (1 + np.exp(-v))


def act_loop(name, gate, up):
    if name == "swiglu":
        return silu(gate) * up
    gate = np.minimum(gate, 7.0)
    up = np.clip(up, -7.0, 7.0)
    return (up + 1) * gate / (1 + np.exp(-1.702 * gate))


def moe_loop(params, x, weights, indices, *, activation="swiglu"):
    """The MoE layer pair by pair in float64 from float params (the module's names and orientation)."""
    p = {k: v for k, v in params.items() if k != "shared_expert"}
    p = {k: np.asarray(v, np.float64) for k, v in p.items()}
    x = np.asarray(x, np.float64)
    i = p["down_proj"].shape[2]
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(indices.shape[1]):
            e = int(indices[t, j])
            h = p["gate_up_proj"][e] @ x[t] + (p["gate_up_bias"][e] if "gate_up_bias" in p else 0)
            y = p["down_proj"][e] @ act_loop(activation, h[:i], h[i:])
            out[t] += weights[t, j] * (y + (p["down_bias"][e] if "down_bias" in p else 0))
    if "shared_expert" in params:
        s = {k: np.asarray(v["kernel"], np.float64) for k, v in params["shared_expert"].items()}
        out += (silu(x @ s["gate_proj"]) * (x @ s["up_proj"])) @ s["down_proj"]
    return out


def gpt_oss_tensors(e=3, h=64, i=32, seed=0):
    """Random gpt-oss expert tensors (MXFP4 blocks, scales 2^-3..2^2, bf16 biases) under MODULE."""
    rng = np.random.default_rng(seed)
    return {
        f"{MODULE}.gate_up_proj_blocks": rng.integers(0, 256, (e, 2 * i, h // 32, 16), dtype=np.uint8),
        f"{MODULE}.gate_up_proj_scales": rng.integers(124, 130, (e, 2 * i, h // 32), dtype=np.uint8),
        f"{MODULE}.gate_up_proj_bias": rng.standard_normal((e, 2 * i)).astype(ml_dtypes.bfloat16),
        f"{MODULE}.down_proj_blocks": rng.integers(0, 256, (e, h, i // 32, 16), dtype=np.uint8),
        f"{MODULE}.down_proj_scales": rng.integers(124, 130, (e, h, i // 32), dtype=np.uint8),
        f"{MODULE}.down_proj_bias": rng.standard_normal((e, h)).astype(ml_dtypes.bfloat16),
    }
