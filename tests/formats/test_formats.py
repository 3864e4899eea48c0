"""Checks every registered format shares: the same clear errors for arrays that cannot be quantized."""

import numpy as np
import pytest

import jquant


@pytest.mark.parametrize("fmt", jquant.formats())
@pytest.mark.parametrize("bad,error,pattern", [
    (np.ones((4, 64), np.int32), TypeError, r"floating dtype, got int32 \(shape \(4, 64\)\)"),
    (np.ones((0, 64), np.float32), ValueError, r"empty \(shape \(0, 64\)\)"),
    (np.ones((4, 0), np.float32), ValueError, "empty"),
    (np.float32(1.0), ValueError, r"at least 1 dimension.*shape \(\)"),
], ids=["int-dtype", "empty-rows", "empty-cols", "0-d"])
def test_unquantizable_arrays(fmt, bad, error, pattern):
    with pytest.raises(error, match=pattern):
        jquant.quantize(bad, fmt)
