"""Lower a jitted function that calls Triton-backend Pallas kernels for CUDA, on a machine without a
GPU: the Triton lowering runs in Python (jax._src.pallas.triton.lowering), so unsupported ops, bad
block shapes and dtype casts fail here as they would on the device. Only PTX compilation and the run
itself are left to ``JQUANT_TEST_GPU=1``."""

from __future__ import annotations

import contextlib
import types
from unittest import mock

import jax

# Hopper (sm_90), the capability the kernels are dispatched to.
COMPUTE_CAPABILITY = 90


@contextlib.contextmanager
def _abstract_hopper():
    from jax._src.pallas.triton import pallas_call_registration as reg
    fake = types.SimpleNamespace(compute_capability=COMPUTE_CAPABILITY)
    with mock.patch.object(reg.gpu_info_lib, "get_gpu_info", lambda: fake):
        yield


def lower_for_cuda(fn, *args) -> str:
    """The StableHLO text of ``jax.jit(fn)(*args)`` lowered for CUDA (kernels as Triton custom calls)."""
    with _abstract_hopper():
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
