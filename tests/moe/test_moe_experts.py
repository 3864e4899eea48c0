"""Stacked expert QTensors: every 4-bit W4A16 format and block FP8, per-expert equality (NVFP4's global
scale and per-tensor FP8's scale per expert included), stack / unstack / concat / split, errors that
name the parameter."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jquant
from jquant.formats import quantize
from jquant.kernels.moe import (QExperts, concat_rows, expert, grouped_matmul, quantize_expert_weights, split_rows,
                                stack_experts, unstack_experts)
from jquant.schemes.builtin import nvfp4
from qtensor_checks import assert_same_qtensor

E, N, K = 3, 16, 128
W = jax.random.normal(jax.random.key(0), (E, N, K), jnp.float32)

# The 4-bit formats the W4A16 kernel decodes, and DeepSeek's block FP8.
SCHEMES = {"int4_g32": "int4", "int4_g128_asym": "uint4", "mxfp4": "mxfp4", "nvfp4": "nvfp4", "nf4": "nf4",
           "fp8_e4m3_block128x128": "fp8_e4m3"}
# Blocks inside one expert, per-tensor statistics per expert: each expert quantizes as it would alone.
PER_EXPERT = ("int4_g32", "int4_g128_asym", "mxfp4", "nvfp4", "nf4", "fp8_e4m3_block128x128")


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


# Experts four orders of magnitude apart, and a fourth all zeros.
SCALES = jnp.array([1e-3, 1.0, 1e3, 0.0])
W_SPREAD = jax.random.normal(jax.random.key(3), (4, N, K)) * SCALES[:, None, None]


@pytest.mark.parametrize("scheme", [nvfp4(), nvfp4("modelopt"), jquant.get_scheme("fp8_e4m3_tensor")],
                         ids=["nvfp4-compressed-tensors", "nvfp4-modelopt", "fp8-tensor"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
def test_per_tensor_statistics_are_per_expert(scheme, dtype):
    w = W_SPREAD.astype(dtype)
    qt = quantize_expert_weights(w, scheme)
    per_expert = qt.global_scale if scheme.weight.format == "nvfp4" else qt.scale
    chex.assert_shape(per_expert, (4, 1, 1))
    if scheme.weight.format != "nvfp4":
        assert qt.block == (1, N, K)
    for e in range(4):  # bit for bit what the expert gives alone, under jit too
        assert_same_qtensor(expert(qt, e), scheme.quantize_weight(w[e]))
    assert_same_qtensor(jax.jit(quantize_expert_weights, static_argnums=1)(w, scheme), qt)
    assert_same_qtensor(stack_experts(unstack_experts(qt)), qt)


def test_nvfp4_experts_of_very_different_magnitudes_each_keep_their_precision():
    x = jax.random.normal(jax.random.key(4), (12, K))
    sizes = jnp.array([3, 3, 3, 3], jnp.int32)
    rows = np.repeat(np.arange(4), 3)

    def rel_errors(stack):
        y, ref = grouped_matmul(x, stack, sizes), grouped_matmul(x, W_SPREAD, sizes)
        err = jnp.linalg.norm(y - ref, axis=1) / jnp.maximum(jnp.linalg.norm(ref, axis=1), 1e-30)
        return [float(err[rows == e].max()) for e in range(3)]

    own = quantize_expert_weights(W_SPREAD, "nvfp4")
    assert max(rel_errors(own)) < 0.15  # FP4: a few % for every expert
    assert not np.any(np.asarray(own.dequantize()[3]))  # the zero expert stays zero
    # One global scale for the whole stack (the amax of expert 2): expert 0's block scales fall below
    # E4M3's range and it is lost.
    shared = quantize(W_SPREAD, "nvfp4", axis=2).replace(k_axis=2)
    assert shared.global_scale.shape == ()
    errors = rel_errors(shared)
    assert errors[0] > 0.5 and max(errors[1:]) < 0.15


def test_stacked_global_scales_are_checked_and_concatenated_per_expert():
    gate = quantize_expert_weights(W_SPREAD, "nvfp4")
    up = quantize_expert_weights(-2 * W_SPREAD, "nvfp4")  # other magnitudes: other global scales
    with pytest.raises(ValueError, match=r"other per-tensor global scales than parts\[0\] \(experts \[0, 1, 2\]\)"):
        concat_rows([gate, up])
    fused = concat_rows([gate, quantize_expert_weights(-W_SPREAD, "nvfp4")])  # negated: the same amaxes
    chex.assert_trees_all_equal(split_rows(fused, [N, N])[0], gate)
    with pytest.raises(ValueError, match=r"global scale of shape \(4,\); a stack holds one per expert"):
        QExperts(gate.replace(global_scale=gate.global_scale.reshape(4)), jquant.get_scheme("nvfp4"))


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
