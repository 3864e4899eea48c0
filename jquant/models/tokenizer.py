"""A byte-level BPE tokenizer (GPT-2 style) rebuilt from a GGUF file's ``tokenizer.*`` metadata.

GGUF stores the vocabulary already spelled in GPT-2's byte alphabet (``Ġ`` for a space), the merges as
``"left right"`` strings in rank order, and a type per token; control tokens (type 3, e.g. ``<|im_end|>``)
are matched whole in the text. ``tokenizer.ggml.pre`` names how text is split before BPE; for "smollm" (and
the StarCoder family llama.cpp groups with it) digits are split one by one first, then GPT-2's regex applies.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

CONTROL = 3       # llama.cpp token types
USER_DEFINED = 4

# Pre-tokenizers that put every digit in its own piece before GPT-2's regex (llama.cpp's "\p{N}" split).
_DIGIT_SPLIT_PRES = frozenset({"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"})
_PLAIN_GPT2_PRES = frozenset({"gpt2", "mpt", "olmo", "jais", "trillion"})  # GPT-2's regex alone


@dataclasses.dataclass(frozen=True)
class GGUFTokenizer:
    """``encode(text) -> ids`` / ``decode(ids) -> text`` over a ``tokenizers.Tokenizer``.

    Examples:
      >>> from jquant.models import build_tokenizer
      >>> metadata = {"tokenizer.ggml.model": "gpt2",
      ...             "tokenizer.ggml.tokens": ["h", "i", "hi", "Ġ", "Ġhi", "<|end|>"],
      ...             "tokenizer.ggml.merges": ["h i", "Ġ hi"],
      ...             "tokenizer.ggml.token_type": [1, 1, 1, 1, 1, 3],  # 3: a control token
      ...             "tokenizer.ggml.bos_token_id": 5, "tokenizer.ggml.eos_token_id": 5}
      >>> tokenizer = build_tokenizer(metadata)
      >>> tokenizer.vocab_size, tokenizer.bos_id, tokenizer.eos_id, tokenizer.add_bos
      (6, 5, 5, False)
      >>> tokenizer.encode("hi hi"), tokenizer.encode("hi hi", add_bos=True)
      ([2, 4], [5, 2, 4])
      >>> tokenizer.decode([2, 4, 5]), tokenizer.decode([2, 4, 5], skip_special_tokens=True)
      ('hi hi<|end|>', 'hi hi')
    """

    backend: Any  # tokenizers.Tokenizer
    bos_id: int | None
    eos_id: int | None
    add_bos: bool = False
    chat_template: str | None = None

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids = [self.bos_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)


def _pre_tokenizer(pre: str | None):
    from tokenizers import pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)  # GPT-2's regex + bytes
    if pre in _DIGIT_SPLIT_PRES:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre is None or pre in _PLAIN_GPT2_PRES:  # files older than the key meant GPT-2's split
        return byte_level
    raise ValueError(f"tokenizer.ggml.pre={pre!r} is not supported (known: "
                     f"{sorted(_DIGIT_SPLIT_PRES | _PLAIN_GPT2_PRES)})")


def build_tokenizer(metadata: Mapping[str, Any]) -> GGUFTokenizer:
    """The tokenizer described by ``tokenizer.*`` GGUF metadata (as ``gguf_loader.load_gguf`` returns it).

    Examples:
      Byte-level BPE: ``Ġ`` is a space, merges apply in rank order, control tokens match whole:

      >>> from jquant.models import build_tokenizer
      >>> metadata = {"tokenizer.ggml.model": "gpt2",
      ...             "tokenizer.ggml.tokens": ["h", "i", "hi", "Ġ", "Ġhi", "<|end|>"],
      ...             "tokenizer.ggml.merges": ["h i", "Ġ hi"],
      ...             "tokenizer.ggml.token_type": [1, 1, 1, 1, 1, 3],  # 3: a control token
      ...             "tokenizer.ggml.bos_token_id": 5, "tokenizer.ggml.eos_token_id": 5}
      >>> tokenizer = build_tokenizer(metadata)
      >>> tokenizer.encode("hi hi<|end|>")
      [2, 4, 5]
      >>> tokenizer.decode([4, 2])
      ' hihi'
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models

    model = metadata.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"tokenizer.ggml.model={model!r} is not supported (only byte-level BPE, 'gpt2')")
    tokens = list(metadata["tokenizer.ggml.tokens"])
    vocab = {token: index for index, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError("tokenizer.ggml.tokens has duplicate entries")
    merges = [tuple(merge.split(" ", 1)) for merge in metadata["tokenizer.ggml.merges"]]

    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    backend.pre_tokenizer = _pre_tokenizer(metadata.get("tokenizer.ggml.pre"))
    backend.decoder = decoders.ByteLevel()
    # Without these, "<|im_end|>" in the text would be cut into "<", "|", ... instead of staying one token.
    types = list(metadata.get("tokenizer.ggml.token_type") or ())
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, kind in zip(tokens, types) if kind == CONTROL])
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, kind in zip(tokens, types) if kind == USER_DEFINED])
    if backend.get_vocab_size(with_added_tokens=True) != len(tokens):
        raise ValueError("special tokens changed the vocabulary size; the GGUF token list is inconsistent")

    def token_id(key):
        value = metadata.get(f"tokenizer.ggml.{key}")
        return None if value is None else int(value)

    return GGUFTokenizer(backend=backend, bos_id=token_id("bos_token_id"), eos_id=token_id("eos_token_id"),
                         add_bos=bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
                         chat_template=metadata.get("tokenizer.chat_template"))
