"""The MoE layer against transformers' DeepSeek-V3 MoE block (tests/goldens/transformers_deepseek_v3.npz,
made by tools/goldens/transformers_deepseek_v3.py): same routing, same output in float32."""

import functools
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from jquant.kernels.moe import route
from jquant.models.moe import MoE

GOLDEN = pathlib.Path(__file__).parents[1] / "goldens" / "transformers_deepseek_v3.npz"

# float32 on both sides; what differs is the summation order of the matmuls and of the expert sum
RTOL = ATOL = 2e-5


@functools.cache
def golden():
    g = dict(np.load(GOLDEN))
    assert any(str(v).startswith("transformers==") for v in g["meta_versions"])
    return g


@functools.cache
def model():
    c = json.loads(str(golden()["config_json"]))
    assert c["hidden_act"] == "silu" and c["norm_topk_prob"]
    return MoE(num_experts=c["n_routed_experts"], top_k=c["num_experts_per_tok"], hidden=c["hidden_size"],
               intermediate=c["moe_intermediate_size"], scoring="sigmoid", n_group=c["n_group"],
               topk_group=c["topk_group"], routed_scaling_factor=c["routed_scaling_factor"], shared_expert=True,
               shared_intermediate=c["moe_intermediate_size"] * c["n_shared_experts"])


def params():
    g = golden()
    f32 = lambda name: jnp.asarray(g[name], jnp.float32)  # the float16-stored weights are exact in float32
    kernel = lambda name: {"kernel": f32(name).T}  # nn.Linear [out, in] -> Dense [in, out]
    return {"router_weight": f32("router_weight"), "e_score_correction_bias": f32("e_score_correction_bias"),
            "gate_up_proj": f32("gate_up_proj"), "down_proj": f32("down_proj"),
            "shared_expert": {"gate_proj": kernel("shared_gate_proj"), "up_proj": kernel("shared_up_proj"),
                              "down_proj": kernel("shared_down_proj")}}


def by_expert(indices, weights):
    """Each token's (indices, weights) ordered by expert id: transformers' top-k is unsorted."""
    order = np.argsort(indices, axis=-1)
    return np.take_along_axis(indices, order, -1), np.take_along_axis(weights, order, -1)


def test_params_are_the_ones_init_gives():
    shapes = jax.eval_shape(model().init, jax.random.key(0), jnp.asarray(golden()["hidden_states"]))["params"]
    got = jax.tree.map(lambda a: (a.shape, a.dtype), params())
    assert got == jax.tree.map(lambda a: (a.shape, a.dtype), shapes)


def test_routing_matches_transformers():
    g = golden()
    r = model().apply({"params": params()}, jnp.asarray(g["hidden_states"]), method=MoE.routing)
    indices, weights = by_expert(np.asarray(r.indices), np.asarray(r.weights))
    want_indices, want_weights = by_expert(g["topk_indices"], g["topk_weights"])
    np.testing.assert_array_equal(indices, want_indices)
    np.testing.assert_allclose(weights, want_weights, rtol=1e-6, atol=1e-6)


def test_output_matches_transformers():
    g = golden()
    y = jax.jit(lambda p, x: model().apply({"params": p}, x))(params(), jnp.asarray(g["hidden_states"]))
    assert y.dtype == jnp.float32 and y.shape == g["output"].shape
    np.testing.assert_allclose(np.asarray(y), g["output"], rtol=RTOL, atol=ATOL)


def test_golden_tells_the_routing_options_apart():
    # Each DeepSeek-V3 routing choice (correction bias, top-two-sum group score, group limit) changes
    # some token's experts here, so the match above pins all three.
    g, m = golden(), model()
    logits, bias = jnp.asarray(g["router_logits"]), jnp.asarray(g["e_score_correction_bias"])
    options = dict(scoring="sigmoid", correction_bias=bias, n_group=m.n_group, topk_group=m.topk_group,
                   routed_scaling_factor=m.routed_scaling_factor)
    chosen = lambda **change: np.sort(np.asarray(route(logits, m.top_k, **{**options, **change}).indices), -1)
    reference = chosen()
    np.testing.assert_array_equal(reference, np.sort(g["topk_indices"], -1))
    for change in (dict(correction_bias=None), dict(group_score="max"), dict(n_group=1, topk_group=1)):
        assert (chosen(**change) != reference).any(axis=-1).any(), change
