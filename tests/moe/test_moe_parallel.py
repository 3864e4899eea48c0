"""A MoE layer split over 8 simulated CPU devices (jquant.parallel.moe): expert and tensor parallelism give
the single-device layer's output for float and quantized experts, each device holds the right piece, and
splits the pieces cannot carry are refused with the parameter named."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jquant.flax import quantize_params, quantized_apply
from jquant.kernels.moe import QExperts, W4A16Experts
from jquant.models.moe import MoE
from jquant.parallel import Sharded
from jquant.parallel.moe import MoEParallel, moe_parallel, shard_moe_params
from test_moe_layer import CONFIGS, make_params

pytestmark = pytest.mark.multidevice

# Wide enough to split along the intermediate axis: int4 groups of 32 at 4 devices, 128 × 128 FP8 blocks at 2.
WIDE = dict(num_experts=8, top_k=2, hidden=128, intermediate=256, router_bias=True, expert_bias=True,
            activation="gptoss_swiglu")
LAYERS = {**CONFIGS, "wide": WIDE}
EXPERTS_ONLY = "(gate_up|down)_proj"  # a quantize_params rule for the routed expert stacks alone

CASES = [  # (layer, expert scheme or None for float, mode, devices)
    ("gpt-oss", None, "expert", 2),
    ("gpt-oss", None, "tensor", 4),
    ("gpt-oss", "mxfp4", "expert", 4),
    ("gpt-oss", "int4_g32", "expert", 8),  # one expert a device
    ("deepseek-v3", None, "expert", 4),
    ("deepseek-v3", "fp8_e4m3_block128x128", "expert", 2),
    ("deepseek-v3", "nvfp4", "expert", 2),  # per-expert global scales travel with their experts
    ("deepseek-v3", "int8_ch", "tensor", 2),  # per-channel scales: whole on every device under the K split
    ("wide", "int4_g32", "tensor", 4),
    ("wide", "nvfp4", "tensor", 2),
    ("wide", "fp8_e4m3_block128x128", "tensor", 2),
    ("gpt-oss", "int4_g32", "tensor", 2),  # down_proj's one group of 32 inputs cut in two, its scale on both
    ("wide", "fp8_e4m3_tensor", "tensor", 2),  # one scale for gate and up: each half keeps it
    ("gpt-oss", "fp8_e4m3_tensor", "expert", 4),
]
# A per-tensor dynamic activation scale is each device's own (its rows, or its slice of K), as in vLLM's
# row-parallel and expert-parallel layers: the split layer differs by FP8 rounding, not by a bug.
PER_DEVICE_ACTIVATION_SCALE = ("fp8_e4m3_tensor",)


@functools.cache
def layer(name, scheme, rule=".*"):
    model = MoE(**LAYERS[name])
    params = make_params(model)
    if scheme is not None:  # by default every expert stack and shared-expert kernel (Dense kernels: QParams)
        params, _ = quantize_params(params, [(rule, scheme)], prepare=False)
    return model, {"params": params}


def inputs(name, tokens=6, seed=0):
    return jax.random.normal(jax.random.key(seed), (tokens, LAYERS[name]["hidden"]))


def reference(model, variables, x):
    return jax.jit(lambda v, x: quantized_apply(model, v, x))(variables, x)


def sharded_apply(plan, sharded, x):
    return jax.jit(plan.apply)(sharded, x)


@pytest.mark.parametrize("name,scheme,mode,tp", CASES)
def test_split_layer_equals_the_single_device_layer(name, scheme, mode, tp):
    # Block FP8's activation groups of 128 do not fit a device's 64 shared-expert inputs: experts only.
    model, variables = layer(name, scheme, EXPERTS_ONLY if scheme == "fp8_e4m3_block128x128" else ".*")
    plan = moe_parallel(model, tp, mode=mode)
    sharded = shard_moe_params(plan, variables)
    x = inputs(name)
    want = reference(model, variables, x)
    got = sharded_apply(plan, sharded, x)
    assert got.shape == want.shape and bool(jnp.all(jnp.isfinite(got)))
    if scheme in PER_DEVICE_ACTIVATION_SCALE:
        error = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
        assert error < 0.03, error
    else:  # the same products, summed in another order (per device, then across devices)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4,
                                   atol=1e-4 * float(jnp.abs(want).max()))


def _pieces(leaf):
    """Device i's piece of a Sharded leaf, for every device in mesh order."""
    return [s.data for s in sorted(leaf.addressable_shards, key=lambda s: s.index[0].start or 0)]


def test_expert_split_gives_each_device_its_experts_whole():
    model, variables = layer("deepseek-v3", "nvfp4")
    plan = moe_parallel(model, 4, mode="expert")
    params = shard_moe_params(plan, variables)["params"]
    stack = variables["params"]["down_proj"].weight
    piece = params["down_proj"].pieces
    assert isinstance(params["down_proj"], Sharded) and isinstance(piece, QExperts)
    assert piece.weight.shape == (2, 128, 128)  # one device's two experts
    for leaf in ("data", "scale", "global_scale"):
        for d, part in enumerate(_pieces(getattr(piece.weight, leaf))):
            np.testing.assert_array_equal(np.asarray(part), np.asarray(getattr(stack, leaf))[2 * d:2 * d + 2])
    assert not isinstance(params["router_weight"], Sharded)  # every device routes every token


def test_tensor_split_gives_each_device_its_gate_rows_next_to_its_up_rows():
    model, variables = layer("wide", "int4_g32")
    plan = moe_parallel(model, 4, mode="tensor")
    params = shard_moe_params(plan, variables)["params"]
    i, n = WIDE["intermediate"], 4
    full = np.asarray(variables["params"]["gate_up_proj"].weight.dequantize())
    piece = params["gate_up_proj"].pieces.weight
    assert piece.shape == (8, 2 * i // n, 128)
    rows = [s.data for s in sorted(piece.data.addressable_shards, key=lambda s: s.index[0].start)]
    scales = [s.data for s in sorted(piece.scale.addressable_shards, key=lambda s: s.index[0].start)]
    for d in range(n):
        mine = np.asarray(piece.replace(data=rows[d], scale=scales[d]).dequantize())
        gate, up = full[:, d * i // n:(d + 1) * i // n], full[:, i + d * i // n:i + (d + 1) * i // n]
        np.testing.assert_array_equal(mine, np.concatenate([gate, up], axis=1))
    # The down bias is added once: device 0 holds it, the others zeros.
    biases = _pieces(params["down_bias"].pieces)
    np.testing.assert_array_equal(np.asarray(biases[0]), np.asarray(variables["params"]["down_bias"]))
    assert all(not np.any(np.asarray(b)) for b in biases[1:])


def test_all_tokens_on_one_expert_of_one_device():
    model, variables = layer("gpt-oss", "mxfp4")
    params = dict(variables["params"])
    params["router_bias"] = params["router_bias"].at[5].set(100.0)  # every token's first choice: expert 5
    variables = {"params": params}
    plan = moe_parallel(model, 4, mode="expert")
    x = inputs("gpt-oss", tokens=9)
    want = reference(model, variables, x)
    got = sharded_apply(plan, shard_moe_params(plan, variables), x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4 * float(jnp.abs(want).max()))


@pytest.mark.parametrize("mode", ["expert", "tensor"])
def test_a_nan_token_stays_in_its_row(mode):
    model, variables = layer("gpt-oss", None)
    plan = moe_parallel(model, 2, mode=mode)
    x = inputs("gpt-oss").at[3, 7].set(jnp.nan)
    got = np.asarray(sharded_apply(plan, shard_moe_params(plan, variables), x))
    want = np.asarray(reference(model, variables, x))
    assert np.all(np.isnan(got[3]))
    rest = np.arange(len(x)) != 3
    np.testing.assert_allclose(got[rest], want[rest], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("collectives,bound", [("fp8", 0.05), ("fp8_rs", 0.08)])
def test_fp8_collectives_stay_close_to_the_exact_sum(collectives, bound):
    model, variables = layer("deepseek-v3", None)
    x = inputs("deepseek-v3", tokens=16)
    exact = moe_parallel(model, 4, mode="expert")
    plan = moe_parallel(model, 4, mode="expert", collectives=collectives)
    want = sharded_apply(exact, shard_moe_params(exact, variables), x)
    got = sharded_apply(plan, shard_moe_params(plan, variables), x)
    error = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
    assert 0 < error < bound  # e4m3's 3 mantissa bits: a few % RMS, never exact


def test_plans_that_cannot_split_are_refused():
    model = MoE(**CONFIGS["gpt-oss"])
    with pytest.raises(ValueError, match=r"num_experts \(8\) divisible by 3"):
        moe_parallel(model, 3, mode="expert")
    with pytest.raises(ValueError, match=r"intermediate \(32\) divisible by 3"):
        moe_parallel(model, 3, mode="tensor")
    with pytest.raises(ValueError, match=r"shared_intermediate \(128\) divisible by 3"):
        moe_parallel(MoE(**{**CONFIGS["deepseek-v3"], "num_experts": 6}), 3, mode="expert")
    with pytest.raises(ValueError, match="mode must be one of"):
        moe_parallel(model, 2, mode="data")
    with pytest.raises(ValueError, match="collectives must be one of"):
        moe_parallel(model, 2, collectives="int8")
    with pytest.raises(ValueError, match="already has an expert_axis"):
        moe_parallel(model.clone(expert_axis="tp"), 2)
    with pytest.raises(ValueError, match="needs 16 devices"):
        moe_parallel(model, 16)
    with pytest.raises(TypeError, match="jquant.models.MoE"):
        MoEParallel(object(), moe_parallel(model, 2).mesh)


def test_a_split_through_a_quantization_group_names_the_parameter():
    model = MoE(**{**CONFIGS["gpt-oss"], "intermediate": 96})  # down_proj: three groups of 32 inputs
    params, _ = quantize_params(make_params(model), "int4_g32", prepare=False)
    with pytest.raises(ValueError, match=r"parameter 'down_proj'.*3 quantization blocks of 32: a shard would cut"):
        shard_moe_params(moe_parallel(model, 2, mode="tensor"), {"params": params})


def test_a_split_through_block_fp8_activation_groups_names_the_parameter():
    model, variables = layer("deepseek-v3", "fp8_e4m3_block128x128", EXPERTS_ONLY)  # intermediate 128
    with pytest.raises(ValueError, match=r"parameter 'down_proj'.*groups of 128 along K.*K = 64 of 128"):
        shard_moe_params(moe_parallel(model, 2, mode="tensor"), variables)


def test_a_split_through_an_activation_group_names_the_parameter():
    model, variables = layer("deepseek-v3", "fp8_e4m3_block128x128")  # shared expert: 128 inputs to down_proj
    plan = moe_parallel(model, 2, mode="expert")
    with pytest.raises(ValueError, match=r"'shared_expert/down_proj/kernel'.*groups of 128 along K.*K = 64"):
        shard_moe_params(plan, variables)


def test_stacks_laid_out_for_a_kernel_are_refused():
    model, variables = layer("gpt-oss", "mxfp4")
    params = dict(variables["params"])
    params["down_proj"] = W4A16Experts.from_qexperts(params["down_proj"], interpret=True)
    with pytest.raises(ValueError, match=r"'down_proj' is laid out for a kernel \(W4A16Experts\)"):
        shard_moe_params(moe_parallel(model, 2), {"params": params})
    with pytest.raises(ValueError, match="takes the layer's variables"):
        shard_moe_params(moe_parallel(model, 2), variables["params"])


def test_the_split_layer_runs_under_jit_with_the_plan_closed_over():
    model, variables = layer("gpt-oss", "int4_g32")
    plan = moe_parallel(model, 2, mode="expert")
    sharded = shard_moe_params(plan, variables)
    step = jax.jit(lambda v, x: plan.apply(v, x))
    x = inputs("gpt-oss", tokens=3)
    np.testing.assert_allclose(np.asarray(step(sharded, x)), np.asarray(reference(model, variables, x)),
                               rtol=1e-4, atol=1e-5)
    assert dataclasses.replace(plan, collectives="fp8").collectives == "fp8"
