"""The top-level names ``formats`` and ``schemes`` are both the listing functions and the packages."""

import importlib

import jquant


def test_formats_and_schemes_are_callable_packages():
    assert "int4" in jquant.formats() and "int4_g128" in jquant.schemes()
    assert jquant.formats.presets() == importlib.import_module("jquant.formats.base").presets()
    import jquant.formats as fm
    import jquant.schemes.spec as spec
    assert fm.quantize is jquant.quantize and spec.WeightSpec is jquant.WeightSpec
    from jquant import formats, schemes
    assert formats() == jquant.formats.formats() and schemes() == jquant.schemes.scheme.schemes()
