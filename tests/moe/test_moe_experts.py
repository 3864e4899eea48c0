"""Stacked expert QTensors: every 4-bit W4A16 format and block FP8, per-expert equality, stack /
unstack / concat / split, errors that name the parameter."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jquant
from jquant.kernels.moe import (QExperts, concat_rows, expert, quantize_expert_weights, split_rows, stack_experts,
                                unstack_experts)
from qtensor_checks import assert_same_qtensor

E, N, K = 3, 16, 128
W = jax.random.normal(jax.random.key(0), (E, N, K), jnp.float32)

# The 4-bit formats the W4A16 kernel decodes, and DeepSeek's block FP8.
SCHEMES = {"int4_g32": "int4", "int4_g128_asym": "uint4", "mxfp4": "mxfp4", "nvfp4": "nvfp4", "nf4": "nf4",
           "fp8_e4m3_block128x128": "fp8_e4m3"}
# Blocks inside one expert and no per-tensor statistic: each expert quantizes as it would alone.
PER_EXPERT = ("int4_g32", "int4_g128_asym", "mxfp4", "nf4", "fp8_e4m3_block128x128")


@pytest.fixture(scope="module")
def stacks():
    return {name: quantize_expert_weights(W, name) for name in SCHEMES}


@pytest.mark.parametrize("name", SCHEMES)
def test_stacked_quantization(stacks, name):
    qt = stacks[name]
    assert qt.fmt == SCHEMES[name] and qt.shape == (E, N, K) and qt.k_axis == 2
    chex.assert_shape(jax.eval_shape(qt.dequantize), (E, N, K))
    if name == "int4_g128_asym":
        assert qt.zero is not None and qt.block == (1, 1, 128)
    if name == "fp8_e4m3_block128x128":
        assert qt.block == (1, 128, 128)


@pytest.mark.parametrize("name", PER_EXPERT)
def test_each_expert_quantizes_as_it_would_alone(stacks, name):
    alone = jquant.get_scheme(name).quantize_weight(W[1])
    if name == "nf4":  # bitsandbytes blocks the flattened tensor: expert 1 is a slice of its blocks
        codes, absmax = alone.data.size, alone.scale.size
        chex.assert_trees_all_equal((stacks[name].data[codes:2 * codes], stacks[name].scale[absmax:2 * absmax]),
                                    (alone.data, alone.scale))
    else:
        assert_same_qtensor(expert(stacks[name], 1), alone)


def test_nvfp4_stack_shares_one_global_scale(stacks):
    qt = stacks["nvfp4"]
    assert qt.global_scale.shape == ()
    alone = jquant.quantize(W[1], "nvfp4", global_scale=qt.global_scale)
    np.testing.assert_array_equal(np.asarray(qt.dequantize()[1]), np.asarray(alone.dequantize()))


@pytest.mark.parametrize("name", ["int4_g32", "mxfp4", "fp8_e4m3_block128x128"])
def test_stack_and_unstack_are_exact(stacks, name):
    qt = stacks[name]
    back = stack_experts(unstack_experts(qt))
    assert_same_qtensor(back, qt)


def test_concat_and_split_rows_are_exact():
    # rows are quantized independently, so quantizing [gate; up] gives the concatenated stacks
    gate, up = W[:2], -W[1:]
    fused = concat_rows([quantize_expert_weights(gate, "int4_g32"), quantize_expert_weights(up, "int4_g32")])
    assert_same_qtensor(fused, quantize_expert_weights(jnp.concatenate([gate, up], 1), "int4_g32"))
    for part, original in zip(split_rows(fused, [N, N]), (gate, up)):
        assert_same_qtensor(part, quantize_expert_weights(original, "int4_g32"))


def test_block_fp8_concat_needs_whole_tiles(stacks):
    w = jax.random.normal(jax.random.key(1), (2, 256, 128))
    fused = concat_rows([quantize_expert_weights(w[:, :128], "fp8_e4m3_block128x128"),
                         quantize_expert_weights(w[:, 128:], "fp8_e4m3_block128x128")])
    assert_same_qtensor(fused, quantize_expert_weights(w, "fp8_e4m3_block128x128"))
    with pytest.raises(ValueError, match="N=16 is not a multiple of the block's 128 rows"):
        concat_rows([stacks["fp8_e4m3_block128x128"]] * 2)


def test_errors_name_the_parameter(stacks):
    with pytest.raises(ValueError, match=r"gate_up must be stacked expert weights \[E, N, K\] \(3-D\), got"):
        quantize_expert_weights(W[0], "mxfp4", name="gate_up")
    with pytest.raises(TypeError, match=r"w must be a floating array"):
        quantize_expert_weights(jnp.ones((2, 4, 32), jnp.int32), "mxfp4")
    with pytest.raises(ValueError, match=r"w \(3, 16, 120\) cannot be quantized with scheme 'mxfp4'"):
        quantize_expert_weights(W[:, :, :120], "mxfp4")
    with pytest.raises(ValueError, match="experts\\[1\\] .* differs from experts\\[0\\]"):
        stack_experts([expert(stacks["int4_g32"], 0), expert(stacks["int4_g128_asym"], 1)])
    with pytest.raises(ValueError, match="e=3 is out of range for 3 experts"):
        expert(stacks["int4_g32"], 3)
    with pytest.raises(ValueError, match="scheme 'int4_g32' runs 'int4' weights, got a 'mxfp4' stack"):
        QExperts(stacks["mxfp4"], jquant.get_scheme("int4_g32"))
    with pytest.raises(ValueError, match=r"QExperts.weight must be a stacked expert QTensor \[E, N, K\] \(3-D\)"):
        QExperts(expert(stacks["mxfp4"], 0), jquant.get_scheme("mxfp4"))


def test_qexperts_is_a_pytree(stacks):
    q = QExperts(stacks["mxfp4"], jquant.get_scheme("mxfp4"))
    leaves, treedef = jax.tree.flatten(q)
    assert len(leaves) == 2 and jax.tree.unflatten(treedef, leaves).scheme.name == "mxfp4"
    assert q.num_experts == E and q.shape == (E, N, K)
