"""Writes the parity goldens under tests/goldens/ from the PyTorch-world reference libraries.

Run it in a Python 3.11 venv with the machine's CPU torch (JAX is not needed there):

    python3.11 -m venv /tmp/ref && /tmp/ref/bin/pip install torch==2.13.0
    /tmp/ref/bin/pip install torchao compressed-tensors bitsandbytes gguf transformers ml_dtypes
    /tmp/ref/bin/python tools/make_goldens.py [family ...]

gptqmodel downgrades numpy, so its family runs from its own venv:

    python3.11 -m venv /tmp/gptq && /tmp/gptq/bin/pip install torch==2.13.0
    /tmp/gptq/bin/pip install gptqmodel==7.6.0 --no-build-isolation
    /tmp/gptq/bin/python tools/make_goldens.py gptqmodel

Each family lives in tools/goldens/<family>.py with a ``make(out_dir)`` function; inputs are drawn
from a fixed seed so reruns give the same files. The library versions used go into each .npz as
``meta_versions``.
"""

from __future__ import annotations

import argparse
import importlib
import pathlib
import sys

FAMILIES = ["torchao", "compressed_tensors", "bitsandbytes", "gguf", "transformers", "gptqmodel"]
ROOT = pathlib.Path(__file__).resolve().parent.parent


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("families", nargs="*", default=[f for f in FAMILIES if f != "gptqmodel"])
    args = parser.parse_args(argv)
    out = ROOT / "tests" / "goldens"
    out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(ROOT / "tools"))
    for family in args.families:
        if family not in FAMILIES:
            parser.error(f"unknown family {family!r}; choose from {FAMILIES}")
        module = importlib.import_module(f"goldens.{family}")
        for path in module.make(out):
            print("wrote", path)


if __name__ == "__main__":
    main()
