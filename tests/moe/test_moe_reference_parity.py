"""Routing and expert math against numpy transcriptions of the reference formulas (openai/gpt-oss,
DeepSeek-V3's inference code, vLLM's routers and activations, transformers' modeling files), on
fresh random inputs. Each test also checks that its inputs tell the reference formula apart from a
plausible wrong one, so a wrong formula in jquant would fail it."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jquant.checkpoint.experts import load_gpt_oss_experts
from jquant.kernels.moe import combine, route, sort_by_expert
from jquant.kernels.moe.activations import activate, gptoss_swiglu, swiglu
from jquant.models.moe import MoE, expert_params

MODULE = "model.layers.0.mlp.experts"


# ---- reference formulas (numpy) ----------------------------------------------------------------------

def topk(values, k):
    """Indices of the k largest along the last axis, largest first, equal values lowest index first
    (torch.topk(sorted=True); vLLM's topk_softmax kernel breaks ties to the lower expert)."""
    return np.argsort(-values, axis=-1, kind="stable")[..., :k]


def softmax(x):
    x = np.asarray(x, np.float64)
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-np.asarray(x, np.float64)))


def gather(values, indices):
    return np.take_along_axis(values, indices, axis=-1)


def gpt_oss_router(logits, k):
    """gpt-oss: top-k of the logits, then a softmax over the k chosen."""
    indices = topk(logits, k)
    return softmax(gather(logits, indices)), indices


def softmax_topk_router(logits, k, renormalize):
    """Mixtral / Qwen-MoE (vLLM fused_topk): softmax over all experts, top-k of the probabilities,
    divided by their sum when renormalizing."""
    probs = softmax(logits)
    indices = topk(probs, k)
    weights = gather(probs, indices)
    return (weights / weights.sum(-1, keepdims=True) if renormalize else weights), indices


def grouped_router(logits, k, *, scoring, n_group, topk_group, bias=None, renormalize=True, scale=1.0,
                   masked=-np.inf):
    """DeepSeek-V2/V3 grouped top-k (DeepSeek-V3 ``Gate.forward``, vLLM ``grouped_topk``): selection on
    the scores plus the correction bias; a group scores the sum of its top two biased scores with a
    bias, its maximum without; experts outside the ``topk_group`` best groups are filled with ``masked``
    (-inf in vLLM and transformers 5.25, 0.0 in earlier transformers); the weights are the unbiased scores of the chosen experts."""
    scores = sigmoid(logits) if scoring == "sigmoid" else softmax(logits)
    choice = scores if bias is None else scores + bias
    t, e = choice.shape
    grouped = choice.reshape(t, n_group, e // n_group)
    if bias is None:
        group_scores = grouped.max(-1)
    else:
        group_scores = -np.sort(-grouped, axis=-1)[..., :2].sum(-1)
    keep = np.zeros((t, n_group), bool)
    np.put_along_axis(keep, topk(group_scores, topk_group), True, axis=-1)
    choice = np.where(np.repeat(keep, e // n_group, axis=1), choice, masked)
    indices = topk(choice, k)
    weights = gather(scores, indices)
    if renormalize:
        weights = weights / weights.sum(-1, keepdims=True)
    return weights * scale, indices


def gptoss_swiglu_ref(gate, up, alpha=1.702, limit=7.0):
    """gpt-oss's clamped SwiGLU: gate clamped from above only, up on both sides, an extra 1 on up."""
    gate = np.minimum(np.asarray(gate, np.float64), limit)
    up = np.clip(np.asarray(up, np.float64), -limit, limit)
    return (up + 1.0) * (gate * sigmoid(alpha * gate))


def silu_mul_ref(gate, up):
    gate = np.asarray(gate, np.float64)
    return gate * sigmoid(gate) * np.asarray(up, np.float64)


FP4_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def mxfp4_dequant(blocks, scales):
    """gpt-oss MXFP4 ``[..., N, K/32, 16]`` bytes → ``[..., N, K]``: low nibble the even element, high
    nibble the odd one, each block times 2^(scale - 127)."""
    lo, hi = FP4_E2M1[blocks & 0x0F], FP4_E2M1[blocks >> 4]
    values = np.stack([lo, hi], axis=-1).reshape(*blocks.shape[:-1], 32)
    values = np.ldexp(values, scales.astype(np.int32)[..., None] - 127)
    return values.reshape(*blocks.shape[:-2], -1)


# ---- routing ------------------------------------------------------------------------------------------

def assert_routing(got, weights, indices, rtol=1e-6):
    np.testing.assert_array_equal(np.asarray(got.indices), indices)
    np.testing.assert_allclose(np.asarray(got.weights), weights, rtol=rtol, atol=1e-7)


def differs(a, b, rtol=1e-4):
    return not np.allclose(a, b, rtol=rtol, atol=1e-6)


def test_gpt_oss_router_is_topk_then_softmax_over_the_chosen_logits():
    logits = (np.random.default_rng(10).standard_normal((64, 32)) * 2).astype(np.float32)
    weights, indices = gpt_oss_router(logits, 4)
    assert_routing(route(jnp.asarray(logits), 4), weights, indices)
    # the full softmax's probabilities of the chosen four (no renormalization) are another answer
    assert differs(weights, gather(softmax(logits), indices))


@pytest.mark.parametrize("renormalize", [True, False])
def test_softmax_topk_router_with_and_without_renormalization(renormalize):
    # Mixtral and Qwen3-MoE renormalize (norm_topk_prob true); Qwen2-MoE does not
    logits = (np.random.default_rng(11).standard_normal((64, 60)) * 2).astype(np.float32)
    weights, indices = softmax_topk_router(logits, 4, renormalize)
    assert_routing(route(jnp.asarray(logits), 4, normalize=renormalize), weights, indices)
    assert differs(weights, softmax_topk_router(logits, 4, not renormalize)[0])


def deepseek_v3_inputs(seed=12, t=128, e=256):
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal((t, e)) * 1.5).astype(np.float32)
    bias = (rng.standard_normal(e) * 0.3).astype(np.float32)
    return logits, bias


def test_deepseek_v3_router():
    # DeepSeek-V3's sizes: 256 experts in 8 groups, 4 groups kept, top-8, weights renormalized, x 2.5
    logits, bias = deepseek_v3_inputs()
    options = dict(scoring="sigmoid", n_group=8, topk_group=4, renormalize=True, scale=2.5)
    weights, indices = grouped_router(logits, 8, bias=bias, **options)
    got = route(jnp.asarray(logits), 8, scoring="sigmoid", correction_bias=jnp.asarray(bias), n_group=8,
                topk_group=4, normalize=True, routed_scaling_factor=2.5)
    assert_routing(got, weights, indices)
    # the inputs tell the reference apart from each near miss
    scores = sigmoid(logits)
    assert differs(weights, 2.5 * gather(scores + bias, indices) / gather(scores + bias, indices).sum(-1, keepdims=True)), \
        "weights from the biased scores"
    assert not np.array_equal(indices, grouped_router(logits, 8, **options)[1]), "selection without the bias"
    alt = grouped_router(logits, 8, bias=bias, **{**options, "n_group": 1, "topk_group": 1})[1]
    assert not np.array_equal(indices, alt), "no group limit"
    assert differs(weights, grouped_router(logits, 8, bias=bias, **{**options, "renormalize": False})[0])


def test_deepseek_v3_group_score_is_the_sum_of_the_top_two():
    logits, bias = deepseek_v3_inputs(seed=13)
    weights, indices = grouped_router(logits, 8, scoring="sigmoid", n_group=8, topk_group=4, bias=bias)
    got = route(jnp.asarray(logits), 8, scoring="sigmoid", correction_bias=jnp.asarray(bias), n_group=8,
                topk_group=4)
    assert_routing(got, weights, indices)
    default = route(jnp.asarray(logits), 8, scoring="sigmoid", correction_bias=jnp.asarray(bias), n_group=8,
                    topk_group=4, group_score="auto")
    assert_routing(default, weights, indices)
    # groups scored by their best expert alone choose other experts for some tokens
    by_max = route(jnp.asarray(logits), 8, scoring="sigmoid", correction_bias=jnp.asarray(bias), n_group=8,
                   topk_group=4, group_score="max")
    assert not np.array_equal(np.asarray(by_max.indices), indices)


def test_masked_groups_are_never_chosen_even_when_biased_scores_are_negative():
    # vLLM and transformers 5.25 fill the dropped groups with -inf; earlier transformers releases with
    # 0.0, which picks dropped experts once every kept biased score is negative (docs/design/moe.md, fact 5)
    logits, _ = deepseek_v3_inputs(seed=14, e=64)
    bias = np.full(64, -2.0, np.float32)
    options = dict(scoring="sigmoid", n_group=8, topk_group=2, bias=bias)
    weights, indices = grouped_router(logits, 6, **options)
    got = route(jnp.asarray(logits), 6, scoring="sigmoid", correction_bias=jnp.asarray(bias), n_group=8,
                topk_group=2)
    assert_routing(got, weights, indices)
    kept_groups = np.sort(indices // 8, axis=1)
    assert np.all([len(set(row)) <= 2 for row in kept_groups])
    assert not np.array_equal(indices, grouped_router(logits, 6, masked=0.0, **options)[1])


def test_deepseek_v2_softmax_groups_by_their_best_expert_without_renormalization():
    # DeepSeek-V2: softmax, no correction bias (group score the maximum), 160 experts in 8 groups, 3 kept,
    # top-6, weights not renormalized, x 16
    logits = (np.random.default_rng(15).standard_normal((128, 160)) * 2).astype(np.float32)
    weights, indices = grouped_router(logits, 6, scoring="softmax", n_group=8, topk_group=3, renormalize=False,
                                      scale=16.0)
    for group_score in ("max", "auto"):   # the default follows the missing bias
        got = route(jnp.asarray(logits), 6, n_group=8, topk_group=3, group_score=group_score, normalize=False,
                    routed_scaling_factor=16.0)
        assert_routing(got, weights, indices, rtol=2e-6)
    top2 = route(jnp.asarray(logits), 6, n_group=8, topk_group=3, group_score="top2_sum", normalize=False,
                 routed_scaling_factor=16.0)
    assert not np.array_equal(np.asarray(top2.indices), indices)


def test_ties_go_to_the_lowest_index_in_every_reference_formula():
    logits = np.random.default_rng(16).integers(-2, 3, (64, 16)).astype(np.float32)
    assert_routing(route(jnp.asarray(logits), 4), *gpt_oss_router(logits, 4))
    assert_routing(route(jnp.asarray(logits), 4, normalize=False), *softmax_topk_router(logits, 4, False))
    # grouped: logits 0..3 only, so two groups tie exactly when they hold the same values (sigmoid(a) +
    # sigmoid(-a) = 1 would make unequal groups tie up to rounding)
    logits = np.random.default_rng(17).integers(0, 4, (64, 16)).astype(np.float32)
    bias = np.zeros(16, np.float32)
    weights, indices = grouped_router(logits, 4, scoring="sigmoid", n_group=4, topk_group=2, bias=bias)
    assert_routing(route(jnp.asarray(logits), 4, scoring="sigmoid", correction_bias=jnp.asarray(bias), n_group=4,
                         topk_group=2), weights, indices)
    weights, indices = grouped_router(logits, 4, scoring="softmax", n_group=4, topk_group=2, renormalize=False)
    assert_routing(route(jnp.asarray(logits), 4, n_group=4, topk_group=2, group_score="max", normalize=False),
                   weights, indices)
    # equal groups: the lower group, then its lower experts
    got = route(jnp.zeros((1, 16)), 3, scoring="sigmoid", correction_bias=jnp.zeros(16), n_group=4, topk_group=2)
    np.testing.assert_array_equal(np.asarray(got.indices), [[0, 1, 2]])


def test_nan_logits_poison_their_token_only():
    # torch.topk ranks NaN first; jquant (docs/design/moe.md, Routing) never chooses a NaN score and
    # makes every weight of that token NaN, so other tokens match the reference exactly
    logits, bias = deepseek_v3_inputs(seed=17, t=8, e=64)
    logits[3, 5] = np.nan
    got = route(jnp.asarray(logits), 6, scoring="sigmoid", correction_bias=jnp.asarray(bias), n_group=8,
                topk_group=4, routed_scaling_factor=2.5)
    clean = np.delete(np.arange(8), 3)
    weights, indices = grouped_router(logits[clean], 6, scoring="sigmoid", n_group=8, topk_group=4, bias=bias,
                                      scale=2.5)
    np.testing.assert_array_equal(np.asarray(got.indices)[clean], indices)
    np.testing.assert_allclose(np.asarray(got.weights)[clean], weights, rtol=1e-6)
    assert np.all(np.isnan(np.asarray(got.weights)[3])) and 5 not in np.asarray(got.indices)[3]
    assert np.all((np.asarray(got.indices) >= 0) & (np.asarray(got.indices) < 64))



def test_router_logits_are_float32_for_bf16_layers():
    # transformers' DeepseekV3TopkRouter casts x and the router weight to float32 before the product;
    # logits rounded to bf16 would move the weights by ~1e-3
    e, h = 64, 256
    rng = np.random.default_rng(24)
    w = jnp.asarray(rng.standard_normal((e, h)) * h ** -0.5, jnp.bfloat16)
    bias = jnp.asarray(rng.standard_normal(e) * 0.3, jnp.float32)
    x = jnp.asarray(rng.standard_normal((32, h)), jnp.bfloat16)
    model = MoE(num_experts=e, top_k=8, hidden=h, intermediate=32, scoring="sigmoid", n_group=8, topk_group=4,
                routed_scaling_factor=2.5, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    got = model.apply({"params": {"router_weight": w, "e_score_correction_bias": bias}}, x, method=MoE.routing)
    logits = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    options = dict(scoring="sigmoid", n_group=8, topk_group=4, bias=np.asarray(bias), scale=2.5)
    weights, indices = grouped_router(logits.astype(np.float32), 8, **options)
    assert_routing(got, weights, indices, rtol=1e-5)
    rounded = np.asarray(jnp.asarray(logits, jnp.bfloat16), np.float32)
    assert differs(weights, grouped_router(rounded, 8, **options)[0], rtol=1e-4)


def float32_dots(fn, *args):
    """The precision of every float32 dot_general in ``fn``'s program (nested programs included)."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general" and all(v.aval.dtype == jnp.float32 for v in eqn.invars):
                found.append(eqn.params.get("precision"))
            for value in eqn.params.values():
                for sub in value if isinstance(value, (tuple, list)) else (value,):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        walk(inner)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


def test_router_product_and_combine_ask_for_full_float32():
    # On Ampere and later GPUs XLA runs a float32 dot at TF32 (10 mantissa bits) unless asked for HIGHEST,
    # which moves router logits by ~1e-3 relative. The references route in true float32: transformers'
    # routers under PyTorch's default (no TF32 for matmuls), vLLM's float32 router GEMMs. CPU ignores the
    # setting, so the program is checked instead of its numbers.
    model = MoE(num_experts=8, top_k=2, hidden=16, intermediate=8)
    x = jnp.ones((3, 16))
    variables = model.init(jax.random.key(0), x)
    highest = (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST)
    router = float32_dots(lambda v, t: model.apply(v, t, method=MoE.routing), variables, x)
    assert router == [highest]
    r = route(jnp.ones((3, 8)), 2)
    assert set(float32_dots(combine, jnp.ones((6, 5)), sort_by_expert(r.indices, 8), r.weights)) <= {highest}

# ---- activations ------------------------------------------------------------------------------------------

def activation_inputs(n=4096, seed=18):
    rng = np.random.default_rng(seed)
    return rng.uniform(-12, 12, n).astype(np.float32), rng.uniform(-12, 12, n).astype(np.float32)


def test_gptoss_swiglu_clamps_gate_above_and_up_on_both_sides():
    gate, up = activation_inputs()
    expected = gptoss_swiglu_ref(gate, up)
    np.testing.assert_allclose(np.asarray(gptoss_swiglu(jnp.asarray(gate), jnp.asarray(up))), expected,
                               rtol=2e-6, atol=1e-30)
    # near misses the inputs tell apart: gate clamped below too, no +1, no clamp on up
    assert differs(expected, gptoss_swiglu_ref(np.clip(gate, -7, 7), up), rtol=1e-3)
    assert differs(expected, gptoss_swiglu_ref(gate, up) - np.minimum(gate, 7) * sigmoid(1.702 * np.minimum(gate, 7)))
    assert differs(expected, (up + 1.0) * (np.minimum(gate, 7) * sigmoid(1.702 * np.minimum(gate, 7))))


def test_swiglu_is_silu_of_gate_times_up():
    gate, up = activation_inputs(seed=19)
    np.testing.assert_allclose(np.asarray(swiglu(jnp.asarray(gate), jnp.asarray(up))), silu_mul_ref(gate, up),
                               rtol=2e-6, atol=1e-30)


@pytest.mark.parametrize("name, ref", [("gptoss_swiglu", gptoss_swiglu_ref), ("swiglu", silu_mul_ref)])
def test_bf16_activation_is_rounded_once(name, ref):
    # vLLM's swigluoai_and_mul kernel computes in float32 and rounds the result once (its silu_and_mul
    # rounds silu(gate) first: jquant holds both to one rounding); op-by-op bf16 rounds the sigmoid's
    # argument too, several percent off for very negative gates
    gate, up = (jnp.asarray(v, jnp.bfloat16) for v in activation_inputs(seed=20))
    got = activate(name, gate, up)
    assert got.dtype == jnp.bfloat16
    exact = ref(np.asarray(gate, np.float32), np.asarray(up, np.float32))
    ulp = np.ldexp(1.0, np.floor(np.log2(np.maximum(np.abs(exact), 1e-30))).astype(int) - 7)
    err = np.abs(np.asarray(got, np.float64) - exact)
    assert np.all(err <= 0.5 * ulp * (1 + 1e-3) + 1e-30), f"max error {np.max(err / ulp):.2f} bf16 ulps"



def test_bf16_layer_adds_the_expert_bias_before_rounding():
    # identity experts: the gate/up GEMM gives x exactly, so the layer's output is the activation of
    # x + bias; a bias far below x's bf16 ulp survives only if the sum is not rounded to bf16 first
    e, n = 2, 32
    rng = np.random.default_rng(25)
    x = jnp.asarray(rng.uniform(-6, 6, (8, n)), jnp.bfloat16)
    eye = np.eye(n, dtype=np.float32)
    bias = np.ldexp(rng.uniform(0.5, 1.0, (e, 2 * n)), -8).astype(np.float32)  # about 1/256 to 1/512
    params = {"router_weight": jnp.zeros((e, n), jnp.bfloat16), "router_bias": jnp.zeros(e, jnp.bfloat16),
              "gate_up_proj": jnp.asarray(np.stack([np.concatenate([eye, eye])] * e), jnp.bfloat16),
              "down_proj": jnp.asarray(np.stack([eye] * e), jnp.bfloat16),
              "gate_up_bias": jnp.asarray(bias), "down_bias": jnp.zeros((e, n), jnp.bfloat16)}
    model = MoE(num_experts=e, top_k=1, hidden=n, intermediate=n, router_bias=True, expert_bias=True,
                activation="gptoss_swiglu", dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    got = np.asarray(model.apply({"params": params}, x), np.float64)
    x64 = np.asarray(x, np.float64)
    exact = gptoss_swiglu_ref(x64 + bias[0, :n], x64 + bias[0, n:])  # equal logits: expert 0
    ulp = np.ldexp(1.0, np.floor(np.log2(np.maximum(np.abs(exact), 1e-30))).astype(int) - 7)
    err = np.abs(got - exact)
    assert np.all(err <= 0.5 * ulp * (1 + 1e-3) + 1e-30), f"max error {np.max(err / ulp):.2f} bf16 ulps"

# ---- whole layers -----------------------------------------------------------------------------------------

def gpt_oss_checkpoint(e=8, h=64, i=32, seed=21):
    rng = np.random.default_rng(seed)
    return {
        f"{MODULE}.gate_up_proj_blocks": rng.integers(0, 256, (e, 2 * i, h // 32, 16), dtype=np.uint8),
        f"{MODULE}.gate_up_proj_scales": rng.integers(122, 128, (e, 2 * i, h // 32), dtype=np.uint8),
        f"{MODULE}.gate_up_proj_bias": (rng.standard_normal((e, 2 * i)) * 0.5).astype(ml_dtypes.bfloat16),
        f"{MODULE}.down_proj_blocks": rng.integers(0, 256, (e, h, i // 32, 16), dtype=np.uint8),
        f"{MODULE}.down_proj_scales": rng.integers(122, 128, (e, h, i // 32), dtype=np.uint8),
        f"{MODULE}.down_proj_bias": (rng.standard_normal((e, h)) * 0.5).astype(ml_dtypes.bfloat16),
    }


def gpt_oss_block(tensors, router_w, router_b, x, k, *, swap=False):
    """openai/gpt-oss ``MLPBlock`` without its norm and residual: mlp1 rows interleave gate (even) and up
    (odd), biases on both projections, each expert's output weighted by the router's softmax."""
    w1 = mxfp4_dequant(tensors[f"{MODULE}.gate_up_proj_blocks"], tensors[f"{MODULE}.gate_up_proj_scales"])
    w2 = mxfp4_dequant(tensors[f"{MODULE}.down_proj_blocks"], tensors[f"{MODULE}.down_proj_scales"])
    b1 = np.asarray(tensors[f"{MODULE}.gate_up_proj_bias"], np.float64)
    b2 = np.asarray(tensors[f"{MODULE}.down_proj_bias"], np.float64)
    x = np.asarray(x, np.float64)
    weights, indices = gpt_oss_router(np.asarray(x @ router_w.T + router_b, np.float32), k)
    h1 = np.einsum("tkoh,th->tko", w1[indices], x) + b1[indices]
    glu, lin = (h1[..., 1::2], h1[..., 0::2]) if swap else (h1[..., 0::2], h1[..., 1::2])
    h2 = np.einsum("tkhi,tki->tkh", w2[indices], gptoss_swiglu_ref(glu, lin)) + b2[indices]
    return np.einsum("tkh,tk->th", h2, weights)


def test_gpt_oss_layer_from_checkpoint_tensors():
    e, h, i, k = 8, 64, 32, 4
    tensors = gpt_oss_checkpoint(e, h, i)
    rng = np.random.default_rng(22)
    router_w = (rng.standard_normal((e, h)) * h ** -0.5).astype(np.float32)
    router_b = (rng.standard_normal(e) * 0.1).astype(np.float32)
    x = (rng.standard_normal((16, h)) * 0.1).astype(np.float32)
    experts = expert_params(load_gpt_oss_experts(tensors, MODULE))
    params = {"router_weight": jnp.asarray(router_w), "router_bias": jnp.asarray(router_b), **experts}
    model = MoE(num_experts=e, top_k=k, hidden=h, intermediate=i, router_bias=True, expert_bias=True,
                activation="gptoss_swiglu")
    got = np.asarray(jax.jit(lambda p, v: model.apply({"params": p}, v))(params, jnp.asarray(x)))
    expected = gpt_oss_block(tensors, router_w, router_b, x, k)
    scale = np.abs(expected).max()
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5 * scale)
    # gate and up swapped (odd rows gate) is another answer on these inputs
    assert np.abs(gpt_oss_block(tensors, router_w, router_b, x, k, swap=True) - expected).max() > 1e-2 * scale


def test_deepseek_v3_layer_with_its_shared_expert():
    # transformers' DeepseekV3MoE: the routed experts' weighted sum plus the shared SiLU MLP
    e, h, i, k = 16, 32, 24, 4
    rng = np.random.default_rng(23)
    normal = lambda *shape, scale: (rng.standard_normal(shape) * scale).astype(np.float32)
    p = {"router_weight": normal(e, h, scale=h ** -0.5), "e_score_correction_bias": normal(e, scale=0.3),
         "gate_up_proj": normal(e, 2 * i, h, scale=h ** -0.5), "down_proj": normal(e, h, i, scale=i ** -0.5),
         "shared_expert": {"gate_proj": {"kernel": normal(h, 2 * i, scale=h ** -0.5)},
                           "up_proj": {"kernel": normal(h, 2 * i, scale=h ** -0.5)},
                           "down_proj": {"kernel": normal(2 * i, h, scale=i ** -0.5)}}}
    x = normal(10, h, scale=1.0)
    model = MoE(num_experts=e, top_k=k, hidden=h, intermediate=i, scoring="sigmoid", n_group=4, topk_group=2,
                routed_scaling_factor=2.5, shared_expert=True, shared_intermediate=2 * i)
    got = np.asarray(model.apply({"params": jax.tree.map(jnp.asarray, p)}, jnp.asarray(x)))
    weights, indices = grouped_router(np.asarray(x @ p["router_weight"].T, np.float32), k, scoring="sigmoid",
                                      n_group=4, topk_group=2, bias=p["e_score_correction_bias"], scale=2.5)
    x64 = x.astype(np.float64)
    expected = np.zeros_like(x64)
    for j in range(k):
        w13 = p["gate_up_proj"][indices[:, j]].astype(np.float64)
        gate_up = np.einsum("toh,th->to", w13, x64)
        act = silu_mul_ref(gate_up[:, :i], gate_up[:, i:])
        expected += weights[:, j, None] * np.einsum("thi,ti->th", p["down_proj"][indices[:, j]], act)
    s = {name: v["kernel"].astype(np.float64) for name, v in p["shared_expert"].items()}
    expected += silu_mul_ref(x64 @ s["gate_proj"], x64 @ s["up_proj"]) @ s["down_proj"]
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5 * np.abs(expected).max())
