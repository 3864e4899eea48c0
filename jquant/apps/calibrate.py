"""``jquant calibrate``: SmolLM2-135M quantized with GPTQ, AWQ, SmoothQuant or round-to-nearest (with an
optional Hadamard rotation) from real text, its perplexity against the float and round-to-nearest
models, and the result as a checkpoint.

Calibration rows come from the Britannica text starting at token ``--calib-offset`` (16384 by
default), disjoint from the evaluation slice, which is the first ``--eval-tokens`` tokens (as
``jquant demo`` uses). The weights are an integer GPTQ format from ``--bits/--group-size/--asym``, or
any registered scheme with ``--scheme`` (``mxfp4``, ``nvfp4``, ``fp8_e4m3_channel``, ...). ``--out``
writes an HF-style directory whose ``config.json`` carries the ``quantization_config`` vLLM reads:
``gptq``, or ``awq`` for AWQ's uint4 format, for the integer formats; with ``--scheme``, the layout of
``jquant.checkpoint.scheme_config.checkpoint_config`` (compressed-tensors for int8, FP8 per channel,
NVFP4, ``mxfp4_ct`` and ``mxfp8_ct``, ``fp8`` for block FP8, ``bitsandbytes`` for NF4 / FP4; ``mxfp4`` and
``mxfp8``, with OCP's scales, have none).
``load_hf_checkpoint`` reads it back.
``--record FILE.json`` adds the run's rows (float, round-to-nearest, the method) to a quality table
and rewrites its markdown twin (``FILE.md``).
"""

from __future__ import annotations

import argparse
import math
import re
import time

import jax
import jax.numpy as jnp
import numpy as np

from jquant.apps.help_format import HelpFormatter
from jquant.checkpoint.scheme_config import awq_config, checkpoint_config, gptq_config

METHODS = ("gptq", "awq", "smoothquant", "rtn")


def build_parser() -> argparse.ArgumentParser:
    from jquant.schemes.scheme import schemes

    parser = argparse.ArgumentParser(prog="jquant calibrate", description=__doc__,
                                     formatter_class=HelpFormatter)
    parser.add_argument("--method", choices=METHODS, default="gptq",
                        help="gptq (Hessian error feedback), awq (activation-aware scales), smoothquant "
                             "(activation outliers moved into the weights) or rtn (round to nearest)")
    parser.add_argument("--scheme", default=None, help=f"a registered scheme, one of {', '.join(schemes())} "
                                                        "(overrides --bits/--group-size/--asym)")
    parser.add_argument("--bits", type=int, choices=(2, 3, 4, 8), default=4, help="integer code width")
    parser.add_argument("--group-size", type=int, default=64, help="-1: one scale per output channel")
    parser.add_argument("--asym", action="store_true", help="zero points (uint codes); default symmetric")
    parser.add_argument("--act-order", action="store_true", help="GPTQ desc_act (writes g_idx)")
    parser.add_argument("--damp-percent", type=float, default=0.01,
                        help="GPTQ: fraction of the mean Hessian diagonal added to it")
    parser.add_argument("--rotate", type=int, default=None, choices=(16, 32, 64, 128),
                        help="Hadamard block: quantize W·H, rotate the inputs online (rtn, gptq)")
    parser.add_argument("--alpha", type=float, default=0.5, help="SmoothQuant migration strength")
    parser.add_argument("--calib-rows", type=int, default=32, help="calibration rows of --seq-len tokens")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per calibration and evaluation row")
    parser.add_argument("--calib-offset", type=int, default=16384,
                        help="first calibration token of the text (the evaluation slice is its start)")
    parser.add_argument("--eval-tokens", type=int, default=2048, help="tokens of the perplexity evaluation")
    parser.add_argument("--out", default=None,
                        help="directory for the quantized checkpoint, in the layout vLLM reads for the scheme "
                             "(GPTQ, AWQ, compressed-tensors, fp8, bitsandbytes)")
    parser.add_argument("--record", default=None, help="quality table (.json) to add this run's rows to")
    return parser


def _check(parser, args) -> tuple[dict | None, "object"]:
    """The checkpoint's ``quantization_config`` (None when no checkpoint layout applies) and the scheme."""
    from jquant.algorithms.gptq import FP4_FORMATS, takes_scheme
    from jquant.checkpoint.hf_config import scheme_from_config
    from jquant.schemes.scheme import get_scheme

    group = None if args.group_size == -1 else args.group_size
    if group is not None and group <= 0:
        parser.error(f"--group-size must be positive or -1, got {args.group_size}")
    if args.act_order and args.method != "gptq":
        parser.error("--act-order is a GPTQ option")
    if args.rotate and args.method not in ("gptq", "rtn"):
        parser.error("--rotate goes with --method gptq or rtn")
    if args.scheme is not None:
        try:
            scheme = get_scheme(args.scheme)
        except (KeyError, ValueError) as e:
            parser.error(str(e))
        config = None
        if args.out:
            # The config's scheme runs the same numerics as the registered one and writes its layout.
            try:
                config = checkpoint_config(args.scheme, act_order=args.act_order)
            except ValueError as e:
                parser.error(f"--out: {e}")
            scheme = scheme_from_config(config)
    elif args.method == "awq" and args.asym:
        if group is None:
            parser.error("AWQ checkpoints need a group size (not -1)")
        config = awq_config(args.bits, group)
        scheme = scheme_from_config(config)
    else:
        config = gptq_config(args.bits, group, not args.asym, args.act_order)
        scheme = scheme_from_config(config)
    if args.method == "gptq" and not takes_scheme(scheme):
        parser.error(f"--method gptq quantizes integer formats, {' and '.join(FP4_FORMATS)}; {scheme.name} has "
                     f"{scheme.weight.format} weights: use --method rtn, awq or smoothquant")
    if args.method == "smoothquant" and not 0.0 <= args.alpha <= 1.0:
        parser.error(f"--alpha must be in [0, 1], got {args.alpha}")
    if args.out and args.rotate:
        parser.error("--out: vLLM checkpoints hold no online rotation (--rotate); save rotated results with "
                     "jquant.flax.orbax_io.save_quantized")
    return config, scheme


def _check_group_size(parser, args, scheme, params) -> None:
    """Refuses a group size that does not divide the input size K of every projection, naming the K
    values it misses and a group size that divides them all, before the model's text is read."""
    from jquant.checkpoint.hf_checkpoint import PROJECTIONS
    from jquant.checkpoint.writer import path_str

    group = scheme.weight.group_size
    if group is None:
        return
    users: dict[int, list[str]] = {}   # K -> the projections with that input size
    for path, kernel in jax.tree_util.tree_flatten_with_path(params)[0]:
        name = path_str(path)
        if re.fullmatch(PROJECTIONS, name):
            projections = users.setdefault(int(kernel.shape[0]), [])   # Flax kernels are [K, N]
            if name.split("/")[-2] not in projections:   # one entry per projection, not per layer
                projections.append(name.split("/")[-2])
    bad = sorted(k for k in users if k % group)
    if not bad:
        return
    # Group sizes are powers of two: the largest dividing every K, at most the one asked for when one is.
    common = math.gcd(*users)
    fits = [2**i for i in range(common.bit_length()) if common % 2**i == 0]
    suggestion = max([g for g in fits if g <= group] or fits)
    if args.scheme is not None:   # --scheme overrides --group-size
        option, hint = f"--scheme {args.scheme} (groups of {group})", f"groups of {suggestion}"
    else:
        option, hint = f"--group-size {group}", f"--group-size {suggestion}"
        if not (args.method == "awq" and args.asym):   # AWQ checkpoints need groups
            hint += " or -1 (one scale per output channel)"
    misses = "; ".join(f"K = {k} ({', '.join(users[k])})" for k in bad)
    parser.error(f"{option} does not divide the input size K of these weights: {misses}; use a group size "
                 f"dividing every K ({', '.join(map(str, sorted(users)))}), e.g. {hint}")


def weights_label(args, scheme) -> str:
    """The quality table's weights column: ``int4 g64 sym``, ``mxfp4``, ``nvfp4 + Hadamard 16``."""
    if args.scheme is not None:
        label = scheme.name
    else:
        group = "per-channel" if args.group_size == -1 else f"g{args.group_size}"
        label = f"int{args.bits} {group} {'asym' if args.asym else 'sym'}"
    return label + (f" + Hadamard {args.rotate}" if args.rotate else "")


def method_label(args) -> str:
    return {"gptq": "GPTQ" + (", act-order" if args.act_order else ""), "awq": "AWQ",
            "smoothquant": f"SmoothQuant α={args.alpha:g}", "rtn": "round-to-nearest"}[args.method]


def bits_per_weight(params) -> float:
    """Stored bits per quantized weight over every QParam (codes, scales, zeros), as jquant holds them."""
    from jquant.schemes.qparam import QParam

    bits = count = 0
    for leaf in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, QParam)):
        if isinstance(leaf, QParam):
            qt = leaf.qtensor
            bits += 8 * sum(a.nbytes for a in jax.tree.leaves(qt))
            count += int(np.prod(qt.shape))
    return bits / count


def run(argv=None) -> int:
    from jquant.algorithms.awq import awq_llama
    from jquant.algorithms.calibrate import calibrate_llama, gptq_group, rtn_group
    from jquant.algorithms.smoothquant import smoothquant_llama
    from jquant.apps.data import britannica_text
    from jquant.apps.demo import nll_and_top1
    from jquant.apps.quality_table import Row, current_commit, record_rows
    from jquant.checkpoint.hf_checkpoint import PROJECTIONS, save_hf_checkpoint
    from jquant.flax import quantized_apply
    from jquant.flax.rules import quantize_params
    from jquant.models import build_tokenizer, load_gguf, smollm2_path
    from jquant.models.llama import LlamaForCausalLM

    parser = build_parser()
    args = parser.parse_args(argv)
    config, scheme = _check(parser, args)
    commit = current_commit()

    model_config, variables, tok_meta = load_gguf(smollm2_path())
    params = variables["params"]
    _check_group_size(parser, args, scheme, params)
    # Round-to-nearest does not read activations: quantize_params gives what calibrate_llama with
    # rtn_group would (tested), without running the layers.
    try:
        rtn, _ = quantize_params(params, [(PROJECTIONS, scheme)], prepare=False)
    except ValueError as e:   # a scheme that does not tile these weights, e.g. FP8 blocks of 128 on K = 576
        parser.error(str(e))
    tokenizer = build_tokenizer(tok_meta)
    ids = np.asarray(tokenizer.encode(britannica_text()), np.int32)
    n_calib = args.calib_rows * args.seq_len
    if args.eval_tokens > args.calib_offset or args.calib_offset + n_calib > ids.size:
        parser.error(f"the calibration slice [{args.calib_offset}, {args.calib_offset + n_calib}) must lie after "
                     f"the evaluation slice [0, {args.eval_tokens}) inside the text's {ids.size} tokens")
    calib = jnp.asarray(ids[args.calib_offset:args.calib_offset + n_calib].reshape(args.calib_rows, args.seq_len))
    evaluation = jnp.asarray(ids[:args.eval_tokens].reshape(-1, args.seq_len))
    model = LlamaForCausalLM(model_config)

    def ppl(p):
        logits = quantized_apply(model, {"params": p}, evaluation)[0]
        return float(jnp.exp(nll_and_top1(logits, evaluation)[0]))

    t0 = time.perf_counter()
    if args.method == "gptq":
        quantized = calibrate_llama(model, params, calib, gptq_group(
            scheme, rotation=args.rotate, damp_percent=args.damp_percent, act_order=args.act_order))
    elif args.method == "awq":
        quantized = awq_llama(model, params, calib, scheme)
    elif args.method == "smoothquant":
        quantized = smoothquant_llama(model, params, calib, scheme, alpha=args.alpha)
    elif args.rotate:
        quantized = calibrate_llama(model, params, calib, rtn_group(scheme, rotation=args.rotate), progress=False)
    else:
        quantized = rtn
    seconds = time.perf_counter() - t0
    base, rtn_ppl, got = ppl(params), ppl(rtn), ppl(quantized)
    recovered = (rtn_ppl - got) / (rtn_ppl - base) if rtn_ppl != base else float("nan")
    method = method_label(args)
    print(f"SmolLM2-135M, {weights_label(args, scheme)} ({scheme.name}), {method} on {n_calib} calibration "
          f"tokens in {seconds:.0f} s; perplexity on {evaluation.size} held-out tokens:")
    print(f"  float {base:.3f}   round-to-nearest {rtn_ppl:.3f} ({rtn_ppl - base:+.3f})   {method} {got:.3f} "
          f"({got - base:+.3f}; {recovered:.0%} of the round-to-nearest loss recovered)")
    if args.record:
        label = weights_label(args, scheme)
        plain = weights_label(argparse.Namespace(**{**vars(args), "rotate": None}), scheme)
        rows = [Row("float (from Q4_1)", "", 16.0, base),
                Row(plain, "round-to-nearest", bits_per_weight(rtn), rtn_ppl)]
        if args.method != "rtn" or args.rotate:
            rows.append(Row(label, method, bits_per_weight(quantized), got, recovered=recovered,
                            seconds=round(seconds), baseline=plain))
        path = record_rows(args.record, rows, commit)
        print(f"recorded in {path} and {path.with_suffix('.md')}")
    if args.out:
        path = save_hf_checkpoint(quantized, args.out, quantization_config=config,
                                  model_config=model_config.to_hf_config())
        print(f"wrote {path}")
    return 0
