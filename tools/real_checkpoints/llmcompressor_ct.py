"""compressed-tensors checkpoints of the tiny Llama made by llmcompressor's ``oneshot`` on CPU::

    python3.11 -m venv /tmp/llmc && /tmp/llmc/bin/pip install torch==2.13.0
    /tmp/llmc/bin/pip install llmcompressor   # 0.14.0.1 with compressed-tensors 0.19.0 here
    /tmp/llmc/bin/python tools/real_checkpoints/llmcompressor_ct.py [case ...]

Cases: GPTQ W4A16 (group 128, symmetric), GPTQ W8A16 (int8 per output channel, symmetric), AWQ
W4A16_ASYM (group 128, zero points) and FP8_DYNAMIC (FP8 weights per channel, dynamic per-token FP8
activations); the projections are quantized, lm_head (tied) is not. Calibration: 8 sequences of 64
random token ids. AWQ pins its cached activations before each grid search, which needs an
accelerator; on CPU the pin is made a no-op (``IntermediatesCache.pin_memory``), which changes
nothing else.

Reference, weight-only: the float32 forward (``_common.reference_logits``) on the weights that
compressed-tensors' own compressor decompresses from the saved tensors, its scales cast to float32
first (its dequantize computes in the scale's dtype, bfloat16 here). FP8 dynamic: each projection's
output on fixed float32 inputs (``<module>.input`` [2, 4, in] → ``<module>.output``), from
compressed-tensors' own quantized forward of the decompressed float32 module (per-token FP8
activations, FP8 weights).
"""

from __future__ import annotations

import json
import pathlib
import sys
import tempfile

import numpy as np

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import _common  # noqa: E402

CASES = ("ct_gptq_w4a16", "ct_gptq_w8a16", "ct_awq_w4a16_asym", "ct_fp8_dynamic")
PACKAGES = ("llmcompressor", "compressed-tensors", "transformers", "torch")


def _recipe(case: str):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from llmcompressor.modifiers.transform.awq import AWQModifier

    if case == "ct_gptq_w4a16":
        return GPTQModifier(targets="Linear", scheme="W4A16", ignore=["lm_head"])
    if case == "ct_gptq_w8a16":
        # the W8A16 preset is group 128 here; int8 per output channel is its own scheme
        weights = QuantizationArgs(num_bits=8, type="int", strategy="channel", symmetric=True)
        return GPTQModifier(config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=weights)},
                            ignore=["lm_head"])
    if case == "ct_awq_w4a16_asym":
        return [AWQModifier(), QuantizationModifier(targets="Linear", scheme="W4A16_ASYM", ignore=["lm_head"])]
    if case == "ct_fp8_dynamic":
        return QuantizationModifier(targets="Linear", scheme="FP8_DYNAMIC", ignore=["lm_head"])
    raise ValueError(f"unknown case {case!r}; choose from {CASES}")


def _calibration():
    from datasets import Dataset

    ids = _common.calibration_ids()
    return Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": np.ones_like(ids).tolist()})


def _scheme(saved_dir: pathlib.Path):
    from compressed_tensors.quantization import QuantizationConfig

    qcfg = QuantizationConfig.model_validate(json.loads((saved_dir / "config.json").read_text())["quantization_config"])
    (group,) = qcfg.config_groups.values()
    return qcfg.format, group


def _decompressed(saved_dir: pathlib.Path) -> dict[str, np.ndarray]:
    """module name -> float32 weight, decompressed by compressed-tensors' compressor of the saved format."""
    import torch
    from compressed_tensors.compressors import BaseCompressor
    from safetensors.torch import load_file

    fmt, scheme = _scheme(saved_dir)
    compressor = BaseCompressor.get_value_from_registry(fmt)
    tensors = load_file(str(saved_dir / "model.safetensors"))
    out = {}
    for name in _common.module_names():
        own = {k[len(name) + 1:]: v for k, v in tensors.items() if k.startswith(name + ".")}
        own = {k: v.float() if k == "weight_scale" else v for k, v in own.items()}
        weight = compressor.decompress(own, scheme)["weight"]
        assert weight.dtype == torch.float32, (name, weight.dtype)
        out[name] = weight.numpy()
    return out


def _layer_outputs(saved_dir: pathlib.Path) -> dict[str, np.ndarray]:
    """``<module>.input`` and ``<module>.output`` of each projection under the FP8 dynamic scheme."""
    import torch
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus, apply_quantization_config
    from safetensors.torch import load_file

    _, scheme = _scheme(saved_dir)
    weights = _decompressed(saved_dir)
    tensors = load_file(str(saved_dir / "model.safetensors"))
    rng = np.random.default_rng(7)
    arrays = {}
    for name in _common.module_names():
        out_features, in_features = weights[name].shape
        linear = torch.nn.Linear(in_features, out_features, bias=False)
        config = QuantizationConfig(config_groups={"group_0": scheme}, quantization_status=QuantizationStatus.FROZEN)
        holder = torch.nn.Sequential(linear)
        apply_quantization_config(holder, config)
        linear.weight.data = torch.from_numpy(weights[name])
        linear.weight_scale.data = tensors[name + ".weight_scale"].float()
        # [batch, tokens, in] as the model feeds it: compressed-tensors takes a 2-D input's rows as one
        # token (one scale for all). A token of large activations and one of zeros make per-token
        # scales differ widely.
        x = rng.standard_normal((2, 4, in_features)).astype(np.float32)
        x[0, 0] *= 40.0
        x[0, 1] = 0.0
        x[1, 2, :3] = [-0.0, 448.0, -448.0]
        with torch.no_grad():
            y = linear(torch.from_numpy(x))
        assert y.dtype == torch.float32
        arrays[f"{name}.input"] = x
        arrays[f"{name}.output"] = y.numpy()
    return arrays


def make(case: str) -> pathlib.Path:
    import torch
    from llmcompressor import oneshot
    from llmcompressor.pipelines.cache import IntermediatesCache
    from transformers import AutoModelForCausalLM

    IntermediatesCache.pin_memory = lambda self, batch_index, input_names=None: None
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(_common.BASE, dtype=torch.bfloat16)
    calibration = None if case == "ct_fp8_dynamic" else _calibration()
    oneshot(model=model, processor=_common.word_tokenizer(), dataset=calibration, recipe=_recipe(case),
            max_seq_length=64, num_calibration_samples=len(_common.calibration_ids()),
            pipeline="sequential" if calibration else "datafree")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        model.save_pretrained(tmp, save_compressed=True)
        if case == "ct_fp8_dynamic":
            arrays = _layer_outputs(tmp)
        else:
            arrays = {"logits": _common.reference_logits(_decompressed(tmp), tmp)}
        return _common.write(case, tmp, PACKAGES, **arrays)


if __name__ == "__main__":
    for name in sys.argv[1:] or CASES:
        print("wrote", make(name))
