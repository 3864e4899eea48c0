"""``jquant demo``: SmolLM2-135M-Instruct under every registered weight scheme, on real text.

For each scheme: quantize the seven projections of all 30 layers (embeddings and norms stay float),
then measure perplexity on a fixed Britannica slice, its change against the unquantized model, top-1
agreement with the unquantized next-token predictions, weight bytes, and tokens/s of the jitted
forward on this device; finally generate a completion with the best 4-bit scheme.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jquant.apps.help_format import HelpFormatter
from jquant.schemes import dispatch

FOUR_BIT = ("int4", "uint4", "mxfp4", "nvfp4", "nf4", "fp4_bnb")


def _progress(i: int, n: int, label: str) -> None:
    width = 24
    filled = width * i // n
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {i}/{n} {label:<40}")
    sys.stderr.flush()


def nll_and_top1(logits: jax.Array, ids: jax.Array):
    """Mean next-token negative log-likelihood of ``ids`` under ``logits``, and the argmax predictions."""
    logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    nll = -jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1)[..., 0]
    return jnp.mean(nll), jnp.argmax(logits[:, :-1], axis=-1)


def _evaluate(model, params, ids, forward):
    fn = jax.jit(lambda p, i: nll_and_top1(forward(model, p, i), i))
    nll, top1 = fn(params, ids)
    jax.block_until_ready(nll)
    t0 = time.perf_counter()  # the first call compiled; time a second one
    jax.block_until_ready(fn(params, ids))
    tokens_per_s = ids.size / (time.perf_counter() - t0)
    return float(jnp.exp(nll)), np.asarray(top1), tokens_per_s


def _kv_dtypes(parser, text: str) -> tuple[str, ...]:
    from jquant.kv.dtypes import VALID_NAMES, kv_cache_spec

    if text == "all":
        return tuple(dict.fromkeys(kv_cache_spec(n).name for n in VALID_NAMES))
    names = tuple(n for n in text.split(",") if n)
    for n in names:
        try:
            kv_cache_spec(n)
        except ValueError as e:
            parser.error(f"--kv-cache-dtypes: {e}")
    return names


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jquant demo", description=__doc__,
                                     formatter_class=HelpFormatter)
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per evaluation row (default %(default)s)")
    parser.add_argument("--num-seqs", type=int, default=4, help="rows of --seq-len tokens (default 4×512 = 2048)")
    parser.add_argument("--schemes", default="",
                        help="comma-separated subset of the registered schemes (default: all of them; none: "
                             "no quantized scheme, so only the float32 row of the weight table, the calibration "
                             "summary and any --kv-cache-dtypes table)")
    parser.add_argument("--max-new-tokens", type=int, default=40,
                        help="tokens the best 4-bit scheme generates after the prompt (default %(default)s)")
    parser.add_argument("--kv-cache-dtypes", default="",
                        help="also evaluate the float model with a paged KV cache of each of these vLLM "
                             "kv_cache_dtypes (all: every one) on 2 rows of --kv-seq-len tokens")
    parser.add_argument("--kv-seq-len", type=int, default=1024,
                        help="tokens per row of the KV cache evaluation (default %(default)s)")
    return parser


def run(argv=None) -> int:
    from jquant.apps.data import eval_batches
    from jquant.apps.ledger import weight_ledger
    from jquant.models import build_tokenizer, generate, load_gguf, smollm2_path
    from jquant.checkpoint.hf_checkpoint import PROJECTIONS
    from jquant.models.llama import LlamaForCausalLM
    from jquant.flax import intercept_quantized, prepare_params, quantize_params, quantized_apply
    from jquant.schemes.scheme import get_scheme, schemes

    parser = build_parser()
    args = parser.parse_args(argv)
    names = [] if args.schemes == "none" else [s for s in args.schemes.split(",") if s] or list(schemes())
    unknown = [n for n in names if n not in schemes()]
    if unknown:   # before minutes of loading and evaluating
        parser.error(f"unknown schemes {unknown}; registered: {', '.join(schemes())}")
    kv_dtypes = _kv_dtypes(parser, args.kv_cache_dtypes)

    config, variables, tok_meta = load_gguf(smollm2_path())
    tokenizer = build_tokenizer(tok_meta)
    model = LlamaForCausalLM(config)
    params = variables["params"]
    ids = jnp.asarray(eval_batches(tokenizer, args.seq_len, args.num_seqs))

    def forward(m, p, i):
        return quantized_apply(m, {"params": p}, i)[0]

    steps = len(names) + 1
    _progress(0, steps, "unquantized")
    base_ppl, base_top1, base_tps = _evaluate(model, params, ids, forward)
    base_bytes = weight_ledger(params).total
    rows = [("float32 (unquantized)", 32.0, base_bytes, base_ppl, 0.0, 1.0, base_tps, "")]
    quantized = {}
    for i, name in enumerate(names, 1):
        _progress(i, steps, name)
        scheme = get_scheme(name)
        try:
            qparams, _ = quantize_params(params, [(PROJECTIONS, scheme)], prepare=False)
        except ValueError as e:
            rows.append((name, float("nan"), 0, float("nan"), float("nan"), float("nan"), 0.0,
                         f"n/a: {e}"))
            continue
        ledger = weight_ledger(qparams)  # of the QTensors; kernel layouts may pad
        qparams = prepare_params(qparams)  # the Pallas kernels' layout on Hopper, else unchanged
        try:
            ppl, top1, tps = _evaluate(model, qparams, ids, forward)
        except Exception as e:  # one scheme failing must not hide the other rows
            rows.append((name, float("nan"), 0, float("nan"), float("nan"), float("nan"), 0.0,
                         f"failed: {type(e).__name__}: {e}"))
            continue
        quantized[name] = (qparams, ppl)
        rows.append((name, ledger.bits_per_quantized_weight, ledger.total, ppl, ppl - base_ppl,
                     float(np.mean(top1 == base_top1)), tps, ""))
    _progress(steps, steps, "done")
    sys.stderr.write("\n")

    print(f"SmolLM2-135M-Instruct, {ids.size} tokens of Britannica (11th ed.) in {args.num_seqs} rows of "
          f"{args.seq_len}, device: {dispatch.platform()} "
          f"({dispatch.device_kind()}); projections quantized, embeddings/norms float")
    head = (f"{'scheme':<28}{'bits/w':>7}{'weights MiB':>12}{'PPL':>9}{'ΔPPL':>8}{'top-1 agree':>12}"
            f"{'tokens/s':>10}")
    print(head)
    print("-" * len(head))
    for name, bits, nbytes, ppl, dppl, agree, tps, note in rows:
        if note:
            print(f"{name:<28}{note}")
            continue
        print(f"{name:<28}{bits:>7.2f}{nbytes / 2**20:>12.1f}{ppl:>9.3f}{dppl:>+8.3f}{agree:>12.1%}{tps:>10.0f}")

    from jquant.apps.quality_table import calibrated_summary
    summary = calibrated_summary()
    if summary:
        print("\n" + summary, end="")

    if kv_dtypes:
        from jquant.apps import kv_quality
        kv_ids = eval_batches(tokenizer, args.kv_seq_len, 2)
        results = kv_quality.evaluate(model, {"params": params}, kv_ids, kv_dtypes)
        print()
        # Its rows are longer than the weight table's, so the same float model reads a lower PPL here.
        longer = (f" (rows of {args.kv_seq_len}, not {args.seq_len} as above: the same float32 model, another "
                  "PPL)" if args.kv_seq_len != args.seq_len else "")
        print(kv_quality.to_table(results, f"float32 weights, KV cache per kv_cache_dtype: {kv_ids.size} tokens in "
                                           f"2 rows of {args.kv_seq_len}{longer}; agreement with the bf16 cache's "
                                           "next-token argmax and its greedy 32 tokens after 64"), end="")

    four_bit = {n: v for n, v in quantized.items() if get_scheme(n).weight_format.startswith(FOUR_BIT)}
    if four_bit:
        best = min(four_bit, key=lambda n: four_bit[n][1])
        prompt = "The history of the printing press"
        prompt_ids = jnp.asarray([tokenizer.encode(prompt)], jnp.int32)
        with intercept_quantized():
            out = generate(model, {"params": four_bit[best][0]}, prompt_ids, args.max_new_tokens,
                           eos_id=tokenizer.eos_id)
        text = tokenizer.decode([int(t) for t in out[0] if int(t) != tokenizer.eos_id])
        print(f"\nbest 4-bit scheme by perplexity: {best}\n{prompt}{text}")
    return 0
