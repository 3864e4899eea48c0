"""Expert slots: the slot table, the gathers into and out of the slot layout, and the MoE layer running
both expert GEMMs over one slot layout (``chains``), bit for bit what the two separate grouped GEMMs
give. JQUANT_TEST_GPU=1 runs the kernels on the GPU."""

import hypothesis.strategies as st
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

from conftest import ON_GPU
from cuda_lowering import lower_for_cuda
from jquant.kernels.moe import Fp8Experts, QExperts, W4A16Experts
from jquant.kernels.moe.slots import SeparateGemms, Slots, chains, slot_table
from jquant.models.moe import MoE, quantize_experts


@settings(max_examples=8)
@given(sizes=st.lists(st.integers(0, 40), min_size=1, max_size=9), extra=st.integers(0, 5),
       block_m=st.sampled_from([8, 16]))
def test_slot_table_places_every_row_once_with_its_expert(sizes, extra, block_m):
    rows = max(1, sum(sizes) + extra)
    ids, counts, first, where = (np.asarray(a) for a in slot_table(jnp.asarray(sizes, jnp.int32), rows, block_m))
    expert_of_row = np.repeat(np.arange(len(sizes)), sizes)
    placed = where[where >= 0]
    assert len(placed) == sum(sizes) and len(set(placed.tolist())) == sum(sizes)   # one place each
    assert (where[sum(sizes):] == -1).all()                                          # past the groups
    slot, pos = placed // block_m, placed % block_m
    assert (ids[slot] == expert_of_row).all() and (pos < counts[slot]).all()
    assert (first[slot] + pos == np.arange(sum(sizes))).all()
    assert counts.sum() == sum(sizes) and (counts <= block_m).all()


@settings(max_examples=10, deadline=None)
@given(sizes=st.lists(st.integers(0, 30), min_size=1, max_size=6), extra=st.integers(0, 4),
       block_m=st.sampled_from([8, 64]))
def test_take_then_rows_returns_the_groups_and_zeros_past_them(sizes, extra, block_m):
    rows = max(1, sum(sizes) + extra)
    slots = Slots.plan(jnp.asarray(sizes, jnp.int32), rows, block_m)
    x = jnp.asarray(np.random.default_rng().standard_normal((rows, 3)) + 5, jnp.bfloat16)   # never 0
    xs = slots.take(x)
    live = np.asarray(slots.live())
    assert xs.shape == (slots.size, 3) and live.sum() == sum(sizes)
    assert not np.asarray(xs)[~live].any() and np.asarray(xs)[live].all()
    back = np.asarray(slots.rows(xs))
    np.testing.assert_array_equal(back[:sum(sizes)], np.asarray(x)[:sum(sizes)])
    assert not back[sum(sizes):].any()
    expert_of_row = np.repeat(np.arange(len(sizes)), sizes)
    np.testing.assert_array_equal(np.asarray(slots.row_experts())[np.asarray(slots.where)[:sum(sizes)]],
                                  expert_of_row)


def test_take_refuses_other_rows():
    slots = Slots.plan(jnp.array([2, 3]), rows=6, block_m=8)
    with pytest.raises(ValueError, match="5 rows, the slots were planned for 6"):
        slots.take(jnp.ones((5, 4)))


def _layer_params(rng, e, h, i, bias):
    params = {"router_weight": jnp.asarray(rng.standard_normal((e, h)) * 0.1, jnp.float32),
              "gate_up_proj": jnp.asarray(rng.standard_normal((e, 2 * i, h)) * 0.1, jnp.float32),
              "down_proj": jnp.asarray(rng.standard_normal((e, h, i)) * 0.1, jnp.float32)}
    if bias:
        params |= {"router_bias": jnp.asarray(rng.standard_normal(e), jnp.float32),
                   "gate_up_bias": jnp.asarray(rng.standard_normal((e, 2 * i)), jnp.float32),
                   "down_bias": jnp.asarray(rng.standard_normal((e, h)), jnp.float32)}
    return params


@pytest.mark.parametrize("fmt,activation,tokens", [("mxfp4", "gptoss_swiglu", 5), ("int4_g32", "swiglu", 40),
                                                   ("fp8_e4m3_block128x128", "swiglu", 7),
                                                   ("fp8_e4m3_channel", "gptoss_swiglu", 6)])
def test_layer_in_one_slot_layout_is_the_separate_gemms_bit_for_bit(fmt, activation, tokens, interpret):
    """Expert biases (a zero slot row gets its expert's bias, then the activation: those rows must not
    reach the down projection), experts left empty by the routing, slots of 8 and 16 rows (4-bit) or
    64 (FP8)."""
    e, h, i = 6, 128, 128
    gptoss = activation == "gptoss_swiglu"
    model = MoE(num_experts=e, top_k=2, hidden=h, intermediate=i, router_bias=gptoss, expert_bias=gptoss,
                activation=activation)
    rng = np.random.default_rng()
    params = _layer_params(rng, e, h, i, gptoss)
    params["router_weight"] = params["router_weight"].at[:2].add(1.0)   # experts 2-5 take few or no rows
    qparams, _ = quantize_experts(params, fmt)
    kernel = Fp8Experts if fmt.startswith("fp8") else W4A16Experts
    fast = {k: kernel.from_qexperts(v, interpret=interpret) if isinstance(v, QExperts) else v
            for k, v in qparams.items()}
    assert chains(fast["gate_up_proj"], fast["down_proj"], tokens * 2)
    separate = {k: SeparateGemms(v) if isinstance(v, kernel) else v for k, v in fast.items()}
    x = jnp.asarray(rng.standard_normal((tokens, h)), jnp.bfloat16)
    y = np.asarray(model.apply({"params": fast}, x).astype(jnp.float32))
    ref = np.asarray(model.apply({"params": separate}, x).astype(jnp.float32))
    np.testing.assert_array_equal(y, ref)
    assert np.isfinite(y).all() and np.abs(y).max() > 0


def test_what_does_not_chain():
    rng = np.random.default_rng(0)
    params = _layer_params(rng, 4, 128, 128, False)
    fp8 = {fmt: quantize_experts(params, fmt)[0] for fmt in ("fp8_e4m3_block128x128", "fp8_e4m3_tensor")}
    block = [Fp8Experts.from_qexperts(fp8["fp8_e4m3_block128x128"][k], interpret=True)
             for k in ("gate_up_proj", "down_proj")]
    tensor = [Fp8Experts.from_qexperts(fp8["fp8_e4m3_tensor"][k], interpret=True) for k in ("gate_up_proj", "down_proj")]
    w4 = W4A16Experts.from_qexperts(quantize_experts(params, "int4_g32")[0]["down_proj"], interpret=True)
    assert chains(*block, 8)
    # a per-tensor activation scale spans every row: the slots' zero rows and the rows past the groups differ
    assert tensor[0].scheme.activation.mode == "dynamic_per_tensor" and not chains(*tensor, 8)
    assert not chains(fp8["fp8_e4m3_block128x128"]["gate_up_proj"], block[1], 8)   # XLA's reference: no slots
    assert w4.slot_rows(8) != block[1].slot_rows(8) and not chains(w4, block[1], 8)   # other heights


@pytest.mark.skipif(ON_GPU, reason="the GPU run compiles for real")
def test_one_slot_layout_lowers_with_fewer_gathers():
    """The layer on experts that run over slots takes the one-slot-layout path: no gather of the gate/up
    result back to rows, none of the activations into slots again, one slot table (18 StableHLO gathers
    against the separate GEMMs' 32 here, sm_90; XLA fuses either into 19-20 GPU kernels a call on the
    H100, bench/results/h100/moe_slots_profile.md)."""
    e, h, i = 32, 256, 256
    model = MoE(num_experts=e, top_k=4, hidden=h, intermediate=i)
    qparams, _ = quantize_experts(_layer_params(np.random.default_rng(0), e, h, i, False), "mxfp4")
    fast = {k: W4A16Experts.from_qexperts(v) if isinstance(v, QExperts) else v for k, v in qparams.items()}
    separate = {k: SeparateGemms(v) if isinstance(v, W4A16Experts) else v for k, v in fast.items()}
    gathers = [lower_for_cuda(lambda x, p=p: model.apply({"params": p}, x),
                              jnp.ones((1, h), jnp.bfloat16)).count("stablehlo.gather") for p in (fast, separate)]
    assert gathers[0] < gathers[1], gathers
