"""The MoE layer: float params against a pair-by-pair loop, quantized experts against the float layer
on the dequantized weights, gpt-oss checkpoint experts against transformers' formula, errors."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jquant
from jquant.checkpoint.experts import load_gpt_oss_experts
from jquant.flax import quantize_params, quantized_apply
from jquant.flax import QParam
from jquant.kernels.moe import QExperts, quantize_expert_weights
from jquant.models.moe import MoE, expert_params, quantize_experts
from moe_reference import MODULE, act_loop, gpt_oss_tensors, moe_loop, route_loop

CONFIGS = {
    "gpt-oss": dict(num_experts=8, top_k=4, hidden=64, intermediate=32, router_bias=True, expert_bias=True,
                    activation="gptoss_swiglu"),
    # hidden and intermediate of 128: block FP8's per-token activation groups of 128 along each K
    "deepseek-v3": dict(num_experts=8, top_k=3, hidden=128, intermediate=128, scoring="sigmoid", n_group=4,
                        topk_group=2, routed_scaling_factor=2.5, shared_expert=True),
}


def make_params(model, seed=2):
    """Random float params with every name and shape ``model.init`` gives (biases nonzero)."""
    e, h, i = model.num_experts, model.hidden, model.intermediate
    rng = np.random.default_rng(seed)
    normal = lambda *shape, scale: jnp.asarray(rng.standard_normal(shape) * scale, jnp.float32)
    params = {"router_weight": normal(e, h, scale=h ** -0.5), "gate_up_proj": normal(e, 2 * i, h, scale=h ** -0.5),
              "down_proj": normal(e, h, i, scale=i ** -0.5)}
    if model.router_bias:
        params["router_bias"] = normal(e, scale=0.1)
    if model.scoring == "sigmoid":
        params["e_score_correction_bias"] = normal(e, scale=0.1)
    if model.expert_bias:
        params["gate_up_bias"], params["down_bias"] = normal(e, 2 * i, scale=0.1), normal(e, h, scale=0.1)
    if model.shared_expert:
        params["shared_expert"] = {"gate_proj": {"kernel": normal(h, i, scale=h ** -0.5)},
                                   "up_proj": {"kernel": normal(h, i, scale=h ** -0.5)},
                                   "down_proj": {"kernel": normal(i, h, scale=i ** -0.5)}}
    return params


@functools.cache
def setup(name):
    model = MoE(**CONFIGS[name])
    return model, make_params(model), jax.jit(lambda p, x: model.apply({"params": p}, x))


def inputs(name, shape=(2, 5)):
    return jax.random.normal(jax.random.key(0), shape + (CONFIGS[name]["hidden"],))


@pytest.mark.parametrize("name", CONFIGS)
def test_init_gives_the_documented_params(name):
    model, params, _ = setup(name)
    shapes = jax.eval_shape(model.init, jax.random.key(0), inputs(name))["params"]
    chex.assert_trees_all_equal_shapes_and_dtypes(shapes, params)


def test_correction_bias_is_float32_whatever_the_param_dtype():
    model = MoE(**CONFIGS["deepseek-v3"], param_dtype=jnp.bfloat16)
    shapes = jax.eval_shape(model.init, jax.random.key(0), inputs("deepseek-v3"))["params"]
    assert shapes["e_score_correction_bias"].dtype == jnp.float32
    assert shapes["router_weight"].dtype == jnp.bfloat16


def routing_loop(model, params, x):
    logits = np.asarray(x @ params["router_weight"].T + params.get("router_bias", 0.0), np.float32)
    return route_loop(logits, model.top_k, scoring=model.scoring, correction_bias=params.get("e_score_correction_bias"),
                      n_group=model.n_group, topk_group=model.topk_group, group_score=model.group_score,
                      normalize=model.normalize_weights, routed_scaling_factor=model.routed_scaling_factor)


@pytest.mark.parametrize("name", CONFIGS)
def test_float_layer_is_the_dense_reference(name):
    model, params, apply = setup(name)
    x = inputs(name)
    y = apply(params, x)
    chex.assert_shape(y, x.shape)
    x2 = x.reshape(-1, model.hidden)
    weights, indices = routing_loop(model, params, x2)
    expected = moe_loop(params, x2, weights, indices, activation=model.activation)
    np.testing.assert_allclose(np.asarray(y).reshape(x2.shape), expected, rtol=2e-5, atol=2e-5)
    routing = model.apply({"params": params}, x, method=MoE.routing)  # the layer's own routing, alone
    np.testing.assert_array_equal(np.asarray(routing.indices), indices)
    np.testing.assert_allclose(np.asarray(routing.weights), weights, rtol=1e-6)


def dequantized(qparams):
    """The float params the quantized ones stand for (QExperts and QParam leaves dequantized)."""
    def leaf(q):
        if isinstance(q, QExperts):
            return q.weight.dequantize()
        return q.qtensor.dequantize().T if isinstance(q, QParam) else q  # a Dense kernel is [K, N]
    return jax.tree.map(leaf, qparams, is_leaf=lambda q: isinstance(q, (QExperts, QParam)))


# MXFP4 experts: test_gpt_oss_checkpoint_experts_follow_transformers; block FP8 (DeepSeek): below. NVFP4:
# each expert's own global scale.
@pytest.mark.parametrize("name, scheme", [("gpt-oss", "int4_g32"), ("gpt-oss", "nvfp4")])
def test_quantized_layer_is_the_float_layer_on_dequantized_weights(name, scheme):
    model, params, apply = setup(name)
    x = inputs(name)
    qparams, report = quantize_experts(params, scheme)
    assert report == {"gate_up_proj": scheme, "down_proj": scheme}
    e, i, h = model.num_experts, model.intermediate, model.hidden
    assert isinstance(qparams["gate_up_proj"], QExperts) and qparams["gate_up_proj"].shape == (e, 2 * i, h)
    y = apply(qparams, x)
    chex.assert_trees_all_close(y, apply(dequantized(qparams), x), rtol=1e-6, atol=1e-6)
    assert float(jnp.abs(y - apply(params, x)).max()) > 0


def test_block_fp8_experts_with_a_quantized_shared_expert():
    model, params, apply = setup("deepseek-v3")
    x = inputs("deepseek-v3")
    qparams, _ = quantize_params(params, [(r".*shared_expert/.*kernel", "int4_g32")], prepare=False)
    qparams, report = quantize_experts(qparams, [(r".*down_proj", None), (r".*", "fp8_e4m3_block128x128")])
    assert report == {"gate_up_proj": "fp8_e4m3_block128x128"} and not isinstance(qparams["down_proj"], QExperts)
    y = jax.jit(lambda p, x: quantized_apply(model, {"params": p}, x))(qparams, x)
    # the same weights in float: what remains is block FP8's per-token-group activation quantization
    reference = apply(dequantized(qparams), x)
    assert float(jnp.linalg.norm(y - reference)) < 0.05 * float(jnp.linalg.norm(reference))


def test_gpt_oss_checkpoint_experts_follow_transformers():
    tensors = gpt_oss_tensors(e=8, h=64, i=32)
    model, params, apply = setup("gpt-oss")
    experts = expert_params(load_gpt_oss_experts(tensors, MODULE))
    params = {**params, **experts, "gate_up_bias": experts["gate_up_bias"].astype(jnp.float32),
              "down_bias": experts["down_bias"].astype(jnp.float32)}
    x2 = np.asarray(inputs("gpt-oss").reshape(-1, 64)) * 0.05
    y = np.asarray(apply(params, jnp.asarray(x2)))
    # transformers' GptOssExperts: weights [E, H, 2I] and [E, I, H]; gate the even columns, up the odd
    def deq(proj):
        qt = jquant.from_checkpoint({"blocks": tensors[f"{MODULE}.{proj}_blocks"],
                                     "scales": tensors[f"{MODULE}.{proj}_scales"]}, "gpt-oss")
        return np.asarray(qt.dequantize(), np.float64).transpose(0, 2, 1)
    gate_up_w, down_w = deq("gate_up_proj"), deq("down_proj")
    gate_up_b = np.asarray(tensors[f"{MODULE}.gate_up_proj_bias"], np.float64)
    down_b = np.asarray(tensors[f"{MODULE}.down_proj_bias"], np.float64)
    weights, indices = routing_loop(model, params, jnp.asarray(x2))
    expected = np.zeros(x2.shape)
    for t in range(x2.shape[0]):
        for j, e in enumerate(indices[t]):
            gate_up = x2[t] @ gate_up_w[e] + gate_up_b[e]
            out = act_loop("gptoss_swiglu", gate_up[0::2], gate_up[1::2]) @ down_w[e] + down_b[e]
            expected[t] += weights[t, j] * out
    np.testing.assert_allclose(y, expected, rtol=2e-5, atol=2e-5 * np.abs(expected).max())


def test_one_token():
    model, params, apply = setup("gpt-oss")
    x = inputs("gpt-oss", (1,))
    weights, indices = routing_loop(model, params, x)
    expected = moe_loop(params, x, weights, indices, activation=model.activation)
    np.testing.assert_allclose(np.asarray(apply(params, x)), expected, rtol=2e-5, atol=2e-5)


def test_every_token_on_the_same_experts():
    # a router bias of 1e3 sends every token to experts 5 and 6 (top_k 4: the other two vary), so each
    # of the two holds all T rows of its group
    model, params, apply = setup("gpt-oss")
    params = {**params, "router_bias": jnp.zeros(8).at[5].set(1e3).at[6].set(1e3)}
    x = inputs("gpt-oss")
    x2 = x.reshape(-1, 64)
    weights, indices = routing_loop(model, params, x2)
    assert np.all(np.sort(indices[:, :2], axis=1) == [5, 6])
    expected = moe_loop(params, x2, weights, indices, activation=model.activation)
    np.testing.assert_allclose(np.asarray(apply(params, x)).reshape(x2.shape), expected, rtol=2e-5, atol=2e-5)


def test_wrong_shapes_are_named():
    model, params, _ = setup("gpt-oss")
    x = inputs("gpt-oss", (1,))
    fewer = MoE(**{**CONFIGS["gpt-oss"], "num_experts": 4})
    with pytest.raises(ValueError, match=r"'router_weight' has shape \(8, 64\), expected \[E, H\] = \(4, 64\)"):
        fewer.apply({"params": params}, x)
    bad = {**params, "gate_up_proj": QExperts(quantize_expert_weights(jnp.ones((8, 32, 64)), "mxfp4"),
                                              jquant.get_scheme("mxfp4"))}
    with pytest.raises(ValueError, match=r"'gate_up_proj' has shape \(8, 32, 64\), expected \[E, 2I, H\] = "):
        model.apply({"params": bad}, x)
    with pytest.raises(ValueError, match=r"MoE parameter 'down_bias' is missing"):
        model.apply({"params": {k: v for k, v in params.items() if k != "down_bias"}}, x)
    with pytest.raises(ValueError, match=r"hidden=64 \(the last axis of x\)"):
        model.apply({"params": params}, x[..., :32])
    with pytest.raises(ValueError, match=r"top_k=9 exceeds the number of experts num_experts=8"):
        MoE(**{**CONFIGS["gpt-oss"], "top_k": 9}).apply({"params": params}, x)
    with pytest.raises(ValueError, match="activation must be one of"):
        MoE(**{**CONFIGS["gpt-oss"], "activation": "gelu"}).apply({"params": params}, x)
