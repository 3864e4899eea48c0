"""WeightSpec / ActivationSpec / LayoutSpec: typed fields, one per-channel encoding, hashing, jit."""

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jquant
from jquant import get_scheme, scheme_from_config
from jquant.checkpoint.hf_checkpoint import layout_meta
from jquant.schemes.scheme import Scheme
from jquant.schemes.spec import ActivationSpec, LayoutSpec, WeightSpec

# The quantize() options each named scheme passes: exactly these, so quantization stays bit-identical.
QUANTIZE_KWARGS = {
    "int4_g128": {"group_size": 128, "scale_dtype": "float16"},
    "int4_g128_asym": {"group_size": 128, "scale_dtype": "float16"},
    "int8_ch": {"group_size": None},
    "fp8_e4m3_tensor": {"granularity": "tensor"},
    "fp8_e4m3_channel": {"granularity": "channel"},
    "fp8_e4m3_block128x128": {"granularity": "block", "block_size": (128, 128), "ue8m0": False},
    "fp8_e4m3_block128x128_ue8m0": {"granularity": "block", "block_size": (128, 128), "ue8m0": True},
    "mxfp4": {"scale_mode": "floor"},
    "nvfp4": {"convention": "compressed-tensors"},
    "nf4": {"blocksize": 64, "compress_statistics": False},
    "nf4_dq": {"blocksize": 64, "compress_statistics": True},
    "fp4_bnb": {"blocksize": 64, "compress_statistics": False},
}


@pytest.mark.parametrize("name", sorted(QUANTIZE_KWARGS))
def test_quantize_kwargs_are_the_formats_options(name):
    kwargs = get_scheme(name).weight.quantize_kwargs()
    assert kwargs == QUANTIZE_KWARGS[name]
    assert [type(v) for v in kwargs.values()] == [type(v) for v in QUANTIZE_KWARGS[name].values()]


@pytest.mark.parametrize("name, bits, symmetric", [("int4_g128", 4, True), ("int4_g128_asym", 4, False),
                                                   ("int8_ch", 8, True), ("fp8_e4m3_tensor", 8, None),
                                                   ("mxfp4", 4, None), ("nvfp4", 4, None), ("nf4", 4, None)])
def test_bits_and_symmetry_are_fields(name, bits, symmetric):
    weight = get_scheme(name).weight
    assert (weight.bits, weight.symmetric) == (bits, symmetric)


@pytest.mark.parametrize("bad", [-1, 0, True, 1.5, "128"])
def test_group_size_none_is_the_only_per_channel_encoding(bad):
    assert get_scheme("int8_ch").weight.group_size is None
    assert WeightSpec.integer(8, None).quantize_kwargs() == {"group_size": None}
    with pytest.raises(ValueError, match="group_size must be a positive int"):
        WeightSpec.integer(4, bad)
    with pytest.raises(ValueError, match="group_size must be a positive int"):
        WeightSpec("int4", 4, symmetric=True, group_size=bad)
    with pytest.raises(ValueError, match="group_size must be a positive int"):
        ActivationSpec("dynamic_per_token_group", group_size=bad)


def test_hf_per_channel_group_becomes_none():
    s = scheme_from_config({"quant_method": "gptq", "bits": 4, "group_size": -1})
    assert s.weight.group_size is None and "group_size" not in layout_meta(s)
    ct = scheme_from_config({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {
        "g": {"weights": {"num_bits": 8, "type": "int", "strategy": "channel"}}}})
    assert ct.weight.group_size is None


def test_gptq_config_has_bits_as_a_field():
    s = scheme_from_config({"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True})
    assert s.weight == WeightSpec("int4", 4, symmetric=True, group_size=128, scale_dtype="float16")
    assert type(s.weight.bits) is int and s.weight.bits == 4
    assert layout_meta(s)["bits"] == 4 and layout_meta(s)["sym"] is True
    s8 = scheme_from_config({"quant_method": "gptq", "bits": 8, "group_size": 32, "sym": False})
    assert (s8.weight.format, s8.weight.bits, s8.weight.symmetric) == ("uint8", 8, False)
    assert (layout_meta(s8)["bits"], layout_meta(s8)["sym"], layout_meta(s8)["group_size"]) == (8, False, 32)


@pytest.mark.parametrize("kwargs, match", [
    (dict(format="int4", bits=8, symmetric=True), "4-bit codes"),
    (dict(format="int4", bits=4, symmetric=False), "needs symmetric=True"),
    (dict(format="uint4", bits=4), "needs symmetric=False"),
    (dict(format="nf4", bits=4, group_size=64), "group_size do not apply"),
    (dict(format="nf4", bits=4, symmetric=True), "symmetric do not apply"),
    (dict(format="fp8_e4m3", bits=8, granularity="channel", block_size=(128, 128)), "block_size goes with"),
    (dict(format="fp8_e4m3", bits=8, granularity="block"), "block_size goes with"),
    (dict(format="fp8_e4m3", bits=8, granularity="row"), "granularity must be one of"),
    (dict(format="fp8_e4m3", bits=8, granularity="block", block_size=(128,)), "two positive ints"),
    (dict(format="int4", bits=0, symmetric=True), "bits must be a positive int"),
])
def test_weight_spec_refuses_inconsistent_fields(kwargs, match):
    with pytest.raises(ValueError, match=match):
        WeightSpec(**kwargs)


@pytest.mark.parametrize("kwargs, match", [
    (dict(mode="per_token"), "activation must be one of"),
    (dict(mode="none", format="fp8_e4m3"), "takes no format"),
    (dict(mode="dynamic_per_token", format="int4"), "format must be one of"),
    (dict(mode="dynamic_per_token_group"), "group_size goes with"),
    (dict(mode="dynamic_per_token", group_size=128), "group_size goes with"),
    (dict(mode="dynamic_per_tensor", input_scale=0.5), "input_scale applies to mode 'static'"),
    (dict(mode="static", input_scale=-1.0), "positive and finite"),
    (dict(mode="dynamic_per_token", ue8m0=True), "ue8m0 applies"),
])
def test_activation_spec_refuses_inconsistent_fields(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ActivationSpec(**kwargs)


def test_activation_spec_defaults_and_input_scale():
    assert ActivationSpec("dynamic_per_token").format == "fp8_e4m3"
    spec = ActivationSpec("static", input_scale=np.float32(0.25))
    assert type(spec.input_scale) is float and spec.input_scale == 0.25


def test_specs_hash_and_compare_by_value():
    a = WeightSpec("fp8_e4m3", 8, granularity="block", block_size=[128, 128])  # a list, as from JSON
    b = WeightSpec("fp8_e4m3", 8, granularity="block", block_size=(128, 128), ue8m0=False)
    assert a == b and hash(a) == hash(b) and a.block_size == (128, 128)
    assert a != WeightSpec("fp8_e4m3", 8, granularity="block", block_size=(128, 128), ue8m0=True)
    assert WeightSpec.integer(4, 64) != WeightSpec.integer(4, 128)
    assert ActivationSpec("static", input_scale=0.5) == ActivationSpec("static", "fp8_e4m3", input_scale=0.5)
    assert hash(LayoutSpec("gptq_v2", True)) == hash(LayoutSpec(checkpoint_format="gptq_v2", desc_act=True))
    config = {"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": True, "checkpoint_format": "gptq_v2"}
    s1, s2 = scheme_from_config(config), scheme_from_config(dict(config))
    assert s1 is not s2 and s1 == s2 and hash(s1) == hash(s2) and len({s1, s2}) == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        s1.weight.bits = 8


def test_scheme_takes_specs_only():
    with pytest.raises(TypeError, match=r"weight must be WeightSpec\(...\), got 'int4'"):
        Scheme("bad", weight="int4")
    with pytest.raises(TypeError, match=r"activation must be ActivationSpec\(...\), got 'static'"):
        Scheme("bad", weight=WeightSpec.integer(4, 128), activation="static")


def test_jit_with_the_scheme_static():
    traces = []

    @functools.partial(jax.jit, static_argnames="scheme")
    def forward(x, qw, scheme):
        traces.append(scheme.name)
        return scheme.apply(x, qw)

    config = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True}
    s1, s2 = scheme_from_config(config), scheme_from_config(config)
    w = jax.random.normal(jax.random.key(0), (64, 256), jnp.float32)
    x = jax.random.normal(jax.random.key(1), (3, 256), jnp.float32).astype(jnp.bfloat16)
    qw = s1.quantize_weight(w)
    y1 = forward(x, qw, scheme=s1)
    y2 = forward(x, qw, scheme=s2)  # an equal scheme: the cached trace
    assert traces == [s1.name]
    np.testing.assert_array_equal(np.asarray(y1, np.float32), np.asarray(y2, np.float32))
    np.testing.assert_array_equal(np.asarray(y1, np.float32), np.asarray(s1.apply(x, qw), np.float32))


@pytest.mark.parametrize("name", jquant.schemes())
def test_to_dict_round_trips_through_json(name):
    scheme = get_scheme(name)
    assert Scheme.from_dict(json.loads(json.dumps(scheme.to_dict()))) == scheme


def test_from_dict_reads_the_flat_form_of_older_saves():
    flat = {"name": "int4_g128", "weight_format": "int4",
            "weight_options": (("group_size", 128), ("scale_dtype", "float16")), "activation": "none",
            "activation_options": (), "min_capability": 0, "checkpoint_layout": "gptq", "layout_options": (),
            "description": get_scheme("int4_g128").description}
    assert Scheme.from_dict(flat) == get_scheme("int4_g128")
    block = get_scheme("fp8_e4m3_block128x128")
    flat = {"name": block.name, "weight_format": "fp8_e4m3", "min_capability": 89,
            "weight_options": (("block_size", (128, 128)), ("granularity", "block"), ("ue8m0", False)),
            "activation": "dynamic_per_token_group", "checkpoint_layout": "fp8-block", "description": block.description,
            "activation_options": (("format", "fp8_e4m3"), ("group_size", 128), ("ue8m0", False))}
    assert Scheme.from_dict(flat) == block
    gptq = {"name": "int4_g128", "weight_format": "int4", "weight_options": (("group_size", 128),),
            "layout_options": (("checkpoint_format", "gptq_v2"), ("desc_act", True))}
    assert Scheme.from_dict(gptq).layout_kwargs() == {"checkpoint_format": "gptq_v2", "desc_act": True}
