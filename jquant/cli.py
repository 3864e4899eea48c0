"""The ``jquant`` command: ``demo``, ``bench`` and ``ledger``."""

from __future__ import annotations

import argparse
import sys


def _demo(argv) -> int:
    from jquant.demo import run

    return run(argv)


def _bench(argv) -> int:
    from jquant.bench import main as bench_main

    return bench_main(argv)


def _ledger(argv) -> int:
    """Memory account of SmolLM2-135M under each scheme, with its KV cache and the concurrency a budget allows."""
    from jquant.models.hf_checkpoint import PROJECTIONS
    from jquant.ledger import KV_DTYPES, format_table, serving_ledger
    from jquant.models import load_gguf, smollm2_path
    from jquant.nn import quantize_params
    from jquant.registry import schemes

    parser = argparse.ArgumentParser(prog="jquant ledger", description=_ledger.__doc__)
    parser.add_argument("--schemes", default="int8_ch,fp8_e4m3_channel,int4_g64,mxfp4,nvfp4,nf4_dq")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--kv-dtype", default="bf16", choices=sorted(KV_DTYPES))
    parser.add_argument("--budget-mib", type=float, default=1024.0, help="memory for weights + KV cache")
    args = parser.parse_args(argv)
    names = [s for s in args.schemes.split(",") if s]
    unknown = set(names) - set(schemes())
    if unknown:
        parser.error(f"unknown schemes {sorted(unknown)}; registered: {', '.join(schemes())}")
    config, variables, _ = load_gguf(smollm2_path())
    kv = dict(num_layers=config.num_layers, num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
              batch=args.batch, context=args.context, kv_dtype=args.kv_dtype)
    rows = [serving_ledger("float32 (unquantized)", variables["params"], **kv)]
    for name in names:
        qparams, _ = quantize_params(variables["params"], [(PROJECTIONS, name)], prepare=False)
        rows.append(serving_ledger(name, qparams, **kv))
    print(f"SmolLM2-135M, KV cache {args.batch} × {args.context} tokens in {args.kv_dtype}; "
          f"'max seqs' = sequences of {args.context} tokens fitting in {args.budget_mib:.0f} MiB")
    print(format_table(rows, int(args.budget_mib * 2**20)))
    return 0


COMMANDS = {"demo": _demo, "bench": _bench, "ledger": _ledger}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: jquant {{{'|'.join(COMMANDS)}}} [options]   (jquant COMMAND --help for each)", file=sys.stderr)
        return 2
    return COMMANDS[argv[0]](argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
