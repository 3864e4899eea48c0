"""Checks for bf16 outputs of fp32 sums that two paths may add in another order."""

import numpy as np


def bf16_step(a):
    """The spacing of bfloat16 at each ``|a|`` (8 significant bits)."""
    return 2.0 ** (np.floor(np.log2(np.maximum(np.abs(np.asarray(a, np.float64)), 2.0**-126))) - 7)


def assert_equal_but_one_sum_order_flip(y, ref, bias=None):
    """``y`` is ``ref`` bit for bit but for at most one output one bf16 step apart: XLA's CPU dot sums K in
    an order that depends on the operands' shapes (Eigen blocks by shape), so the FP8 GEMM layout (N
    padded to 256) and the scheme's own layout differ in 1 output of 3400 in 1 of 450 random cases.
    ``bias``: added to the bf16-rounded sum (block FP8, vLLM's two roundings), where one step of the
    pre-bias sum is up to one more of the output's."""
    y, ref = np.asarray(y, np.float32), np.asarray(ref, np.float32)
    allowed = bf16_step(ref)
    if bias is not None:
        allowed = allowed + bf16_step(ref - np.asarray(bias, np.float32))
    off = y != ref
    assert off.sum() <= 1 and bool(np.all(np.abs(y - ref)[off] <= allowed[off])), (off.sum(), y[off], ref[off])
