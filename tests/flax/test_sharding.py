"""Tensor-parallel quantized forward on 8 simulated CPU devices equals the single-device one (up to
summation order, and for W8A8 up to the activation roundings that order can flip)."""

import chex
import jax
import numpy as np
import pytest
from jax.sharding import Mesh

import jquant
from jquant.models.llama import LlamaConfig, LlamaForCausalLM
from jquant.flax import QParam, quantize_params, quantized_apply
from jquant.flax.sharding import shard_tensor_parallel

pytestmark = pytest.mark.multidevice   # tensor parallelism over the 8 simulated devices

CONFIG = LlamaConfig(vocab_size=96, hidden_size=512, intermediate_size=1024, num_layers=2, num_heads=8,
                     num_kv_heads=4, head_dim=64, rms_norm_eps=1e-5, rope_theta=10000.0,
                     max_position_embeddings=64, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def model_and_params():
    model = LlamaForCausalLM(CONFIG)
    ids = jax.random.randint(jax.random.key(0), (2, 12), 0, CONFIG.vocab_size)
    params = model.init(jax.random.key(1), ids)["params"]
    return model, params, ids


def _mesh(n):
    devices = jax.devices()
    assert len(devices) >= n, "conftest sets --xla_force_host_platform_device_count=8"
    return Mesh(np.array(devices[:n]), ("tp",))


@pytest.mark.parametrize("scheme", ["int4_g64", "int8_ch", "nvfp4", "fp8_e4m3_channel"])
def test_sharded_forward_matches_single_device(model_and_params, scheme):
    model, params, ids = model_and_params
    qparams, _ = quantize_params(params, [(r".*_proj/kernel", scheme)])
    fwd = jax.jit(lambda p, i: quantized_apply(model, {"params": p}, i)[0])
    single = fwd(qparams, ids)
    sharded_params = shard_tensor_parallel(qparams, _mesh(8))
    q_proj = sharded_params["layers_0"]["q_proj"]["kernel"]
    assert isinstance(q_proj, QParam)
    data = q_proj.qtensor.data
    assert data.sharding.spec[0] == "tp" and data.addressable_shards[0].data.shape[0] == data.shape[0] // 8
    down = sharded_params["layers_0"]["down_proj"]["kernel"].qtensor
    assert down.data.sharding.spec[1] == "tp"
    sharded = fwd(sharded_params, ids)
    if jquant.get_scheme(scheme).weight_only:
        chex.assert_trees_all_close(sharded, single, rtol=1e-5, atol=1e-5)
    else:
        # W8A8 quantizes activations per token at run time: the sharded sums' different order can
        # move one activation across an fp8 rounding boundary, which changes that token's logits
        # by about one fp8 step (seen: 1 of 24 tokens, max 0.014). Everything else must agree.
        diff = np.abs(np.asarray(sharded) - np.asarray(single))
        tokens_off = (diff.max(axis=-1) > 1e-5 + 1e-5 * np.abs(np.asarray(single)).max(axis=-1))
        assert tokens_off.sum() <= 2 and diff.max() < 0.05, (tokens_off.sum(), diff.max())
        np.testing.assert_array_equal(np.argmax(sharded, -1), np.argmax(single, -1))


def test_split_group_is_refused_with_the_path(model_and_params):
    _, params, _ = model_and_params
    # o_proj has K=512: groups of 128 give 4 groups, which 8 shards would cut.
    qparams, _ = quantize_params(params, [(r".*o_proj/kernel", "int4_g128")], strict=True)
    with pytest.raises(ValueError, match=r"layers_0/o_proj/kernel.*cut a block"):
        shard_tensor_parallel(qparams, _mesh(8))


def test_float_params_shard_too(model_and_params):
    model, params, ids = model_and_params
    sharded = shard_tensor_parallel(params, _mesh(4))
    assert sharded["layers_1"]["up_proj"]["kernel"].sharding.spec == jax.sharding.PartitionSpec(None, "tp")
    chex.assert_trees_all_close(model.apply({"params": sharded}, ids)[0], model.apply({"params": params}, ids)[0],
                                rtol=1e-5, atol=1e-5)
