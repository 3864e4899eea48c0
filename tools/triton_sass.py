"""Count the SASS instructions of a Triton-backend decode-attention kernel's main loop, without a GPU.

The kernels are issue-bound where their per-element decode work dominates (TurboQuant: ~0.2 µs of
kernel time per instruction a warp issues per loop step on the H100, ``docs/design/kv_cache.md``), so
the loop's instruction count is a proxy for a change's effect that this machine can compute. The
kernel is lowered to Triton IR as ``tests/cuda_lowering.py`` does, then compiled for sm_90 by the
``triton`` wheel's own compiler and ptxas (not jaxlib's bundled Triton, so counts are approximate).

    pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
        -d /tmp/tri triton==3.9.0 && (cd /tmp/tri && unzip -q -o triton-*.whl -d site)
    TRITON_SITE=/tmp/tri/site python tools/triton_sass.py turboquant_3bit_nc fp8_per_token_head

prints, per KV format at the attention bench's shape (B = 8, ctx 32k, page 16, 32 / 8 heads, d = 128):
instructions of the loop body, registers a thread, shared memory, and the loop's commonest opcodes.
"""

from __future__ import annotations

import argparse
import collections
import os
import pathlib
import re
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

_INSTR = re.compile(r"^[-\w]+:[-\w]+:[-\w]+:[-\w]+:\d+\s+(?:@!?U?P\w+\s+)?([\w.]+)")


def kernel_ttir(kv_cache_dtype: str, batch: int, ctx: int, config) -> str:
    import jax
    import jax.numpy as jnp
    from cuda_lowering import triton_modules

    from jquant.kernels.decode_attention.bench import HEAD_DIM, HEADS, paged_inputs
    from jquant.kernels.decode_attention.paged_cache import cache_decode_attention

    layer, tables, lengths = jax.eval_shape(lambda: paged_inputs(kv_cache_dtype, batch, ctx, 16, jax.random.key(0)))
    q = jax.ShapeDtypeStruct((batch, HEADS, HEAD_DIM), jnp.bfloat16)
    texts = triton_modules(lambda q, l, t, n: cache_decode_attention(q, l, t, n, impl="pallas", config=config),
                           q, layer, tables, lengths)
    return texts[0]


def compile_sass(ttir: str, num_warps: int, num_stages: int) -> tuple[str, str]:
    """(SASS text, ``cuobjdump`` resource usage) of ``ttir`` compiled for sm_90."""
    sys.path.insert(0, os.environ.get("TRITON_SITE", "/tmp/tri/site"))
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")   # what jaxlib's Triton compiles with
    import triton
    from triton.backends.compiler import GPUTarget

    with tempfile.TemporaryDirectory() as tmp:
        src = pathlib.Path(tmp, "kernel.ttir")
        src.write_text(ttir)
        kernel = triton.compile(str(src), target=GPUTarget("cuda", 90, 32),
                                options=dict(num_warps=num_warps, num_stages=num_stages))
        cubin = pathlib.Path(tmp, "kernel.cubin")
        cubin.write_bytes(kernel.asm["cubin"])
        cuobjdump = pathlib.Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
        usage = subprocess.run([str(cuobjdump), "--dump-resource-usage", str(cubin)], capture_output=True,
                               text=True).stdout
    return kernel.asm["sass"], usage


def loop_body(sass: str) -> list[str]:
    """Opcodes of the longest block that ends in a branch back to its own label (the main loop)."""
    labels, ops = {}, []
    for line in sass.splitlines():
        line = line.strip()
        label = re.match(r"^(\w+):$", line)
        if label:
            labels[label.group(1)] = len(ops)
            continue
        m = _INSTR.match(line)
        if m:
            ops.append((m.group(1), line))
    best = []
    for i, (op, line) in enumerate(ops):
        back = re.search(r"\bBRA\s+(\w+)", line)
        if back and labels.get(back.group(1), i + 1) <= i and i + 1 - labels[back.group(1)] > len(best):
            best = [o for o, _ in ops[labels[back.group(1)]:i + 1]]
    return best


def main(argv=None) -> int:
    from jquant.kernels.decode_attention.config import TuningConfig

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kv_cache_dtypes", nargs="+")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--ctx", type=int, default=32768)
    parser.add_argument("--block-tokens", type=int, default=TuningConfig.block_tokens)
    parser.add_argument("--num-warps", type=int, default=TuningConfig.num_warps)
    parser.add_argument("--num-stages", type=int, default=TuningConfig.num_stages)
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args(argv)
    config = TuningConfig(block_tokens=args.block_tokens, num_warps=args.num_warps, num_stages=args.num_stages)
    for kv in args.kv_cache_dtypes:
        sass, usage = compile_sass(kernel_ttir(kv, args.batch, args.ctx, config), args.num_warps, args.num_stages)
        body = loop_body(sass)
        regs = re.search(r"REG:(\d+)", usage)
        shared = re.search(r"SHARED:(\d+)", usage)
        common = ", ".join(f"{op} {n}" for op, n in collections.Counter(body).most_common(args.top))
        print(f"{kv}: {len(body)} instructions a warp per {args.block_tokens}-token step, "
              f"{regs.group(1) if regs else '?'} registers, {shared.group(1) if shared else '?'} B static shared; "
              f"{common}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
