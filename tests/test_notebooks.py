"""The notebooks (``notebooks/*.py``, jupytext percent format) run on CPU without a cell error, within
``TIMEOUT_S`` each, and each has its executed ``.ipynb`` beside it whose cells are its source's, so the
outputs that are committed cannot silently go stale (``make notebooks`` regenerates them)."""

from __future__ import annotations

import json
import pathlib
import sys
import time

import jupytext
import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
SOURCES = sorted(NOTEBOOKS.glob("*.py"))
TIMEOUT_S = 120  # per notebook, kernel start excluded
MAX_IPYNB_BYTES = 1_500_000
KERNEL = "jquant-notebooks"


def test_there_are_notebooks_and_the_readme_lists_them():
    assert SOURCES, f"no notebook sources in {NOTEBOOKS}"
    readme = (NOTEBOOKS / "README.md").read_text()
    missing = [p.name for p in SOURCES if p.name not in readme]
    assert not missing, f"notebooks/README.md does not list {missing}"


@pytest.fixture(scope="module")
def kernel_specs(tmp_path_factory):
    """A kernel spec that runs ipykernel on this very interpreter (not whatever ``python`` is on PATH)."""
    root = tmp_path_factory.mktemp("kernels")
    spec = root / KERNEL
    spec.mkdir()
    spec.joinpath("kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "jquant notebooks (test interpreter)", "language": "python"}))
    return KernelSpecManager(kernel_dirs=[str(root)])


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.stem)
def test_notebook_executes(source, kernel_specs):
    nb = jupytext.read(source)
    km = KernelManager(kernel_name=KERNEL, kernel_spec_manager=kernel_specs)
    deadline = None

    def remaining(cell) -> int:  # nbclient's per-cell timeout, spent from one budget for the notebook
        return max(1, int(deadline - time.monotonic()))

    client = NotebookClient(nb, km=km, timeout_func=remaining, startup_timeout=120,
                            resources={"metadata": {"path": str(ROOT)}})
    with client.setup_kernel():
        deadline = time.monotonic() + TIMEOUT_S
        start = time.monotonic()
        for index, cell in enumerate(nb.cells):
            client.execute_cell(cell, index)  # raises CellExecutionError on an error, CellTimeoutError past the budget
    elapsed = time.monotonic() - start
    assert elapsed < TIMEOUT_S, f"{source.name} took {elapsed:.0f} s (budget {TIMEOUT_S} s)"


def _cells(nb):
    return [(cell.cell_type, cell.source) for cell in nb.cells]


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.stem)
def test_committed_notebook_is_its_source_executed(source):
    ipynb = source.with_suffix(".ipynb")
    assert ipynb.is_file(), f"{ipynb.relative_to(ROOT)} is missing: run `make notebooks` and commit it"
    committed = nbformat.read(ipynb, as_version=4)
    assert _cells(committed) == _cells(jupytext.read(source)), (
        f"{ipynb.relative_to(ROOT)} is stale: its cells differ from {source.name}; run `make notebooks`")
    code = [cell for cell in committed.cells if cell.cell_type == "code"]
    assert all(cell.execution_count for cell in code), f"{ipynb.name} has cells that were not executed"
    errors = [out for cell in code for out in cell.outputs if out.output_type == "error"]
    assert not errors, f"{ipynb.name} was committed with errors: {[e.ename for e in errors]}"
    assert ipynb.stat().st_size < MAX_IPYNB_BYTES, f"{ipynb.name} is {ipynb.stat().st_size:,} bytes"
