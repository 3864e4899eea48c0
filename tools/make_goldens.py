"""Writes the parity goldens under tests/goldens/ from the PyTorch-world reference libraries.

Run it in a Python 3.11 venv with the machine's CPU torch (JAX is not needed there):

    python3.11 -m venv /tmp/ref && /tmp/ref/bin/pip install torch==2.13.0
    /tmp/ref/bin/pip install torchao compressed-tensors bitsandbytes gguf transformers ml_dtypes
    /tmp/ref/bin/pip install --no-deps nvidia-modelopt==0.47.0 && /tmp/ref/bin/pip install omegaconf pulp scipy
    /tmp/ref/bin/python tools/make_goldens.py

gptqmodel downgrades numpy, so its modules run from their own venv:

    python3.11 -m venv /tmp/gptq && /tmp/gptq/bin/pip install torch==2.13.0
    /tmp/gptq/bin/pip install gptqmodel==7.6.0 --no-build-isolation
    /tmp/gptq/bin/python tools/make_goldens.py --venv gptq

Each module tools/goldens/<library>_<topic>.py defines ``VENV`` ("ref" or "gptq") and
``make(out_dir) -> list[path]``; inputs come from fixed seeds, so reruns give the same files, and each
.npz records the library versions it was made with under ``meta_versions``. Name modules to run only
those: ``tools/make_goldens.py bitsandbytes_nf4``.
"""

from __future__ import annotations

import argparse
import importlib
import pathlib
import pkgutil
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("modules", nargs="*", help="golden modules to run (default: all of --venv)")
    parser.add_argument("--venv", default="ref", choices=["ref", "gptq"])
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT / "tools"))
    import goldens

    names = sorted(m.name for m in pkgutil.iter_modules(goldens.__path__) if not m.name.startswith("_"))
    unknown = set(args.modules) - set(names)
    if unknown:
        parser.error(f"unknown golden modules {sorted(unknown)}; choose from {names}")
    out = ROOT / "tests" / "goldens"
    out.mkdir(parents=True, exist_ok=True)
    for name in args.modules or names:
        module = importlib.import_module(f"goldens.{name}")
        if not args.modules and module.VENV != args.venv:
            continue
        for path in module.make(out):
            print("wrote", path)


if __name__ == "__main__":
    main()
