"""Shared by the real-checkpoint generators (run in the tools' own venvs, never by the tests).

The base model is a tiny random Llama saved in bfloat16 by transformers (``tiny_llama.py`` writes it
to ``BASE``); each tool quantizes it, and the reference output of a checkpoint is the float32 forward of
transformers' Llama on the tool's own dequantized weights, so the tests compare like with like (the
tools' CPU kernels compute in bfloat16/float16).
"""

from __future__ import annotations

import importlib.metadata
import json
import pathlib
import shutil

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent
OUT = ROOT / "tests" / "goldens" / "real"
BASE = pathlib.Path("/tmp/jquant_real_base")
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
NUM_LAYERS = 2
# The token batch every reference output is computed on: [2, 16] ids from a fixed seed.
INPUT_IDS = np.random.default_rng(1234).integers(0, 128, (2, 16)).astype(np.int32)


def calibration_ids(count: int = 8, length: int = 64, seed: int = 99) -> np.ndarray:
    """Random token ids for the tools' calibration passes (count sequences of length tokens)."""
    return np.random.default_rng(seed).integers(0, 128, (count, length)).astype(np.int64)


def word_tokenizer():
    """A word-level tokenizer over the 128 ids ("t0" .. "t127"): the tools load or want one even though
    every input here is token ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(128)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="t0", bos_token="t1", eos_token="t2")


def module_names() -> list[str]:
    return [f"model.layers.{i}.{p}" for i in range(NUM_LAYERS) for p in PROJECTIONS]


def versions(*packages: str) -> np.ndarray:
    return np.array([f"{p}=={importlib.metadata.version(p)}" for p in packages])


def reference_logits(dequantized: dict[str, np.ndarray], saved_dir: pathlib.Path) -> np.ndarray:
    """float32 logits [2, 16, vocab] of the base model with each projection's weight replaced by
    ``dequantized[module_name]`` (float32 [out, in]) and every other parameter taken from the tool's
    checkpoint in ``saved_dir`` (AWQ rescales the norms)."""
    import torch
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(BASE, dtype=torch.float32, attn_implementation="eager").eval()
    saved = load_file(str(pathlib.Path(saved_dir) / "model.safetensors"))
    for name, p in model.named_parameters():
        if not any(name.startswith(m + ".") for m in module_names()):
            assert name in saved and saved[name].shape == p.shape, name
            p.data = saved[name].float()
    modules = dict(model.named_modules())
    assert sorted(dequantized) == sorted(module_names()), sorted(dequantized)
    for name, weight in dequantized.items():
        target = modules[name].weight
        assert tuple(weight.shape) == tuple(target.shape), (name, weight.shape, target.shape)
        target.data = torch.from_numpy(np.asarray(weight, np.float32))
    with torch.no_grad():
        return model(torch.from_numpy(INPUT_IDS).long()).logits.float().numpy()


def write(name: str, saved_dir: pathlib.Path, packages: tuple[str, ...], **arrays) -> pathlib.Path:
    """Copies the tool's config.json and model.safetensors into tests/goldens/real/<name>/ with the
    reference arrays as reference.npz (input_ids included)."""
    out = OUT / name
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    shards = sorted(pathlib.Path(saved_dir).glob("*.safetensors"))
    assert [s.name for s in shards] == ["model.safetensors"], shards
    shutil.copy(shards[0], out / "model.safetensors")
    config = json.loads((pathlib.Path(saved_dir) / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    np.savez_compressed(out / "reference.npz", meta_versions=versions(*packages), input_ids=INPUT_IDS, **arrays)
    return out
