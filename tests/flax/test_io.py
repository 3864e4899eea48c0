"""Orbax round trip of quantized params, and safetensors export in vLLM layouts."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jquant
from jquant.flax.orbax_io import export_safetensors, restore_quantized, save_quantized
from jquant.flax import QParam, quantize_params


def _params():
    k = jax.random.split(jax.random.key(0), 4)
    return {"embed": {"embedding": jax.random.normal(k[0], (32, 256))},
            "layers_0": {"q_proj": {"kernel": jax.random.normal(k[1], (256, 128))},
                         "mlp": {"kernel": jax.random.normal(k[2], (256, 256)), "bias": jnp.arange(256.0)}},
            "head": {"kernel": jax.random.normal(k[3], (256, 64)).astype(jnp.bfloat16)}}


RULES = [(r".*q_proj/kernel", "nvfp4"), (r".*mlp/kernel", "mxfp4"), (r".*head/kernel", "nf4_dq")]


def test_orbax_round_trip_is_bit_identical(tmp_path):
    qparams, _ = quantize_params(_params(), RULES, prepare=False)
    save_quantized(tmp_path / "ckpt", qparams)
    restored = restore_quantized(tmp_path / "ckpt", prepare=False)
    assert jax.tree_util.tree_structure(restored) == jax.tree_util.tree_structure(qparams)
    for a, b in zip(jax.tree_util.tree_leaves(qparams), jax.tree_util.tree_leaves(restored)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.atleast_1d(np.asarray(a)).view(np.uint8), np.atleast_1d(np.asarray(b)).view(np.uint8))
    q = restored["layers_0"]["q_proj"]["kernel"]
    assert isinstance(q, QParam) and q.scheme == qparams["layers_0"]["q_proj"]["kernel"].scheme


def test_restored_params_compute_the_same(tmp_path):
    qparams, _ = quantize_params(_params(), "int4_g128")
    save_quantized(tmp_path / "ckpt", qparams)
    restored = restore_quantized(tmp_path / "ckpt")
    x = jax.random.normal(jax.random.key(5), (3, 256), jnp.bfloat16)
    k0, k1 = qparams["layers_0"]["mlp"]["kernel"], restored["layers_0"]["mlp"]["kernel"]
    chex.assert_trees_all_equal(k0.apply(x), k1.apply(x))


def test_restore_missing_directory(tmp_path):
    with pytest.raises(ValueError, match="no checkpoint"):
        restore_quantized(tmp_path / "nope")


def test_safetensors_export_in_gptq_layout(tmp_path):
    from jquant.checkpoint.safetensors_file import load_file

    qparams, _ = quantize_params(_params(), [(r".*_proj/kernel", "int4_g128"), (r".*", None)], prepare=False)
    written = export_safetensors(qparams, tmp_path / "model.safetensors",
                                 name_map=lambda p: "model." + p.replace("layers_", "layers.").replace("/", "."))
    loaded = load_file(str(tmp_path / "model.safetensors"))
    assert set(written) == set(loaded)
    assert loaded["model.layers.0.q_proj.qweight"].dtype == np.int32
    assert loaded["model.layers.0.q_proj.qweight"].shape == (256 // 8, 128)
    qt = jquant.from_checkpoint({k.split("q_proj.")[1]: v for k, v in loaded.items() if "q_proj." in k}, "gptq",
                                bits=4, group_size=128, sym=True)
    original = qparams["layers_0"]["q_proj"]["kernel"].qtensor
    np.testing.assert_array_equal(qt.dequantize(jnp.float32), original.dequantize(jnp.float32))


@pytest.mark.parametrize("layout, shape", [("fp8", ()), ("modelopt", ()), ("compressed-tensors", (1,))])
def test_safetensors_export_writes_a_static_input_scale(tmp_path, layout, shape):
    from jquant.schemes.builtin import fp8_tensor
    from jquant.checkpoint.safetensors_file import load_file

    scheme = fp8_tensor(static_activations=True, layout=layout)
    qparams, _ = quantize_params(_params(), [(r".*q_proj/kernel", scheme), (r".*", None)], prepare=False)
    q = qparams["layers_0"]["q_proj"]["kernel"]
    qparams["layers_0"]["q_proj"]["kernel"] = QParam(q.weight, q.scheme, jnp.float32(0.0123))
    export_safetensors(qparams, tmp_path / "model.safetensors")
    loaded = load_file(str(tmp_path / "model.safetensors"))
    scale = loaded["layers_0.q_proj.input_scale"]
    assert scale.shape == shape and scale.dtype == np.float32 and float(scale.reshape(())) == np.float32(0.0123)
    assert loaded["layers_0.q_proj.weight_scale"].shape == (() if layout != "compressed-tensors" else (1,))
