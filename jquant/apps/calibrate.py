"""``jquant calibrate``: SmolLM2-135M quantized with GPTQ (or round-to-nearest) from real text, its
perplexity against the float and round-to-nearest models, and the result as a GPTQ checkpoint.

Calibration rows come from the Britannica text starting at token ``--calib-offset`` (16384 by
default), disjoint from the evaluation slice, which is the first ``--eval-tokens`` tokens (as
``jquant demo`` uses). The checkpoint (``--out``) is an HF-style directory whose ``config.json``
carries the GPTQ ``quantization_config``; ``jquant.checkpoint.hf_checkpoint.load_hf_checkpoint`` (and
so vLLM's GPTQ loader, for the tensors) reads it back.
"""

from __future__ import annotations

import argparse
import time

import jax.numpy as jnp
import numpy as np


def gptq_config(bits: int, group_size: int | None, symmetric: bool, act_order: bool) -> dict:
    """The HF ``quantization_config`` of a GPTQ checkpoint with these settings (``group_size`` None:
    per output channel, written as -1)."""
    return {"quant_method": "gptq", "bits": bits, "group_size": -1 if group_size is None else group_size,
            "sym": symmetric, "desc_act": act_order}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jquant calibrate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--method", choices=("gptq", "rtn"), default="gptq")
    parser.add_argument("--bits", type=int, choices=(2, 3, 4, 8), default=4)
    parser.add_argument("--group-size", type=int, default=64, help="-1: one scale per output channel")
    parser.add_argument("--asym", action="store_true", help="zero points (uint codes); default symmetric")
    parser.add_argument("--act-order", action="store_true", help="GPTQ desc_act (writes g_idx)")
    parser.add_argument("--damp-percent", type=float, default=0.01)
    parser.add_argument("--calib-rows", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per calibration and evaluation row")
    parser.add_argument("--calib-offset", type=int, default=16384,
                        help="first calibration token of the text (the evaluation slice is its start)")
    parser.add_argument("--eval-tokens", type=int, default=2048)
    parser.add_argument("--out", default=None, help="directory for the quantized checkpoint")
    return parser


def run(argv=None) -> int:
    from jquant.algorithms.calibrate import calibrate_llama, gptq_group
    from jquant.checkpoint.hf_checkpoint import PROJECTIONS
    from jquant.flax.rules import quantize_params
    from jquant.apps.data import britannica_text
    from jquant.apps.demo import nll_and_top1
    from jquant.checkpoint.hf_checkpoint import save_hf_checkpoint
    from jquant.checkpoint.hf_config import scheme_from_config
    from jquant.flax import quantized_apply
    from jquant.models import build_tokenizer, load_gguf, smollm2_path
    from jquant.models.llama import LlamaForCausalLM

    parser = build_parser()
    args = parser.parse_args(argv)
    group = None if args.group_size == -1 else args.group_size
    if group is not None and group <= 0:
        parser.error(f"--group-size must be positive or -1, got {args.group_size}")
    if args.act_order and args.method != "gptq":
        parser.error("--act-order is a GPTQ option")
    config = gptq_config(args.bits, group, not args.asym, args.act_order)
    scheme = scheme_from_config(config)

    model_config, variables, tok_meta = load_gguf(smollm2_path())
    tokenizer = build_tokenizer(tok_meta)
    ids = np.asarray(tokenizer.encode(britannica_text()), np.int32)
    n_calib = args.calib_rows * args.seq_len
    if args.eval_tokens > args.calib_offset or args.calib_offset + n_calib > ids.size:
        parser.error(f"the calibration slice [{args.calib_offset}, {args.calib_offset + n_calib}) must lie after "
                     f"the evaluation slice [0, {args.eval_tokens}) inside the text's {ids.size} tokens")
    calib = jnp.asarray(ids[args.calib_offset:args.calib_offset + n_calib].reshape(args.calib_rows, args.seq_len))
    evaluation = jnp.asarray(ids[:args.eval_tokens].reshape(-1, args.seq_len))
    model = LlamaForCausalLM(model_config)
    params = variables["params"]

    def ppl(p):
        logits = quantized_apply(model, {"params": p}, evaluation)[0]
        return float(jnp.exp(nll_and_top1(logits, evaluation)[0]))

    # Round-to-nearest does not read activations: quantize_params gives what calibrate_llama with
    # rtn_group would (tested), without running the layers.
    rtn, _ = quantize_params(params, [(PROJECTIONS, scheme)], prepare=False)
    t0 = time.perf_counter()
    quantized = rtn if args.method == "rtn" else calibrate_llama(
        model, params, calib, gptq_group(scheme, damp_percent=args.damp_percent, act_order=args.act_order))
    seconds = time.perf_counter() - t0
    base, rtn_ppl, got = ppl(params), ppl(rtn), ppl(quantized)
    recovered = (rtn_ppl - got) / (rtn_ppl - base) if rtn_ppl != base else float("nan")
    print(f"SmolLM2-135M, {scheme.name} ({config}), {args.method} on {n_calib} calibration tokens "
          f"in {seconds:.0f} s; perplexity on {evaluation.size} held-out tokens:")
    print(f"  float {base:.3f}   round-to-nearest {rtn_ppl:.3f} ({rtn_ppl - base:+.3f})   {args.method} {got:.3f} "
          f"({got - base:+.3f}; {recovered:.0%} of the round-to-nearest loss recovered)")
    if args.out:
        path = save_hf_checkpoint(quantized, args.out, quantization_config=config)
        print(f"wrote {path}")
    return 0
