"""Tensor-parallel Llama decode over the paged KV cache (jquant.parallel) on 8 simulated CPU devices: the
sharded step gives the single-device logits and cache, generate() the same tokens, bad splits fail clearly."""

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from jquant.flax import QParam, quantize_params, quantized_apply
from jquant.models.llama import LlamaConfig, LlamaForCausalLM, generate as generate_one, new_cache
from jquant.parallel import Sharded, TensorParallel, decode_step, generate, shard_cache, shard_params, tensor_parallel

pytestmark = pytest.mark.multidevice   # tensor parallelism over the 8 simulated devices

# 16 query / 8 KV heads of 16: every tp up to 8 splits them (GQA 2 per device); int4 groups of 32 fit
# o_proj's and down_proj's 256 / 8 = 32 inputs a device.
CONFIG = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=256, num_layers=2, num_heads=16,
                     num_kv_heads=8, head_dim=16, rope_theta=1e4, rms_norm_eps=1e-5, max_position_embeddings=64)
MODEL = LlamaForCausalLM(CONFIG)
KV = {"bf16": "bf16", "fp8": "fp8", "int8": "int8_per_token_head"}
PROMPT, PAGE = 5, 4


@pytest.fixture(scope="module")
def weights():
    @jax.jit  # one compilation for what would be many small eager ones
    def make(key):
        params = MODEL.init(key, jnp.zeros((1, 1), jnp.int32))["params"]
        params = jax.tree.map(lambda a: 3.0 * a, params)  # larger than init's, so attention is not uniform
        return params, jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
    params, bf16 = make(jax.random.key(0, impl="rbg"))  # rbg: XLA compiles it far faster on CPU
    int4 = jax.jit(lambda p: quantize_params(p, [(r".*_proj/kernel", "int4_g32")], prepare=False)[0])(params)
    return {"bf16": {"params": bf16}, "int4": {"params": int4}}


def _ids(batch, length, seed):
    return jnp.asarray(np.random.default_rng(seed).integers(0, CONFIG.vocab_size, (batch, length)), jnp.int32)


@functools.partial(jax.jit, static_argnames=("plan", "kv"))
def _both(plan, variables, sharded, ids, kv):
    """A prefill on one device, then each remaining token decoded on one device and, from the same
    prefilled cache, tensor-parallel: (single-device logits, tensor-parallel logits, both final caches).
    One jit for both keeps the test to one compilation per case."""
    cache = new_cache(MODEL, ids.shape[0], 16, kv, page_size=PAGE)
    _, cache = quantized_apply(MODEL, variables, ids[:, :PROMPT], cache)
    ref_cache, tp_cache, want, got = cache, cache, [], []
    for t in range(PROMPT, ids.shape[1]):
        logits, ref_cache = quantized_apply(MODEL, variables, ids[:, t:t + 1], ref_cache)
        want.append(logits)
        logits, tp_cache = plan.apply(sharded, ids[:, t:t + 1], tp_cache)
        got.append(logits)
    return want, got, ref_cache, tp_cache


CASES = [  # (weights, KV cache, tp, fused q/k/v + gate/up, vocab-parallel): each weight kind, KV dtype and tp
    ("bf16", "bf16", 2, False, True),
    ("bf16", "int8", 8, True, False),
    ("int4", "fp8", 4, True, True),
    ("int4", "bf16", 8, True, True),
]


@pytest.mark.parametrize("weights_name, kv, tp, fused, vocab_parallel", CASES)
def test_sharded_decode_equals_single_device(weights, weights_name, kv, tp, fused, vocab_parallel):
    variables = weights[weights_name]
    plan = tensor_parallel(MODEL.clone(fused_projections=fused), tp, vocab_parallel=vocab_parallel)
    sharded = shard_params(plan, variables)
    layer = sharded["params"]["layers_0"]
    down = layer["down_proj"]["kernel"]
    assert isinstance(down, Sharded) and ("qkv_proj" in layer) == fused
    assert isinstance(sharded["params"]["embed_tokens"]["embedding"], Sharded) == vocab_parallel
    if weights_name == "int4":  # each device's piece is a QParam of its own shape, its scales with its codes
        qt = down.pieces.qtensor
        assert isinstance(down.pieces, QParam) and qt.shape == (CONFIG.hidden_size, CONFIG.intermediate_size // tp)
        k = CONFIG.intermediate_size // tp  # each device's inputs: two codes a byte, a scale per 32
        for leaf, per_row in ((qt.data, k // 2), (qt.scale, k // 32)):
            assert leaf.sharding.spec[0] == "tp" and leaf.shape == (tp * CONFIG.hidden_size, per_row)
            assert leaf.addressable_shards[0].data.shape == (CONFIG.hidden_size, per_row)

    want, got, ref_cache, tp_cache = _both(plan, variables, sharded, _ids(3, PROMPT + 2, tp), KV[kv])
    assert np.abs(np.asarray(want[-1])).max() > 1.0  # logits of a working model, not zeros
    np.testing.assert_array_equal(np.asarray(tp_cache.lengths), PROMPT + 2)
    # The pages each device wrote are the single-device pages of its heads, but for a rare rounding flip.
    for a, b in zip(jax.tree.leaves(tp_cache.layers), jax.tree.leaves(ref_cache.layers)):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.isclose(a, b, rtol=1e-2, atol=1e-2).mean() > 0.999
    # float32 sums in another order (the row-parallel and vocab-parallel sums), compounding over the layers:
    # relative to the logits' range, since XLA's CPU dots sum in an order that depends on the machine's
    # vector width (int4, tp = 8: 1.4e-5 of a range of 28 on an AVX-512 Xeon, under 3.6e-6 elsewhere).
    top = float(np.abs(np.asarray(want)).max())
    chex.assert_trees_all_close(got, want, atol=5e-5 * top, rtol=1e-4)


def test_sharded_cache_and_donated_steps(weights):
    """``shard_cache`` splits every page array on its KV heads, ``decode_step`` updates it in place."""
    plan = tensor_parallel(MODEL, 4)
    cache = shard_cache(plan, new_cache(MODEL, 2, 16, "int8_per_token_head", page_size=PAGE))
    for leaf in (cache.layers[1].k_pages, cache.layers[1].v_scale):
        assert leaf.sharding.spec[2] == "tp" and leaf.addressable_shards[0].data.shape[2] == CONFIG.num_kv_heads // 4
    assert cache.block_tables.sharding.is_fully_replicated
    sharded, ids = shard_params(plan, weights["bf16"]), _ids(2, 2, 5)
    _, cache = decode_step(plan, sharded, ids[:, :1], cache)
    logits, new = decode_step(plan, sharded, ids[:, 1:], cache)
    assert cache.layers[0].k_pages.is_deleted()  # donated
    assert new.layers[0].k_pages.sharding.spec[2] == "tp" and np.asarray(new.lengths).tolist() == [2, 2]
    assert logits.shape == (2, 1, CONFIG.vocab_size) and np.isfinite(np.asarray(logits)).all()


def test_the_dense_cache_splits_on_its_heads_and_decodes_as_on_one_device(weights):
    """The dense ``KVCache`` [B, Hkv, L, D] splits on axis 1; tensor-parallel steps over it give the
    single-device logits and cache."""
    plan, variables, ids = tensor_parallel(MODEL, 4), weights["bf16"], _ids(2, 3, 7)
    want_cache = new_cache(MODEL, 2, 16)
    cache = shard_cache(plan, want_cache)
    for leaf in (cache.keys[1], cache.values[0]):
        assert leaf.sharding.spec[1] == "tp" and leaf.addressable_shards[0].data.shape[1] == CONFIG.num_kv_heads // 4
    sharded, single = shard_params(plan, variables), jax.jit(functools.partial(quantized_apply, MODEL))
    for t in range(ids.shape[1]):
        want, want_cache = single(variables, ids[:, t:t + 1], want_cache)
        got, cache = decode_step(plan, sharded, ids[:, t:t + 1], cache)
    assert int(cache.length) == 3 and cache.keys[0].sharding.spec[1] == "tp"
    top = float(np.abs(np.asarray(want)).max())
    chex.assert_trees_all_close(got, want, atol=5e-5 * top, rtol=1e-4)
    chex.assert_trees_all_close((cache.keys, cache.values), (want_cache.keys, want_cache.values), atol=1e-5, rtol=1e-4)


def test_generate_under_tensor_parallelism_gives_the_same_tokens(weights):
    model = MODEL.clone(fused_projections=True)
    ids = _ids(2, 6, 3)
    plan = tensor_parallel(model, 4)
    options = dict(kv_cache_dtype="int8_per_token_head", page_size=PAGE)
    got = generate(plan, shard_params(plan, weights["bf16"]), ids, 4, **options)
    want = generate_one(MODEL, weights["bf16"], ids, 4, **options)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert len(np.unique(np.asarray(want))) > 1  # a real sequence, not one token repeated


# ---- bad input -----------------------------------------------------------------------------------


@pytest.mark.parametrize("change, tp, match", [
    (dict(num_heads=12, num_kv_heads=4), 8, r"num_heads \(12\) divisible by 8"),
    (dict(num_kv_heads=4), 8, r"num_kv_heads \(4\) divisible by 8"),
    (dict(intermediate_size=100), 8, r"intermediate_size \(100\) divisible by 8"),
    (dict(vocab_size=100), 8, r"vocab_size \(100\) divisible by 8 \(or vocab_parallel=False\)"),
    ({}, 16, r"tensor parallelism 16 needs 16 devices; there are 8"),
    ({}, 0, r"tp must be a positive int"),
])
def test_splits_that_do_not_divide_are_refused(change, tp, match):
    model = LlamaForCausalLM(dataclasses.replace(CONFIG, **change))
    with pytest.raises(ValueError, match=match):
        tensor_parallel(model, tp)


def test_bad_plans_and_params_are_refused(weights):
    mesh = Mesh(np.array(jax.devices()[:2]), ("model",))
    with pytest.raises(ValueError, match=r"the mesh must have the one axis 'tp'"):
        TensorParallel(MODEL, mesh)
    with pytest.raises(ValueError, match=r"collectives must be one of \('psum', 'fp8', 'fp8_rs'\)"):
        tensor_parallel(MODEL, 2, collectives="int8")
    with pytest.raises(ValueError, match=r"hidden_size \(36\) divisible by 8"):  # fp8_rs chunks the hidden axis
        tensor_parallel(LlamaForCausalLM(dataclasses.replace(CONFIG, hidden_size=36)), 8,
                        collectives="fp8_rs")
    from jquant.models.fused import fuse_projections
    with pytest.raises(ValueError, match=r"separate q/k/v and gate/up kernels.*layers_0/gate_up_proj/kernel"):
        shard_params(tensor_parallel(MODEL, 2), fuse_projections(weights["bf16"]))
    # int4 groups of 32 along o_proj's 256 inputs: 16 devices' worth of 16 would cut a group (on 8 it fits,
    # so check the group rule with groups of 64 there).
    int4_g64, _ = quantize_params(weights["bf16"]["params"], [(r".*o_proj/kernel", "int4_g64")], prepare=False)
    with pytest.raises(ValueError, match=r"layers_0/o_proj/kernel.*cut a block"):
        shard_params(tensor_parallel(MODEL, 8), {"params": int4_g64})


def test_a_row_split_through_block_fp8_activation_groups_is_refused():
    # down_proj's 128 inputs over 2 devices: 64 each. The weight's one 128 × 128 block cut in two keeps
    # its scale on both sides (exact), but a token's group of 128 inputs cannot be cut.
    model = LlamaForCausalLM(dataclasses.replace(CONFIG, intermediate_size=128, num_layers=1))
    params = model.init(jax.random.key(0, impl="rbg"), jnp.zeros((1, 1), jnp.int32))["params"]
    fp8, _ = quantize_params(params, [(r".*down_proj/kernel", "fp8_e4m3_block128x128")], prepare=False)
    with pytest.raises(ValueError, match=r"layers_0/down_proj/kernel.*groups of 128 along K.*K = 64 of 128"):
        shard_params(tensor_parallel(model, 2), {"params": fp8})
