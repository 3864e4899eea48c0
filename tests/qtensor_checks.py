"""Shared assertion: two QTensors hold the same bits and metadata."""

import numpy as np

import jquant


def assert_same_qtensor(a, b):
    """Identical leaves (dtypes and bits, nested scales included) and format metadata.

    ``k_axis`` must agree where both record it: a per-tensor ``quantize`` cannot know it, while a
    checkpoint loader knows its weights are ``[N, K]``.
    """
    assert (a.fmt, a.shape, a.dtype, a.block, a.pack_axis, a.options) == \
        (b.fmt, b.shape, b.dtype, b.block, b.pack_axis, b.options)
    assert a.k_axis is None or b.k_axis is None or a.k_axis == b.k_axis, (a.k_axis, b.k_axis)
    for name in ("data", "scale", "zero", "global_scale", "group_index"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if isinstance(x, jquant.QTensor):
            assert_same_qtensor(x, y)
        elif x is not None:
            assert x.dtype == y.dtype and x.shape == y.shape, name
            np.testing.assert_array_equal(np.atleast_1d(x).view(np.uint8), np.atleast_1d(y).view(np.uint8),
                                          err_msg=name)
