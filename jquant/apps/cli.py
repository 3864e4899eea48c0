"""The ``jquant`` command: ``demo``, ``bench`` and ``ledger``."""

from __future__ import annotations

import argparse
import importlib.metadata
import math
import sys

from jquant.apps.help_format import HelpFormatter


def _demo(argv) -> int:
    from jquant.apps.demo import run

    return run(argv)


def _bench(argv) -> int:
    from jquant.apps.bench import main as bench_main

    return bench_main(argv)


def _positive(kind):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a positive {kind.__name__}, got {text!r}")
        if not (value > 0 and math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"must be a positive {kind.__name__}, got {text!r}")
        return value
    return parse


def build_ledger_parser() -> argparse.ArgumentParser:
    from jquant.kv.dtypes import VALID_NAMES as KV_DTYPES

    parser = argparse.ArgumentParser(prog="jquant ledger", description=_ledger.__doc__,
                                     formatter_class=HelpFormatter)
    parser.add_argument("--schemes", default="int8_ch,fp8_e4m3_channel,int4_g64,mxfp4,nvfp4,nf4_dq",
                        help="comma-separated registered schemes, one row each after the float32 one "
                             "(default %(default)s)")
    parser.add_argument("--batch", type=_positive(int), default=8,
                        help="sequences the KV cache holds (default %(default)s)")
    parser.add_argument("--context", type=_positive(int), default=8192,
                        help="tokens per sequence (default %(default)s)")
    parser.add_argument("--kv-dtype", default="bf16", choices=KV_DTYPES,
                        help="a vLLM kv_cache_dtype (default %(default)s)")
    parser.add_argument("--budget-mib", type=_positive(float), default=1024.0,
                        help="memory for weights + KV cache (default %(default)s)")
    return parser


def _ledger(argv) -> int:
    """Memory account of SmolLM2-135M under each scheme, with its KV cache and the concurrency a budget allows."""
    from jquant.apps.ledger import format_table, scheme_ledger, serving_ledger
    from jquant.models import load_gguf, smollm2_path
    from jquant.checkpoint.hf_checkpoint import PROJECTIONS
    from jquant.schemes.scheme import schemes

    parser = build_ledger_parser()
    args = parser.parse_args(argv)
    names = [s for s in args.schemes.split(",") if s]
    unknown = [n for n in names if n not in schemes()]
    if unknown:
        parser.error(f"unknown schemes {unknown}; registered: {', '.join(schemes())}")
    config, variables, _ = load_gguf(smollm2_path())
    kv = dict(num_layers=config.num_layers, num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
              batch=args.batch, context=args.context, kv_dtype=args.kv_dtype)
    rows = [serving_ledger("float32 (unquantized)", variables["params"], **kv),
            *(scheme_ledger(name, variables["params"], PROJECTIONS, **kv) for name in names)]
    print(f"SmolLM2-135M, KV cache {args.batch} × {args.context} tokens in {args.kv_dtype}; "
          f"'max seqs' = sequences of {args.context} tokens fitting in {args.budget_mib:g} MiB")
    print(format_table(rows, int(args.budget_mib * 2**20)))
    return 0


def _calibrate(argv) -> int:
    from jquant.apps import calibrate

    return calibrate.run(argv)


def _embed_quality(argv) -> int:
    from jquant.apps import embedding_quality

    return embedding_quality.run(argv)


COMMANDS = {"demo": (_demo, "SmolLM2-135M under every registered scheme: perplexity, top-1 agreement, bytes, tokens/s"),
            "bench": (_bench, "benchmarks (w4a16, gemm8, act-quant, attention, insert, decode, gptq, moe) timed "
                              "on a CUDA GPU; on CPU only plumbing checks: --interpret (w4a16, gemm8), --allow-cpu "
                              "(decode, gptq, moe)"),
            "ledger": (_ledger, "memory account: codes, scales, float tensors, KV cache, sequences a budget fits"),
            "calibrate": (_calibrate, "SmolLM2-135M with GPTQ, AWQ, SmoothQuant or RTN (optionally Hadamard-rotated) "
                                      "from real text: perplexity, the quality table, a checkpoint"),
            "embed-quality": (_embed_quality, "all-MiniLM-L6-v2 sentence embeddings under each weight scheme: "
                                              "cosine to float, bits")}


def _version() -> str:
    try:
        return importlib.metadata.version("jquant")
    except importlib.metadata.PackageNotFoundError:   # run from a source tree that was never installed
        return "unknown (not installed: pip install -e .)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jquant", description="LLM quantization for JAX.",
                                     epilog="`jquant COMMAND --help` describes each command's options.")
    parser.add_argument("--version", action="version", version=f"jquant {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (_, help_text) in COMMANDS.items():
        # add_help=False: the command's own parser answers --help and reads every option after its name.
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in COMMANDS:
        return COMMANDS[argv[0]][0](argv[1:]) or 0
    # --help and --version exit 0; no command, an unknown one or an option before it is a usage error.
    args = build_parser().parse_args(argv)
    return COMMANDS[args.command][0]([]) or 0


if __name__ == "__main__":
    sys.exit(main())
