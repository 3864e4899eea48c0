"""SASS opcode counts of dumped Mosaic GPU PTX, on a machine without a GPU.

The device run dumps PTX (``MOSAIC_GPU_DUMP_PTX=1 MOSAIC_GPU_DUMP_TO=dir``, see
``tools/device_w4a16_mgpu.py --sass-only``); PyPI ships the assembler and disassembler:

    python3 -m venv /tmp/cudatools
    /tmp/cudatools/bin/pip install "nvidia-cuda-nvcc==13.0.*" nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm
    PATH=$(echo /tmp/cudatools/lib/python3*/site-packages/nvidia/cu13/bin):$PATH \\
        python3 tools/sass_counts.py dump/kernel_0.ptx dump/kernel_6.ptx

Prints each kernel's register count, its number of SASS instructions and the most frequent
opcodes (``bench/NOTES.md``, session 6: the NF4 table decode's extra ``IMAD.U32`` copies).
"""

from __future__ import annotations

import collections
import pathlib
import re
import subprocess
import sys
import tempfile

_INSTRUCTION = re.compile(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P[0-9T]\s+)?([A-Z0-9_]+(?:\.[A-Z0-9_]+)*)")


def sass_counts(ptx: pathlib.Path, arch: str = "sm_90a") -> tuple[str, collections.Counter]:
    """(ptxas's register line, opcode → count) for one PTX file."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = pathlib.Path(tmp) / "k.cubin"
        report = subprocess.run(["ptxas", f"-arch={arch}", "-O3", "-v", str(ptx), "-o", str(cubin)],
                                check=True, capture_output=True, text=True).stderr
        sass = subprocess.run(["cuobjdump", "-sass", str(cubin)], check=True, capture_output=True,
                              text=True).stdout
    registers = next((line.split(":", 1)[1].strip() for line in report.splitlines()
                      if "registers" in line), "?")
    return registers, collections.Counter(_INSTRUCTION.findall(sass))


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    for path in map(pathlib.Path, argv):
        registers, counts = sass_counts(path)
        top = ", ".join(f"{op} {n}" for op, n in counts.most_common(10))
        print(f"{path.name}: {sum(counts.values())} instructions ({registers}); {top}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
