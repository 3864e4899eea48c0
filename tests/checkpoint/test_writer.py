"""The one safetensors writer: tensor names per layout, float leaves as HF or Flax names them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jquant
from jquant.checkpoint.safetensors_file import load_file
from jquant.checkpoint.writer import checkpoint_tensors, save_checkpoint, tensor_name, tensor_separator
from jquant.schemes.qparam import QParam


def _qparam(name: str, n: int = 64, k: int = 128) -> QParam:
    w = jax.random.normal(jax.random.key(0), (n, k), jnp.float32)
    scheme = jquant.get_scheme(name)
    return QParam(scheme.quantize_weight(w), scheme)


def test_separator_per_layout():
    assert tensor_separator("gpt-oss") == "_" and tensor_name("m.experts.down_proj", "blocks", "gpt-oss") == \
        "m.experts.down_proj_blocks"
    for layout in ("gptq", "awq", "fp8", "compressed-tensors", "compressed-tensors/nvfp4-pack-quantized", "bnb", None):
        assert tensor_separator(layout) == "."
    assert tensor_name("m.q_proj", "qweight", "gptq") == "m.q_proj.qweight"


def test_float_leaves_as_hf_weights_or_flax_paths():
    kernel, scale = np.arange(6.0, dtype=np.float32).reshape(2, 3), np.ones(3, np.float32)
    params = {"a": {"kernel": kernel}, "norm": {"scale": scale}}
    hf = checkpoint_tensors(params, name_map=lambda m: "model." + m, kernel_to_weight=True)
    assert set(hf) == {"model.a.weight", "model.norm.weight"}
    np.testing.assert_array_equal(hf["model.a.weight"], kernel.T)       # Flax [K, N] → [N, K]
    assert hf["model.a.weight"].flags.c_contiguous
    flax = checkpoint_tensors(params)
    assert set(flax) == {"a.kernel", "norm.scale"}
    np.testing.assert_array_equal(flax["a.kernel"], kernel)


def test_quantized_leaves_take_their_layout_names_and_options():
    params = {"layers_0": {"q": {"kernel": _qparam("int4_g128")}, "e": {"kernel": _qparam("mxfp4")}}}
    t = checkpoint_tensors(params, name_map=lambda m: m.replace("/", "."))
    assert {"layers_0.q.qweight", "layers_0.q.scales", "layers_0.e_blocks", "layers_0.e_scales"} <= set(t)
    v2 = checkpoint_tensors({"q": {"kernel": _qparam("int4_g128")}}, layout_options={"checkpoint_format": "gptq_v2"})
    v1 = checkpoint_tensors({"q": {"kernel": _qparam("int4_g128")}})
    assert not np.array_equal(v1["q.qzeros"], v2["q.qzeros"])            # v1 stores zero points minus one


def test_save_checkpoint_writes_what_it_returns(tmp_path):
    params = {"q": {"kernel": _qparam("nvfp4")}, "b": {"bias": np.zeros(4, np.float32)}}
    written = save_checkpoint(params, tmp_path / "m.safetensors", metadata={"format": "pt"})
    loaded = load_file(str(tmp_path / "m.safetensors"))
    assert set(written) == set(loaded) and "b.bias" in loaded
    for name, value in written.items():
        np.testing.assert_array_equal(np.atleast_1d(loaded[name]).view(np.uint8),
                                      np.atleast_1d(value).view(np.uint8))


def test_two_leaves_with_one_name_are_refused():
    params = {"a": {"kernel": np.ones((2, 2), np.float32), "bias": np.ones(2, np.float32)}}
    with pytest.raises(ValueError, match="'a/kernel'.*'a.weight' is already taken|'a/bias'.*'a.weight' is already"):
        checkpoint_tensors(params, kernel_to_weight=True)
