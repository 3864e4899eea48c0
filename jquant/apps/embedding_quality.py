"""``jquant embed-quality``: all-MiniLM-L6-v2 sentence embeddings under each weight scheme, on real text.

Every Dense kernel of the 6 layers (q/k/v/o and the MLP's two) is quantized to the nearest code (RTN);
embeddings, LayerNorms and biases stay float32. The texts are sentences of the Britannica entry: the
text is split after '.', '!' or '?' followed by a space and a capital (or a quote or parenthesis),
sentences of fewer than ``--min-words`` words are dropped, and ``--num-sentences`` are taken from
sentence ``--offset`` on.
For each scheme: bits per quantized weight (codes and scales), the mean and the minimum cosine
between a sentence's float and quantized embeddings, and the share of sentences whose nearest
neighbour among the others (by cosine) is the one the float model picks. A scheme whose group size
does not divide a layer's K is reported as not applicable.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys

import jax
import numpy as np

from jquant.apps.help_format import HelpFormatter

DEFAULT_SCHEMES = ("int8_ch,fp8_e4m3_channel,int4_g128,int4_g64,int4_g32,int4_g128_asym,int4_g32_asym,"
                   "nf4,mxfp4,nvfp4")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"'(])")
_ASYM = re.compile(r"int4_g(\d+)_asym")  # GPTQ-style asymmetric int4 at any group size, built on demand
SHORTEST_BUCKET = 64  # tokens; batches hold sentences of 1-64, 65-128, 129-256, ... tokens


def britannica_sentences(num: int, offset: int, min_words: int) -> list[str]:
    """``num`` sentences of the Britannica text from sentence ``offset`` on (counting only those with at
    least ``min_words`` words); ValueError when the text has too few."""
    from jquant.apps.data import britannica_text

    sentences = [s.strip() for s in _SENTENCE_END.split(britannica_text().replace("\n", " "))]
    sentences = [s for s in sentences if len(s.split()) >= min_words]
    if offset + num > len(sentences):
        raise ValueError(f"asked for sentences [{offset}, {offset + num}); the text has {len(sentences)} of "
                         f"at least {min_words} words")
    return sentences[offset:offset + num]


def resolve_scheme(name: str):
    """A registered scheme, or ``int4_g{N}_asym`` (zero points, float16 scales) for any group size N."""
    from jquant.checkpoint.hf_config import scheme_from_config
    from jquant.schemes.scheme import get_scheme, schemes

    if name in schemes():
        return get_scheme(name)
    match = _ASYM.fullmatch(name)
    if match:
        return scheme_from_config({"quant_method": "gptq", "bits": 4, "group_size": int(match.group(1)),
                                   "sym": False, "desc_act": False})
    raise ValueError(f"unknown scheme {name!r}; registered: {', '.join(schemes())}, or int4_g<N>_asym")


def length_batches(tokenizer, texts: list[str]) -> tuple[list[dict], list[int]]:
    """The texts tokenized in batches of similar length (one per power-of-two bucket of token counts, so
    that each scheme compiles a few shapes and little of a batch is padding), and each text's length."""
    from jquant.models.bert import tokenize

    lengths = [len(tokenizer.encode(t).ids) for t in texts]
    buckets: dict[int, list[str]] = {}
    for text, n in zip(texts, lengths):
        buckets.setdefault(max(SHORTEST_BUCKET, 1 << (n - 1).bit_length()), []).append(text)
    return [tokenize(tokenizer, buckets[size]) for size in sorted(buckets)], lengths


def embed(model, params, batches) -> np.ndarray:
    """Sentence embeddings of every batch (dicts of ``BertModel`` arguments), in batch order."""
    from jquant.flax import quantized_apply

    forward = jax.jit(lambda p, b: quantized_apply(model, {"params": p}, **b))
    return np.concatenate([np.asarray(forward(params, b)) for b in batches])


def compare(reference: np.ndarray, embeddings: np.ndarray) -> tuple[float, float, float]:
    """(mean cosine, minimum cosine, nearest-neighbour agreement) of rows against the reference rows."""
    def unit(x):
        return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)

    cos = np.sum(unit(reference) * unit(embeddings), axis=1)

    def nearest(x):
        sim = unit(x) @ unit(x).T
        np.fill_diagonal(sim, -np.inf)
        return sim.argmax(axis=1)

    return float(cos.mean()), float(cos.min()), float(np.mean(nearest(reference) == nearest(embeddings)))


def _activations(scheme) -> str:
    spec = scheme.activation
    return "float" if spec.mode == "none" else f"{spec.format} {spec.mode.replace('_', ' ')}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jquant embed-quality", description=__doc__,
                                     formatter_class=HelpFormatter)
    parser.add_argument("--schemes", default=DEFAULT_SCHEMES, help="comma-separated weight schemes")
    parser.add_argument("--num-sentences", type=int, default=200, help="sentences embedded (at least 2)")
    parser.add_argument("--offset", type=int, default=100, help="first sentence taken (of those kept)")
    parser.add_argument("--min-words", type=int, default=6, help="shorter sentences are skipped")
    parser.add_argument("--out", default=None, help="also write the markdown table to this file")
    return parser


def run(argv=None) -> int:
    from jquant.apps.ledger import weight_ledger
    from jquant.bench.records import markdown_title, run_meta
    from jquant.flax import prepare_params, quantize_params
    from jquant.models.bert import BertModel, load_bert, minilm_path

    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    if args.num_sentences < 2 or args.offset < 0 or args.min_words < 1:
        parser.error("--num-sentences must be at least 2, --offset at least 0, --min-words at least 1")
    try:  # every input checked before minutes of work
        named = [(n, resolve_scheme(n)) for n in args.schemes.split(",") if n]
        texts = britannica_sentences(args.num_sentences, args.offset, args.min_words)
        path = minilm_path()
    except (ValueError, FileNotFoundError) as e:
        parser.error(str(e))

    config, variables, tokenizer = load_bert(path)
    model, params = BertModel(config), variables["params"]
    batches, lengths = length_batches(tokenizer, texts)

    reference = embed(model, params, batches)
    rows = [("float32 (unquantized)", "float", "32", 1.0, 1.0, 1.0)]
    notes, kernels = [], set()
    for name, scheme in named:
        sys.stderr.write(f"{name} ...\n")
        try:
            qparams, report = quantize_params(params, [(r".*kernel", scheme)], prepare=False)
        except ValueError as e:  # e.g. a group size that does not divide K
            notes.append(f"- {name}: not applicable: {e}")
            continue
        kernels.update(report.quantized)
        bits = weight_ledger(qparams).bits_per_quantized_weight
        mean, low, nn_agree = compare(reference, embed(model, prepare_params(qparams), batches))
        rows.append((name, _activations(scheme), f"{bits:.2f}", mean, low, nn_agree))

    meta = run_meta()
    meta["commit"] = meta["commit"][:7]  # as `git rev-parse --short`; uncommitted edits are not reflected
    detail = (f"all-MiniLM-L6-v2 ({config.num_layers} layers, hidden {config.hidden_size}, float32); "
              f"{len(texts)} Britannica sentences of at least {args.min_words} words from sentence "
              f"{args.offset} on ({min(lengths)}-{max(lengths)} tokens, mean {np.mean(lengths):.1f}); "
              f"{len(kernels)} Dense kernels quantized to the nearest code (RTN), embeddings, norms and biases float")
    command = " ".join(["jquant", "embed-quality", *argv])
    table = [markdown_title("Sentence-embedding quality under weight quantization", [meta], detail)
             + f"Command: `{command}`\n",
             "| weights | activations | bits / weight | mean cosine | min cosine | same nearest neighbour |",
             "|---|---|---|---|---|---|"]
    table += [f"| {n} | {a} | {b} | {m:.5f} | {lo:.5f} | {agree:.1%} |" for n, a, b, m, lo, agree in rows]
    text = "\n".join(table) + "\n" + ("\n" + "\n".join(notes) + "\n" if notes else "")
    print(text, end="")
    if args.out:
        pathlib.Path(args.out).write_text(text, encoding="utf-8")
    return 0
