"""Saving MoE expert stacks (QExperts): orbax restores them bit for bit (codes, scales, per-expert global
scales, scheme); safetensors export writes gpt-oss MXFP4 and DeepSeek-V3 block-FP8 stacks as their
checkpoints do (the loaders read them back into the same QExperts) and refuses every other format."""

import json
import pathlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jquant.checkpoint.experts import (deepseek_num_experts, gpt_oss_experts_to_tensors, load_deepseek_experts,
                                       load_gpt_oss_experts)
from jquant.checkpoint.hf_checkpoint import save_hf_checkpoint
from jquant.checkpoint.safetensors_file import load_file
from jquant.flax import QParam, quantize_params, quantized_apply
from jquant.flax.orbax_io import export_safetensors, restore_quantized, save_quantized
from jquant.kernels.moe import QExperts, quantize_expert_weights, split_rows
from jquant.models.moe import MoE, expert_params
from jquant.schemes.scheme import get_scheme
from test_moe_layer import CONFIGS, make_params

GPT_OSS = MoE(**CONFIGS["gpt-oss"])  # 8 experts, H 64, I 32, router and expert biases
# DeepSeek-V3-like with H 256: the per-expert gate and up halves are two 128-row blocks each.
DEEPSEEK = MoE(**{**CONFIGS["deepseek-v3"], "hidden": 256})
MODULE = "model.layers.{}.mlp.experts"


def hf_names(path: str) -> str:
    """``layers_0/mlp`` → ``model.layers.0.mlp.experts`` (and whole paths of float leaves likewise)."""
    return "model." + path.replace("layers_", "layers.").replace("/", ".").replace("mlp", "mlp.experts", 1)


def assert_bit_equal(a, b):
    """Same tree, schemes, dtypes and bytes (chex compares values; the bytes also tell -0.0 and NaNs)."""
    chex.assert_trees_all_equal_structs(a, b)
    chex.assert_trees_all_equal_shapes_and_dtypes(a, b)
    chex.assert_trees_all_equal(a, b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.atleast_1d(np.asarray(x)).view(np.uint8),
                                      np.atleast_1d(np.asarray(y)).view(np.uint8))


def quantized_tree(seed):
    """Two MoE layers whose stacks cover MXFP4, NVFP4 (per-expert global scales), block FP8, asymmetric
    int4 (zero points) and bitsandbytes NF4 with double quantization, beside Dense QParams."""
    rules = [(r"layers_0/mlp/gate_up_proj", "mxfp4"), (r"layers_0/mlp/down_proj", "nvfp4"),
             (r"layers_1/mlp/gate_up_proj", "fp8_e4m3_block128x128"), (r"layers_1/mlp/down_proj", "int4_g128_asym"),
             (r".*shared_expert/.*kernel", "int4_g32"), (r"extra/down_proj", "nf4_dq")]
    rng = np.random.default_rng(seed)
    gpt_oss = make_params(GPT_OSS, seed=seed)
    gpt_oss["gate_up_proj"] = gpt_oss["gate_up_proj"].at[3].multiply(1e3)  # one expert far off the others
    params = {"layers_0": {"mlp": gpt_oss}, "layers_1": {"mlp": make_params(DEEPSEEK, seed=seed + 1)},
              "extra": {"down_proj": jnp.asarray(rng.standard_normal((4, 32, 64)), jnp.bfloat16)}}
    qparams, report = quantize_params(params, rules, prepare=False)
    assert len(report.quantized) == 8
    return qparams


def test_orbax_restores_expert_stacks_bit_for_bit(tmp_path):
    qparams = quantized_tree(seed=11)
    gs = qparams["layers_0"]["mlp"]["down_proj"].weight.global_scale
    assert gs.shape == (8, 1, 1) and len(set(np.asarray(gs).ravel().tolist())) > 1  # one per expert
    save_quantized(tmp_path / "ckpt", qparams)
    restored = restore_quantized(tmp_path / "ckpt", prepare=False)
    assert_bit_equal(restored, qparams)
    prepared = restore_quantized(tmp_path / "ckpt")  # Dense QParams are prepared, stacks come back as saved
    assert_bit_equal(prepared["layers_0"], qparams["layers_0"])
    for path in ("layers_0/mlp/gate_up_proj", "layers_0/mlp/down_proj", "layers_1/mlp/gate_up_proj",
                 "layers_1/mlp/down_proj", "extra/down_proj"):
        a, b = (tree[path.split("/")[0]] for tree in (qparams, restored))
        for key in path.split("/")[1:]:
            a, b = a[key], b[key]
        assert isinstance(b, QExperts) and b.scheme == a.scheme and b.weight.fmt == a.weight.fmt
        assert (b.weight.block, b.weight.pack_axis, b.weight.k_axis, b.weight.dtype, b.weight.options) == \
            (a.weight.block, a.weight.pack_axis, a.weight.k_axis, a.weight.dtype, a.weight.options)
    assert isinstance(restored["layers_1"]["mlp"]["shared_expert"]["gate_proj"]["kernel"], QParam)
    # the restored layers compute what the saved ones do
    for name, model in (("layers_0", GPT_OSS), ("layers_1", DEEPSEEK)):
        x = jax.random.normal(jax.random.key(3), (2, 3, model.hidden))
        apply = jax.jit(lambda p, x: quantized_apply(model, {"params": p}, x))  # QParam shared expert
        chex.assert_trees_all_equal(apply(restored[name]["mlp"], x), apply(qparams[name]["mlp"], x))


def _edit_structure(directory: pathlib.Path, edit) -> None:
    meta = directory / "structure" / "metadata"
    structure = json.loads(meta.read_text())
    edit(structure["nodes"])
    meta.write_text(json.dumps(structure))


def test_orbax_refuses_corrupt_stacks(tmp_path):
    rng = np.random.default_rng(5)
    scheme = get_scheme("mxfp4")
    stack = quantize_expert_weights(rng.standard_normal((6, 16, 64)).astype(np.float32), scheme)
    tree = {"layers_0": {"mlp": {"gate_up_proj": QExperts(stack, scheme)}}}
    # arrays that disagree with the stack's metadata are not saved
    short = {"layers_0": {"mlp": {"gate_up_proj": QExperts(stack.replace(scale=stack.scale[:5]), scheme)}}}
    with pytest.raises(ValueError, match=r"parameter 'layers_0/mlp/gate_up_proj': scale has shape \(5, 16, 2\), "
                                         r"but a \(6, 16, 64\) stack .* needs \(6, 16, 2\)"):
        save_quantized(tmp_path / "short", short)
    save_quantized(tmp_path / "ckpt", tree)
    node = "layers_0/mlp/gate_up_proj"

    def wrong_expert_count(nodes):
        nodes[node]["qexperts"]["shape"]["__tuple__"][0] = 7

    _edit_structure(tmp_path / "ckpt", wrong_expert_count)
    with pytest.raises(ValueError, match=r"checkpoint parameter 'layers_0/mlp/gate_up_proj' \(expert stack\): "
                                         r"weight: data has shape \(6, 16, 32\), but a \(7, 16, 64\) stack"):
        restore_quantized(tmp_path / "ckpt")
    save_quantized(tmp_path / "ckpt2", tree)

    def other_scheme(nodes):
        nodes[node]["scheme"] = get_scheme("int4_g32").to_dict()

    _edit_structure(tmp_path / "ckpt2", other_scheme)
    with pytest.raises(ValueError, match=r"'layers_0/mlp/gate_up_proj' \(expert stack\): QExperts: scheme "
                                         r"'int4_g32' runs 'int4' weights, got a 'mxfp4' stack"):
        restore_quantized(tmp_path / "ckpt2")


def test_gpt_oss_layer_exports_as_gpt_oss_checkpoints(tmp_path):
    params = make_params(GPT_OSS, seed=21)
    qparams, _ = quantize_params({"layers_0": {"mlp": params}}, [(r".*_proj", "mxfp4")], prepare=False)
    layer = qparams["layers_0"]["mlp"]
    written = export_safetensors(qparams, tmp_path / "model.safetensors", name_map=hf_names)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    module = MODULE.format(0)
    assert sorted(written) == sorted(tensors) == sorted(
        [f"{module}.{p}_{k}" for p in ("gate_up_proj", "down_proj") for k in ("blocks", "scales", "bias")]
        + [f"{module}.router_bias", f"{module}.router_weight"])  # no gate_up_bias of its own
    assert tensors[f"{module}.gate_up_proj_blocks"].shape == (8, 64, 2, 16)
    # what the loader reads back is the layer's QExperts and biases, exactly
    loaded = expert_params(load_gpt_oss_experts(tensors, module), "mxfp4")
    assert_bit_equal(loaded, {k: layer[k] for k in ("gate_up_proj", "down_proj", "gate_up_bias", "down_bias")})
    # gate and up interleave (even rows gate), as the checkpoint module's own writer interleaves them
    gate, up = split_rows(layer["gate_up_proj"].weight, [32, 32])
    np.testing.assert_array_equal(tensors[f"{module}.gate_up_proj_blocks"][:, 1::2].reshape(up.data.shape),
                                  np.asarray(up.data))
    weights = load_gpt_oss_experts(tensors, module)
    for name, array in gpt_oss_experts_to_tensors(weights, module).items():
        np.testing.assert_array_equal(array.view(np.uint8), tensors[name].view(np.uint8), err_msg=name)


def test_deepseek_layer_exports_as_deepseek_checkpoints(tmp_path):
    params = make_params(DEEPSEEK, seed=31)
    rules = [(r".*(gate_up|down)_proj", "fp8_e4m3_block128x128"), (r".*", None)]
    qparams, _ = quantize_params({"layers_2": {"mlp": params}}, rules, prepare=False)
    layer = qparams["layers_2"]["mlp"]
    export_safetensors(qparams, tmp_path / "model.safetensors", name_map=hf_names)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    module = MODULE.format(2)
    assert deepseek_num_experts(tensors, module) == 8
    assert tensors[f"{module}.7.up_proj.weight"].shape == (128, 256)
    assert tensors[f"{module}.7.up_proj.weight_scale_inv"].shape == (1, 2)
    assert tensors[f"{module}.0.down_proj.weight"].dtype == jnp.float8_e4m3fn
    loaded = expert_params(load_deepseek_experts(tensors, module))
    assert_bit_equal(loaded, {k: layer[k] for k in ("gate_up_proj", "down_proj")})
    # the float router, correction bias and shared expert are written as float leaves
    assert f"{module}.router_weight" in tensors and f"{module}.shared_expert.gate_proj.kernel" in tensors


@pytest.mark.parametrize("scheme", ["int4_g32", "nvfp4", "nf4"])
def test_export_refuses_stacks_without_an_expert_layout(tmp_path, scheme):
    down = make_params(GPT_OSS, seed=41)["down_proj"]
    qparams, _ = quantize_params({"layers_0": {"mlp": {"down_proj": down}}}, scheme, prepare=False)
    fmt = qparams["layers_0"]["mlp"]["down_proj"].weight.fmt
    layout = get_scheme(scheme).checkpoint_layout
    with pytest.raises(ValueError, match=rf"parameter 'layers_0/mlp/down_proj': expert stacks \(fmt '{fmt}'\) "
                                         rf"export only in .* not in layout '{layout}'"):
        export_safetensors(qparams, tmp_path / "model.safetensors")
    assert not (tmp_path / "model.safetensors").exists()  # nothing written


def test_export_refuses_what_the_expert_layouts_cannot_hold(tmp_path):
    rng = np.random.default_rng(51)
    int4, _ = quantize_params({"mlp": make_params(GPT_OSS, seed=51)}, [(r".*_proj", "int4_g32")], prepare=False)
    with pytest.raises(ValueError, match=r"'mlp/down_proj': layout 'gpt-oss' stores mxfp4 expert stacks, got fmt 'int4'"):
        export_safetensors(int4, tmp_path / "a.safetensors", layout="gpt-oss")

    mxfp4, _ = quantize_params({"mlp": make_params(GPT_OSS, seed=52)}, [(r".*_proj", "mxfp4")], prepare=False)
    fewer = {"mlp": {**mxfp4["mlp"], "gate_up_bias": mxfp4["mlp"]["gate_up_bias"][:7]}}
    with pytest.raises(ValueError, match=r"'mlp/gate_up_proj': its bias 'gate_up_bias' has shape \(7, 64\), "
                                         r"expected one per expert and row, \(8, 64\)"):
        export_safetensors(fewer, tmp_path / "b.safetensors")
    down = mxfp4["mlp"]["down_proj"]
    corrupt = {"mlp": {**mxfp4["mlp"], "down_proj": QExperts(down.weight.replace(data=down.weight.data[:, :-1]),
                                                               down.scheme)}}
    with pytest.raises(ValueError, match=r"parameter 'mlp/down_proj': data has shape \(8, 63, 16\)"):
        export_safetensors(corrupt, tmp_path / "c.safetensors")
    with pytest.raises(ValueError, match=r"'experts': a MoE layer's expert stacks are \('gate_up_proj', "
                                         r"'down_proj'\), not 'experts'"):
        export_safetensors({"experts": down}, tmp_path / "d.safetensors")

    fp8 = get_scheme("fp8_e4m3_block128x128")
    ds, _ = quantize_params({"mlp": make_params(DEEPSEEK, seed=53)}, [(r".*_proj", fp8), (r".*", None)],
                            prepare=False)
    biased = {"mlp": {**ds["mlp"], "down_bias": jnp.zeros((8, 256))}}
    with pytest.raises(ValueError, match=r"'mlp/down_proj': DeepSeek-V3 \('fp8-block'\) expert checkpoints hold no "
                                         r"biases, but the layer has 'down_bias'"):
        export_safetensors(biased, tmp_path / "e.safetensors")
    # gate and up halves of 64 rows split no 128-row block
    narrow = QExperts(quantize_expert_weights(rng.standard_normal((2, 128, 256)).astype(np.float32), fp8), fp8)
    with pytest.raises(ValueError, match=r"'mlp/gate_up_proj' \(fp8_e4m3, shape \(2, 128, 256\)\) cannot be "
                                         r"written in layout 'fp8-block': split_rows: sizes \[64, 64\]"):
        export_safetensors({"mlp": {"gate_up_proj": narrow}}, tmp_path / "f.safetensors")
    with pytest.raises(ValueError, match=r"no HF Llama name for Flax module 'mlp'"):
        save_hf_checkpoint(mxfp4, tmp_path / "hf")
    assert not any(tmp_path.glob("*.safetensors"))
