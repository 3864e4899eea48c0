"""Orbax round trip of quantized params, and safetensors export in vLLM layouts."""

import dataclasses

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


@pytest.mark.parametrize("damaged", ["structure/metadata", "arrays/_METADATA"])
@pytest.mark.parametrize("content", [b"\xff\xfe\x00 not text", b"not json {"])
def test_restore_names_a_metadata_file_that_is_not_json(tmp_path, damaged, content):
    qparams, _ = quantize_params(_params(), RULES, prepare=False)
    save_quantized(tmp_path / "ckpt", qparams)
    (tmp_path / "ckpt" / damaged).write_bytes(content)
    with pytest.raises(ValueError, match="is not a checkpoint that save_quantized wrote") as e:
        restore_quantized(tmp_path / "ckpt")
    assert str(e.value).startswith(repr(str(tmp_path / "ckpt" / damaged)) + " is not valid JSON")


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


def test_safetensors_export_names_gpt_oss_tensors_with_underscores(tmp_path):
    from jquant.checkpoint.hf_checkpoint import hf_module_name, save_hf_checkpoint
    from jquant.checkpoint.safetensors_file import load_file

    qparams, _ = quantize_params(_params(), [(r".*mlp/kernel", "mxfp4"), (r".*", None)], prepare=False)
    export_safetensors(qparams, tmp_path / "model.safetensors")
    loaded = load_file(str(tmp_path / "model.safetensors"))
    # transformers' gpt-oss names: <module>_blocks / <module>_scales (mlp.experts.gate_up_proj_blocks)
    assert {"layers_0.mlp_blocks", "layers_0.mlp_scales"} <= set(loaded)
    assert not {"layers_0.mlp.blocks", "layers_0.mlp.scales"} & set(loaded)
    qt = jquant.from_checkpoint({"blocks": loaded["layers_0.mlp_blocks"], "scales": loaded["layers_0.mlp_scales"]},
                                "gpt-oss")
    original = qparams["layers_0"]["mlp"]["kernel"].qtensor
    assert qt.fmt == original.fmt == "mxfp4" and qt.shape == original.shape
    np.testing.assert_array_equal(np.asarray(qt.data), np.asarray(original.data))
    np.testing.assert_array_equal(np.asarray(qt.scale).view(np.uint8), np.asarray(original.scale).view(np.uint8))
    # The HF writer names the same QParam's tensors the same way.
    gate = {"layers_0": {"gate_proj": {"kernel": qparams["layers_0"]["mlp"]["kernel"]}}}
    exported = export_safetensors(gate, tmp_path / "gate.safetensors", name_map=hf_module_name)
    save_hf_checkpoint(gate, tmp_path / "hf")
    assert set(exported) == set(load_file(str(tmp_path / "hf" / "model.safetensors"))) == {
        "model.layers.0.mlp.gate_proj_blocks", "model.layers.0.mlp.gate_proj_scales"}


def test_safetensors_export_refuses_what_it_cannot_name(tmp_path):
    qparams, _ = quantize_params(_params(), [(r".*q_proj/kernel", "int4_g128"), (r".*", None)], prepare=False)
    bare = {"w": qparams["layers_0"]["q_proj"]["kernel"].qtensor}
    with pytest.raises(ValueError, match="'w' is a bare QTensor"):
        export_safetensors(bare, tmp_path / "a.safetensors")
    prepared = {"w": jquant.get_scheme("int4_g128").process_weights_after_loading(bare["w"])}
    with pytest.raises(ValueError, match="'w' is a bare prepared weight"):
        export_safetensors(prepared, tmp_path / "b.safetensors")
    nameless = QParam(bare["w"], dataclasses.replace(jquant.get_scheme("int4_g128"), name="x",
                                                     checkpoint_layout=None))
    with pytest.raises(ValueError, match="names no checkpoint layout; pass layout="):
        export_safetensors({"q": {"kernel": nameless}}, tmp_path / "c.safetensors")
    written = export_safetensors({"q": {"kernel": nameless}}, tmp_path / "c.safetensors", layout="gptq")
    assert set(written) >= {"q.qweight", "q.scales"}
