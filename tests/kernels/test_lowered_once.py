"""A program that calls a kernel many times with the same shapes (a model's layers) lowers it once:
Mosaic GPU and Triton lower in Python at every call site otherwise (``jquant.kernels.lowered_once``)."""

import re
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import ON_GPU
from cuda_lowering import lower_for_cuda
from w4_inputs import random_w4_weight
from jquant.kernels.w4a16 import prepack_nk
from jquant.kernels.w4a16.mosaic_gpu import w4a16_mgpu_matmul
from jquant.models.llama import LlamaConfig, LlamaForCausalLM, new_cache
from jquant.schemes import dispatch

pytestmark = pytest.mark.skipif(ON_GPU, reason="lowers for CUDA from the CPU")


def _custom_calls(text: str, target: str) -> int:
    return len(re.findall(r"custom_call @" + re.escape(target) + r"\b", text))


def test_w4a16_gemms_of_one_shape_lower_to_one_kernel():
    rng = np.random.default_rng()
    weights = [prepack_nk(*random_w4_weight(rng, 256, n, 128)[:2], group_size=128) for n in (256, 256, 256, 384)]

    def layers(x, ws):
        return [w4a16_mgpu_matmul(x, w) for w in ws]

    x = jnp.zeros((1, 256), jnp.bfloat16)
    text = jax.export.export(jax.jit(layers), platforms=["cuda"])(x, weights).mlir_module()
    assert _custom_calls(text, "mosaic_gpu_v2") == 2   # N = 256 three times, N = 384 once


@pytest.mark.parametrize("num_layers", [1, 5])
def test_a_paged_decode_step_lowers_its_attention_and_insert_kernels_once(num_layers):
    config = LlamaConfig(vocab_size=97, hidden_size=128, intermediate_size=96, num_layers=num_layers,
                         num_heads=4, num_kv_heads=2, head_dim=64, rope_theta=1e4, rms_norm_eps=1e-5,
                         max_position_embeddings=128)
    model = LlamaForCausalLM(config, dtype=jnp.bfloat16)
    params = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 1), jnp.int32))
    cache = jax.eval_shape(lambda: new_cache(model, 2, 64, "int8_per_token_head", page_size=16))
    with mock.patch.object(dispatch, "runs_triton_pallas", lambda device=None: True), \
         mock.patch.object(dispatch, "compute_capability", lambda device=None: 90), \
         mock.patch.object(dispatch, "is_gpu", lambda device=None: True):
        text = lower_for_cuda(model.apply, params, jax.ShapeDtypeStruct((2, 1), jnp.int32), cache)
    assert _custom_calls(text, "__gpu$xla.gpu.triton") == 2   # the insert and the attention, every layer
