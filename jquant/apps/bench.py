"""``jquant bench w4a16 --out bench/results [--shapes 28672x8192,...] [--ms 1,16] [--quick]``.

Times the Mosaic GPU W4A16 kernels against XLA on a CUDA GPU (Hopper for the kernels themselves);
``--interpret`` runs the same plumbing on CPU in Pallas interpret mode, whose timings mean nothing.
"""

from __future__ import annotations

import argparse
import sys


def _shapes(text: str) -> tuple[tuple[int, int], ...]:
    try:
        return tuple(tuple(int(v) for v in s.lower().split("x")) for s in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"shapes must look like 28672x8192,8192x8192; got {text!r}")


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jquant bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="bench", metavar="BENCHMARK", required=True)
    w4 = sub.add_parser("w4a16", help="4-bit weight-only GEMM kernels against XLA")
    w4.add_argument("--out", default="bench/results", help="folder for w4a16.json and w4a16.md")
    w4.add_argument("--shapes", type=_shapes, default=None, help="NxK list, e.g. 28672x8192,8192x8192")
    w4.add_argument("--ms", type=_ints, default=None, help="M values, e.g. 1,16,128")
    w4.add_argument("--schemes", default=None, help="comma list of int4_g128,mxfp4,nvfp4,nf4")
    w4.add_argument("--impls", default="auto", help="w4a16_matmul impls to time, e.g. auto,xla")
    w4.add_argument("--quick", action="store_true", help="3 shapes and 4 M values")
    w4.add_argument("--reps", type=int, default=9)
    w4.add_argument("--max-spread", type=float, default=25.0,
                    help="re-time a cell whose widest batch spread exceeds this (%%)")
    w4.add_argument("--retries", type=int, default=2, help="re-timings of a noisy cell at most")
    w4.add_argument("--interpret", action="store_true", help="run the Pallas kernels in interpret mode")
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    import jax   # imported here: keep --help fast
    from jquant.kernels.w4a16 import bench as w4a16

    shapes = args.shapes or (w4a16.QUICK_SHAPES if args.quick else w4a16.SHAPES)
    ms = args.ms or (w4a16.QUICK_MS if args.quick else w4a16.MS)
    schemes = tuple(args.schemes.split(",")) if args.schemes else tuple(w4a16.SCHEMES)
    unknown = [s for s in schemes if s not in w4a16.SCHEMES]
    if unknown:
        parser.error(f"--schemes: unknown {unknown}; known: {', '.join(w4a16.SCHEMES)}")
    backend = jax.default_backend()
    if backend != "gpu" and not args.interpret:
        print(f"jquant bench: no GPU present (JAX runs on {backend}); the benchmark times CUDA kernels. "
              "Run it on a machine with an NVIDIA GPU (Hopper for the Mosaic GPU kernels) and jax[cuda12] "
              "installed, or add --interpret to check the plumbing on CPU (its timings mean nothing).",
              file=sys.stderr)
        return 1
    records = []
    for shape in shapes:   # rewrite the files after every shape: a run cut short keeps its rows
        records += w4a16.run((shape,), ms, schemes, impls=tuple(args.impls.split(",")),
                             interpret=args.interpret, reps=args.reps,
                             max_spread_pct=args.max_spread, retries=args.retries)
        js, md = w4a16.write(records, args.out)
    print(f"wrote {js} and {md}")
    return 0
