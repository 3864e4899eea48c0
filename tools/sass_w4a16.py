"""Counts the sm_90 SASS instructions of a W4A16 kernel variant's inner loop, without a GPU.

Lowers ``w4a16_pallas`` for CUDA with a stand-in H200 (as the lowering test does), captures the Triton
IR that Pallas emits, and compiles it to a cubin with a separately installed ``triton`` wheel (its
own ptxas and nvdisasm; no GPU or driver needed), then reports registers, spills and the instruction
mix of every loop, per 4-bit code. The wheel is not a project dependency: install it elsewhere,

    python3 -m venv /tmp/tv && /tmp/tv/bin/pip install triton
    PYTHONPATH=. .venv/bin/python tools/sass_w4a16.py --triton-python /tmp/tv/bin/python \\
        --mode gemv --variant grouped_prefetch --block-n 128 --block-k 128

Caveat: upstream Triton's passes are not XLA's Triton fork; the counts are a close proxy for what the
H200 runs, not the same binary. ``--out DIR`` keeps the .ttir/.ttgir/.ptx/.sass files.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import pathlib
import re
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from jquant.pallas_kernels import TuningConfig, prepack

_COMPILE = """
import json, os, sys, triton
from triton.backends.compiler import GPUTarget
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
src, warps, stages = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                   options=dict(num_warps=warps, num_stages=stages))
base = src.rsplit(".", 1)[0]
for key in ("ttgir", "ptx"):
    open(base + "." + key, "w").write(k.asm[key])
open(base + ".cubin", "wb").write(k.asm["cubin"])
bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
print(json.dumps(dict(bin_dir=bin_dir, shared=k.metadata.shared)))
"""


def triton_ir(mode: str, cfg: TuningConfig, lut: str, group: int, m: int, k: int, n: int,
              x_dtype=jnp.bfloat16) -> str:
    """The Triton IR (text) that Pallas emits for one kernel variant."""
    from jax._src.pallas.triton import gpu_info, lowering, pallas_call_registration
    from jquant.pallas_kernels.w4a16_triton import w4a16_pallas
    h200 = gpu_info._get_gpu_info_impl(gpu_info.GpuVersion.H200)
    captured = []
    real_lower = lowering.lower_jaxpr_to_triton_module

    def capture(*args, **kwargs):
        result = real_lower(*args, **kwargs)
        captured.append(result.module.operation.get_asm())
        return result

    saved = (pallas_call_registration.gpu_info_lib.get_gpu_info,
             pallas_call_registration.lowering.lower_jaxpr_to_triton_module)
    pallas_call_registration.gpu_info_lib.get_gpu_info = lambda: h200
    pallas_call_registration.lowering.lower_jaxpr_to_triton_module = capture
    try:
        rng = np.random.default_rng(0)
        q = rng.integers(0, 16, (k, n)).astype(np.uint8)
        scale = np.ones((max(1, k // group), n), np.float32)
        packed = prepack(q, scale, lut=lut, group_size=group, config=cfg,
                         global_scale=0.5 if lut == "e2m1" and group == 16 else None)
        x = jnp.zeros((m, packed.k_pad), x_dtype)
        checks = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
        fn = jax.jit(lambda x, p: w4a16_pallas(x, p, mode=mode, config=cfg))
        jax.export.export(fn, platforms=["cuda"], disabled_checks=checks)(x, packed)
    finally:
        (pallas_call_registration.gpu_info_lib.get_gpu_info,
         pallas_call_registration.lowering.lower_jaxpr_to_triton_module) = saved
    return captured[-1]


def loop_histograms(sass: str) -> list[collections.Counter]:
    """Opcode counts of each loop (a label that a later branch jumps back to), outermost last."""
    labels, instrs = {}, []
    for line in sass.splitlines():
        if (lab := re.match(r"^(\.L_x_\d+):", line)):
            labels[lab.group(1)] = len(instrs)
        elif (ins := re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+(.*?);", line)):
            instrs.append(re.sub(r"^@!?U?P\w+\s+", "", ins.group(1)))
    loops = []
    for pos, text in enumerate(instrs):
        target = re.search(r"BRA `?\(?(\.L_x_\d+)", text)
        if target and labels.get(target.group(1), pos + 1) <= pos:
            body = instrs[labels[target.group(1)]:pos + 1]
            loops.append(collections.Counter(t.split()[0].split(".")[0] for t in body))
    return [c for c in loops if sum(c.values()) > 1]


def analyse(mode, cfg, lut, group, m, triton_python, out_dir: pathlib.Path, x_dtype=jnp.bfloat16):
    k = 4 * cfg.split_k * cfg.block_k
    ir = triton_ir(mode, cfg, lut, group, m, k, 2 * cfg.block_n, x_dtype)
    src = out_dir / f"{mode}_{cfg.variant}_{lut}.ttir"
    src.write_text(ir)
    meta = json.loads(subprocess.run([triton_python, "-c", _COMPILE, str(src), str(cfg.num_warps),
                                      str(cfg.num_stages)], check=True, capture_output=True,
                                     text=True).stdout.strip().splitlines()[-1])
    cubin = src.with_suffix(".cubin")
    sass = subprocess.run([f"{meta['bin_dir']}/nvdisasm", "-c", str(cubin)], check=True,
                          capture_output=True, text=True).stdout
    src.with_suffix(".sass").write_text(sass)
    usage = subprocess.run([f"{meta['bin_dir']}/cuobjdump", "-res-usage", str(cubin)], check=True,
                           capture_output=True, text=True).stdout
    regs = int(re.search(r"REG:(\d+)", usage).group(1))
    stack = int(re.search(r"STACK:(\d+)", usage).group(1))
    loops = loop_histograms(sass)
    main = max(loops, key=lambda c: sum(c.values())) if loops else collections.Counter()
    codes_per_thread = cfg.block_k * cfg.block_n // (32 * cfg.num_warps)   # one K tile per step
    total = sum(main.values())
    return dict(mode=mode, variant=cfg.variant, lut=lut, group=group, m=m,
                config=dataclasses.asdict(cfg), registers=regs, stack_bytes=stack,
                shared_bytes=meta["shared"], loop_instructions=total,
                instructions_per_code=round(total / codes_per_thread, 2),
                pipelined_loads=main.get("LDGSTS", 0) > 0, barriers=main.get("BAR", 0),
                opcodes_per_code={op: round(c / codes_per_thread, 3)
                                  for op, c in main.most_common(14)})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--triton-python", required=True, help="a python with the triton wheel")
    parser.add_argument("--mode", default="gemv", choices=("gemv", "mma"))
    parser.add_argument("--variant", default="base")
    parser.add_argument("--lut", default="int4")
    parser.add_argument("--group", type=int, default=128)
    parser.add_argument("--m", type=int, default=1)
    parser.add_argument("--x-dtype", default="bfloat16")
    parser.add_argument("--block-n", type=int, default=64)
    parser.add_argument("--block-k", type=int, default=512)
    parser.add_argument("--block-m", type=int, default=16)
    parser.add_argument("--split-k", type=int, default=4)
    parser.add_argument("--num-warps", type=int, default=4)
    parser.add_argument("--num-stages", type=int, default=2)
    parser.add_argument("--out", help="keep the intermediate files here")
    args = parser.parse_args(argv)
    cfg = TuningConfig(args.block_n, args.block_k, args.split_k, args.num_warps, args.num_stages,
                       args.block_m if args.mode == "mma" else 1, args.variant)
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(args.out or tmp)
        out.mkdir(parents=True, exist_ok=True)
        rec = analyse(args.mode, cfg, args.lut, args.group, args.m, args.triton_python, out,
                      jnp.dtype(args.x_dtype))
    print(json.dumps(rec, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
