"""``jquant bench {w4a16,gemm8,act-quant,attention,insert,decode,gptq,moe} --out bench/results/<device> [options]``.

``w4a16`` times 4-bit weight-only schemes as a model runs them (``get_scheme → quantize_weight →
process_weights_after_loading → apply``) against XLA; ``gemm8`` times the 8-bit schemes (the W8A16
kernel, FP8 W8A8) the same way; ``act-quant`` times the e4m3 activation quantization of the W8A8 FP8
GEMMs (per token, per 1 × 128 group) against XLA; ``attention`` times paged decode attention per
``kv_cache_dtype`` against JAX's own ``paged_attention``; ``insert`` times the quantize-and-insert of new tokens
into the paged cache per ``kv_cache_dtype`` against XLA; ``decode`` times one donated decode step of a
Llama-3-8B-shaped stack per weight scheme × KV dtype, with the bf16 model in the same run; ``gptq`` times
GPTQ of one Llama-3-8B-shaped layer (Hessians and the column loop); ``moe`` times one MoE layer (gpt-oss-20b,
DeepSeek-V3, Qwen3-30B-A3B shapes) per expert format and token count against the same layer on bf16 experts. All need a
CUDA GPU (Hopper for the Mosaic GPU kernels).

Without a GPU, each still runs its plumbing on small inputs (timings mean nothing; the files go to
bench/results/cpu), in seconds to a minute:

  jquant bench w4a16 --interpret --shapes 512x512 --ms 1 --schemes int4_g128 --reps 1
  jquant bench gemm8 --interpret --shapes 512x512 --ms 1 --schemes int8_ch --reps 1
  jquant bench decode --allow-cpu --shrink 8 --layers 1 --batches 1 --ctxs 256 --schemes bf16,int4_g128 --kv-dtypes bf16
  jquant bench gptq --allow-cpu --shrink 16 --rows 4 --seq-len 64 --batch-rows 2
  jquant bench moe --allow-cpu --tiny --shapes gpt-oss-20b --tokens 1 --formats int4_g32 --reps 1
"""

from __future__ import annotations

import argparse
import functools
import sys

from jquant.apps.help_format import HelpFormatter


_OUT_DEFAULT = " (default: bench/results/<device>, e.g. h200 or cpu)"
_REPS = "timed batches per cell (the median is reported)"
# The CPU plumbing command of each benchmark that has one, as the docstring above lists them.
_CPU_EXAMPLES = {line.split()[2]: line.strip() for line in __doc__.splitlines() if line.startswith("  jquant bench ")}


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


def _kv_kernel_options(parser: argparse.ArgumentParser) -> None:
    """The options the paged-cache kernel benchmarks (attention, insert) share."""
    parser.add_argument("--kv-dtypes", default=None, help="comma list of kv_cache_dtype names")
    parser.add_argument("--page-size", type=int, default=16, help="tokens per cache page")
    parser.add_argument("--reps", type=int, default=9, help=_REPS)
    parser.add_argument("--sweep", action="store_true", help="also time the launch configs of bench.SWEEP")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jquant bench", description=__doc__,
                                     formatter_class=HelpFormatter)
    sub = parser.add_subparsers(dest="bench", metavar="BENCHMARK", required=True,
                                parser_class=functools.partial(argparse.ArgumentParser, formatter_class=HelpFormatter))
    w4 = sub.add_parser("w4a16", help="4-bit weight-only GEMM kernels against XLA")
    w4.add_argument("--out", default=None, help="folder for w4a16.json and w4a16.md" + _OUT_DEFAULT)
    w4.add_argument("--shapes", type=_shapes, default=None, help="NxK list, e.g. 28672x8192,8192x8192")
    w4.add_argument("--ms", type=_ints, default=None, help="M values, e.g. 1,16,128")
    w4.add_argument("--schemes", default=None,
                    help="comma list of registered weight-only schemes (default int4_g128,mxfp4,nvfp4,nf4)")
    w4.add_argument("--impls", default="scheme",
                    help="what to time per cell: scheme (scheme.apply, the default) and/or w4a16_matmul "
                         "impls for a kernel-level A/B, e.g. scheme,auto,xla")
    w4.add_argument("--quick", action="store_true", help="3 shapes and 4 M values")
    w4.add_argument("--reps", type=int, default=9, help=_REPS)
    w4.add_argument("--max-spread", type=float, default=25.0,
                    help="re-time a cell whose widest batch spread exceeds this (%%)")
    w4.add_argument("--retries", type=int, default=2, help="re-timings of a noisy cell at most")
    w4.add_argument("--sweep", action="store_true",
                    help="with --impls mgpu: also time the decode launches of bench.DECODE_SWEEP at M <= 16")
    w4.add_argument("--interpret", action="store_true",
                    help="Pallas kernels in interpret mode, so the plumbing runs without a GPU (its timings mean "
                         "nothing). On CPU the default --impls scheme takes XLA's path: add --impls scheme,mgpu "
                         "to include the Pallas kernel")

    att = sub.add_parser("attention", help="paged decode attention per kv_cache_dtype against JAX's kernel")
    att.add_argument("--out", default=None, help="folder for attention.json and attention.md" + _OUT_DEFAULT)
    att.add_argument("--batches", type=_ints, default=(8,), help="sequences per call")
    att.add_argument("--ctxs", type=_ints, default=(32768,), help="tokens in each sequence's cache")
    _kv_kernel_options(att)

    ins = sub.add_parser("insert", help="quantize-and-insert of new KV tokens per kv_cache_dtype against XLA")
    ins.add_argument("--out", default=None, help="folder for insert.json and insert.md" + _OUT_DEFAULT)
    ins.add_argument("--tokens", type=_ints, default=None, help="new tokens per insert (default 8,4096,32768)")
    _kv_kernel_options(ins)

    aq = sub.add_parser("act-quant", help="e4m3 activation quantization (per token, per 1 x 128 group) against XLA")
    aq.add_argument("--out", default=None, help="folder for act_quant.json and act_quant.md" + _OUT_DEFAULT)
    aq.add_argument("--shapes", type=_shapes, default=None,
                    help="MxK list (default 16x4096,4096x8192,4096x14336,4096x7168)")
    aq.add_argument("--reps", type=int, default=9, help=_REPS)
    aq.add_argument("--sweep", action="store_true", help="also time the launch configs of bench.sweep")

    dec = sub.add_parser("decode", help="one decode step of a Llama-3-8B-shaped stack per weights x KV dtype")
    dec.add_argument("--out", default=None, help="folder for decode.json and decode.md" + _OUT_DEFAULT)
    dec.add_argument("--layers", type=int, default=8, help="decoder layers (Llama-3-8B has 32)")
    dec.add_argument("--batches", type=_ints, default=(1, 16), help="sequences per step")
    dec.add_argument("--ctxs", type=_ints, default=(1024, 8192), help="tokens in each sequence's cache")
    dec.add_argument("--schemes", default="bf16,int4_g128", help="bf16 and/or registered scheme names")
    dec.add_argument("--kv-dtypes", default="bf16,fp8", help="comma list of kv_cache_dtype names")
    dec.add_argument("--reps", type=int, default=7, help=_REPS)
    dec.add_argument("--unfused", action="store_true",
                     help="separate q/k/v and gate/up GEMMs (default: fused, as vLLM loads them); "
                          "writes decode_unfused.{json,md}")
    dec.add_argument("--profile", default=None, metavar="DIR",
                     help="also write a jax.profiler trace of a few steps of every cell under DIR")
    dec.add_argument("--in-loop", action="store_true",
                     help="also time each cell's steps inside one jitted lax.scan, as generate runs them")
    dec.add_argument("--tp", type=_ints, default=None, metavar="N,...",
                     help="tensor-parallel degrees, e.g. 1,2,4,8: the step split over that many devices "
                          "(jquant.parallel), collective time broken out; writes decode_tp.{json,md}")
    dec.add_argument("--fp8-collectives", action="store_true",
                     help="with --tp: also time the row-parallel sums as FP8 all-gathers (else bf16 psum only)")
    dec.add_argument("--shrink", type=int, default=1,
                     help="divide hidden size, head_dim, intermediate size and vocabulary by 2, 4 or 8 "
                          "(a quick plumbing check)")
    dec.add_argument("--allow-cpu", action="store_true", help="run without a GPU (timings are the CPU's)")
    g8 = sub.add_parser("gemm8", help="8-bit weight schemes (W8A16 kernel, FP8 W8A8) against XLA bf16")
    g8.add_argument("--out", default=None, help="folder for gemm8.json and gemm8.md" + _OUT_DEFAULT)
    g8.add_argument("--shapes", type=_shapes, default=None,
                    help="NxK list (default 28672x8192,8192x28672,8192x8192,4096x4096)")
    g8.add_argument("--deepseek", action="store_true", help="DeepSeek-V3's block-FP8 projection shapes")
    g8.add_argument("--ms", type=_ints, default=None, help="M values, e.g. 1,16,128")
    g8.add_argument("--schemes", default=None, help="comma list of the 8-bit schemes (default all eight)")
    g8.add_argument("--reps", type=int, default=9, help=_REPS)
    g8.add_argument("--sweep", action="store_true",
                    help="also time the launches of jquant.kernels.w8a16.bench.FP8_SWEEP (FP8 GEMM, M >= 128) "
                         "and W8_SWEEP (W8A16 kernel, M >= 256)")
    g8.add_argument("--interpret", action="store_true",
                    help="the forced kernel (the mgpu rows) in interpret mode, so the plumbing runs without a GPU "
                         "(its timings mean nothing); on CPU the scheme rows take XLA's path")

    gq = sub.add_parser("gptq", help="GPTQ of one Llama-3-8B-shaped layer (7 projections)")
    gq.add_argument("--out", default=None, help="folder for gptq.json and gptq.md" + _OUT_DEFAULT)
    gq.add_argument("--rows", type=int, default=128, help="calibration sequences")
    gq.add_argument("--seq-len", type=int, default=2048, help="tokens per calibration sequence")
    gq.add_argument("--batch-rows", type=int, default=8, help="sequences per Hessian update")
    gq.add_argument("--schemes", default="int4_g128", help="comma list of integer schemes")
    gq.add_argument("--shrink", type=int, default=1,
                    help="divide every projection dimension by this (a quick plumbing check)")
    gq.add_argument("--allow-cpu", action="store_true", help="run without a GPU (timings are the CPU's)")
    _moe_parser(sub)
    return parser


def _moe_parser(sub) -> None:
    # Defaults live in jquant.kernels.moe.bench (SHAPES, TOKENS), imported only to run: keep --help fast.
    moe = sub.add_parser("moe", help="one MoE layer per expert format x tokens against bf16 ragged_dot")
    moe.add_argument("--out", default=None, help="folder for moe.json and moe.md" + _OUT_DEFAULT)
    moe.add_argument("--shapes", default=None,
                     help="comma list of gpt-oss-20b, deepseek-v3, qwen3-30b-a3b (default all)")
    moe.add_argument("--tokens", type=_ints, default=None, help="tokens per call (default 1,8,64,512,4096)")
    moe.add_argument("--formats", default=None,
                     help="comma list of registered schemes for every shape (default each shape's own: "
                          "gpt-oss-20b mxfp4,int4_g32; deepseek-v3 fp8_e4m3_block128x128,int4_g128,mxfp4; "
                          "qwen3-30b-a3b fp8_e4m3_block128x128,int4_g128)")
    moe.add_argument("--reps", type=int, default=9, help=_REPS)
    moe.add_argument("--profile", default=None, metavar="DIR",
                     help="also write a jax.profiler trace of a few calls of the quantized layer and of the "
                          "grouped kernel of every cell under DIR")
    moe.add_argument("--tiny", action="store_true",
                     help="layers a few hundred times smaller, of the same kinds (a quick plumbing check)")
    moe.add_argument("--allow-cpu", action="store_true", help="run without a GPU (timings are the CPU's)")
    moe.add_argument("--tp", type=_ints, default=None, metavar="N,...",
                     help="device counts, e.g. 1,2,4,8: the layer split over that many devices "
                          "(jquant.parallel.moe) against one device, collective time broken out; writes "
                          "moe_tp.{json,md}")
    moe.add_argument("--tp-modes", default="expert,tensor",
                     help="with --tp: comma list of expert (E/n experts a device), tensor (I/n of each expert)")
    moe.add_argument("--fp8-collectives", action="store_true",
                     help="with --tp: also time the all-reduce in FP8 (else bf16 psum only)")


def default_out() -> str:
    """``bench/results/<device>``: a GPU's model number lowercased (``h100``, ``h200``), else the platform
    (``cpu``), so records of different devices never share a file and CPU plumbing runs stay out of the
    GPU tables."""
    import re

    from jquant.schemes import dispatch

    model = re.search(r"\b([A-Z]\d{2,4})\b", dispatch.device_kind()) if dispatch.is_gpu() else None
    return f"bench/results/{model.group(1).lower() if model else dispatch.platform()}"


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.out is None:
        args.out = default_out()
    if args.bench == "w4a16":
        return _w4a16(parser, args)
    if args.bench == "gptq":
        return _gptq(parser, args)
    if args.bench == "moe":
        return _moe(parser, args)
    if args.bench == "gemm8":
        return _gemm8(parser, args)
    if args.bench == "act-quant":
        return _act_quant(parser, args)
    return _model_bench(parser, args)


def _moe(parser, args) -> int:
    from jquant.kernels.moe import bench
    from jquant.schemes import dispatch
    from jquant.schemes.scheme import schemes as registered   # filled by import jquant

    names = args.shapes.split(",") if args.shapes else list(bench.SHAPES)
    tokens = args.tokens or bench.TOKENS
    unknown = [n for n in names if n not in bench.SHAPES]
    if unknown:
        parser.error(f"--shapes: unknown {unknown}; known: {', '.join(bench.SHAPES)}")
    formats = tuple(args.formats.split(",")) if args.formats else None
    unknown = [f for f in formats or () if f not in registered()]
    if unknown:
        parser.error(f"--formats: unknown {unknown}; registered schemes: {', '.join(registered())}")
    if any(t < 1 for t in tokens) or args.reps < 1:
        parser.error("--tokens and --reps must be positive")
    _check_tp(parser, args)
    if not args.allow_cpu and _no_gpu(args):
        return 1
    shapes = [bench.SHAPES[n].tiny() if args.tiny else bench.SHAPES[n] for n in names]
    if args.tp:
        return _moe_split(args, shapes, tokens, formats)
    return _write_as_it_runs("moe", args.out, "moe", bench.to_markdown, lambda on_records: bench.run(
        shapes, tokens, formats, reps=args.reps, cpu=not dispatch.is_gpu(), profile_dir=args.profile,
        on_records=on_records))


def _act_quant(parser, args) -> int:
    from jquant.bench.records import run_meta, write_records
    from jquant.kernels.act_quant import bench

    shapes = args.shapes or bench.SHAPES
    if any(len(s) != 2 or min(s) < 1 for s in shapes) or args.reps < 1:
        parser.error("--shapes must be positive MxK pairs and --reps positive")
    if _no_gpu(args):
        return 1
    meta, records = run_meta(), []
    for shape in shapes:   # rewrite the files after every shape: a run cut short keeps its rows
        records += bench.run((shape,), reps=args.reps, with_sweep=args.sweep, meta=meta)
        js, md = write_records(records, args.out, "act_quant", bench.to_markdown)
    print(f"wrote {js} and {md}")
    return 0


def _write_as_it_runs(what: str, out: str, name: str, to_markdown, run) -> int:
    """``run(on_records)``, whose records are rewritten to ``out/name.{json,md}`` after every cell (a run
    cut short keeps its rows); 1 when no cell ran."""
    from jquant.bench.records import write_records

    written = []
    records = run(lambda recs: written.append(write_records(recs, out, name, to_markdown)))
    if not records:
        print(f"jquant bench {what}: no cell ran (see the FAILED lines above)", file=sys.stderr)
        return 1
    js, md = written[-1]
    print(f"wrote {js} and {md}")
    return 0


def _check_tp(parser, args) -> None:
    """``--tp`` and its companions (``decode``, ``moe``): no more devices than JAX sees."""
    if args.fp8_collectives and not args.tp:
        parser.error("--fp8-collectives needs --tp")
    modes = getattr(args, "tp_modes", "expert").split(",")
    if any(m not in ("expert", "tensor") for m in modes):
        parser.error(f"--tp-modes: each of expert, tensor; got {','.join(modes)}")
    if args.tp:
        import jax
        bad = [n for n in args.tp if n < 1 or n > jax.device_count()]
        if bad:
            parser.error(f"--tp {','.join(map(str, bad))}: each must lie in 1..{jax.device_count()}, the "
                         f"devices JAX sees ({jax.default_backend()})")


def _moe_split(args, shapes, tokens, formats) -> int:
    from jquant.kernels.moe import bench_split
    from jquant.schemes import dispatch

    return _write_as_it_runs("moe --tp", args.out, "moe_tp", bench_split.to_markdown, lambda on_records:
                             bench_split.run_split(shapes, tokens, formats, tps=args.tp,
                                                   modes=tuple(args.tp_modes.split(",")),
                                                   collectives=("psum", "fp8") if args.fp8_collectives else ("psum",),
                                                   reps=args.reps, cpu=not dispatch.is_gpu(), on_records=on_records))


def _gptq(parser, args) -> int:
    from jquant.algorithms import bench
    from jquant.bench.records import run_meta, write_records

    if args.shrink < 1 or 128 % args.shrink:
        parser.error(f"--shrink must divide 128, got {args.shrink}")
    if args.batch_rows < 1 or args.rows < 1 or args.rows % args.batch_rows:
        parser.error(f"--rows must be a positive multiple of --batch-rows, got --rows {args.rows} and "
                     f"--batch-rows {args.batch_rows}")
    if not args.allow_cpu and _no_gpu(args):
        return 1
    meta, records = run_meta(), []
    for scheme in args.schemes.split(","):
        records.append(bench.run(bench.LLAMA3_8B.scaled(args.shrink), rows=args.rows, seq_len=args.seq_len,
                                 batch_rows=args.batch_rows, scheme=scheme, meta=meta))
        js, md = write_records(records, args.out, "gptq", bench.to_markdown)
    print(f"wrote {js} and {md}")
    return 0


def _gemm8(parser, args) -> int:
    from jquant.bench.records import run_meta, write_records
    from jquant.kernels.w8a16 import bench

    names = tuple(args.schemes.split(",")) if args.schemes else tuple(bench.schemes())
    unknown = [n for n in names if n not in bench.schemes()]
    if unknown:
        parser.error(f"--schemes: unknown {unknown}; known: {', '.join(bench.schemes())}")
    if _no_gpu(args):
        return 1
    shapes = args.shapes or (bench.DEEPSEEK_SHAPES if args.deepseek else bench.SHAPES)
    meta, done, written = run_meta(), [], []

    def write(shape_records):   # after every M: a run cut short keeps its rows
        written[:] = write_records(done + shape_records, args.out, "gemm8", bench.to_markdown)

    for shape in shapes:
        done += bench.run((shape,), args.ms or bench.MS, names, reps=args.reps, interpret=args.interpret,
                          sweep=args.sweep, meta=meta, on_records=write)
    print(f"wrote {written[0]} and {written[1]}" if written else "no records")
    return 0


def _check_decode_options(parser, args) -> None:
    """``--shrink`` and ``--tp`` of ``decode``: a usable factor, and no more devices than JAX sees."""
    if args.shrink not in (1, 2, 4, 8):
        parser.error(f"--shrink must be 1, 2, 4 or 8 (head_dim 128 / shrink >= 16), got {args.shrink}")
    _check_tp(parser, args)


def _no_gpu(args) -> bool:
    """True (after saying so) when there is no GPU to time and no --interpret."""
    from jquant.schemes import dispatch   # imported here: keep --help fast

    if dispatch.is_gpu() or getattr(args, "interpret", False):
        return False
    example = _CPU_EXAMPLES.get(args.bench)
    instead = f"; without one, its plumbing runs on CPU (timings mean nothing), e.g. {example}" if example else ""
    print(f"jquant bench: no GPU present (JAX runs on {dispatch.platform()}); the benchmark times CUDA "
          "kernels. Run it on a machine with an NVIDIA GPU (Hopper for the Mosaic GPU kernels) and "
          f"jax[cuda12] installed{instead}.", file=sys.stderr)
    return True


def _w4a16(parser, args) -> int:
    from jquant.kernels.w4a16 import bench as w4a16

    shapes = args.shapes or (w4a16.QUICK_SHAPES if args.quick else w4a16.SHAPES)
    ms = args.ms or (w4a16.QUICK_MS if args.quick else w4a16.MS)
    schemes = tuple(args.schemes.split(",")) if args.schemes else w4a16.SCHEMES
    known = w4a16.known_schemes()
    unknown = [s for s in schemes if s not in known]
    if unknown:
        parser.error(f"--schemes: unknown {unknown}; known: {', '.join(known)}")
    impls = tuple(args.impls.split(","))
    bad = [i for i in impls if i != "scheme" and i not in w4a16.IMPLS]
    if bad:
        parser.error(f"--impls: unknown {bad}; known: scheme, {', '.join(w4a16.IMPLS)}")
    if _no_gpu(args):
        return 1
    records = []
    for shape in shapes:   # rewrite the files after every shape: a run cut short keeps its rows
        records += w4a16.run((shape,), ms, schemes, impls=impls,
                             interpret=args.interpret, reps=args.reps,
                             max_spread_pct=args.max_spread, retries=args.retries, sweep=args.sweep)
        js, md = w4a16.write(records, args.out)
    print(f"wrote {js} and {md}")
    return 0


def _model_bench(parser, args) -> int:
    """``attention``, ``insert``, ``decode``: records written after every cell group, so a cut run keeps rows."""
    from jquant.bench.records import run_meta, write_records
    from jquant.kv.dtypes import kv_cache_spec
    from jquant.schemes.scheme import schemes as registered   # filled by import jquant

    kv_dtypes = tuple(args.kv_dtypes.split(",")) if args.kv_dtypes else None
    for name in kv_dtypes or ():
        try:
            kv_cache_spec(name)
        except ValueError as e:
            parser.error(f"--kv-dtypes: {e}")
    weights = tuple(args.schemes.split(",")) if args.bench == "decode" else ()
    unknown = [s for s in weights if s != "bf16" and s not in registered()]
    if unknown:
        parser.error(f"--schemes: unknown {unknown}; bf16 or one of {', '.join(registered())}")
    if args.bench == "decode":
        _check_decode_options(parser, args)
    if not getattr(args, "allow_cpu", False) and _no_gpu(args):
        return 1
    meta = run_meta()
    records: list[dict] = []
    if args.bench == "attention":
        from jquant.kernels.decode_attention import bench
        for batch in args.batches:
            for ctx in args.ctxs:
                records += bench.run((batch,), (ctx,), kv_dtypes or bench.KV_DTYPES, page_size=args.page_size,
                                     reps=args.reps, meta=meta,
                                     configs=(None,) + (bench.SWEEP if args.sweep else ()))
                js, md = write_records(records, args.out, "attention", bench.to_markdown)
    elif args.bench == "insert":
        from jquant.kernels.kv_insert import bench
        for t in args.tokens or bench.TOKENS:
            records += bench.run((t,), kv_dtypes or bench.KV_DTYPES, page_size=args.page_size, reps=args.reps,
                                 meta=meta, configs=(None,) + (bench.SWEEP if args.sweep else ()))
            js, md = write_records(records, args.out, "insert", bench.to_markdown)
    else:
        from jquant.models import decode_bench as bench
        shape = bench.shrunk_llama3_8b_shape(args.shrink)
        for batch in args.batches:
            for ctx in args.ctxs:
                if args.tp:
                    records += bench.run_tp(args.layers, (batch,), (ctx,), weights, kv_dtypes, tps=args.tp,
                                            collectives=("psum", "fp8") if args.fp8_collectives else ("psum",),
                                            reps=args.reps, meta=meta, shape=shape, fused=not args.unfused)
                    js, md = write_records(records, args.out, "decode_tp_unfused" if args.unfused else "decode_tp",
                                           bench.tp_to_markdown)
                    continue
                records += bench.run(args.layers, (batch,), (ctx,), weights, kv_dtypes, reps=args.reps, meta=meta,
                                     profile_dir=args.profile, fused=not args.unfused, shape=shape,
                                     in_loop=args.in_loop)
                js, md = write_records(records, args.out, "decode_unfused" if args.unfused else "decode",
                                       bench.to_markdown)
    print(f"wrote {js} and {md}")
    return 0
