"""Lower a jitted function that calls Triton-backend Pallas kernels for CUDA, on a machine without a
GPU: the Triton lowering runs in Python (jax._src.pallas.triton.lowering), so unsupported ops, bad
block shapes and dtype casts fail here as they would on the device. Only PTX compilation and the run
itself are left to ``JQUANT_TEST_GPU=1``."""

from __future__ import annotations

import contextlib
import re
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


def triton_modules(fn, *args) -> list[str]:
    """The Triton IR (TTIR text) of every Triton-backend kernel ``jax.jit(fn)(*args)`` lowers to for CUDA."""
    from jax._src.pallas.triton import lowering

    texts, real = [], lowering.lower_jaxpr_to_triton_module

    def capture(*a, **kw):
        result = real(*a, **kw)
        texts.append(result.module.operation.get_asm(enable_debug_info=False))
        return result

    with _abstract_hopper(), mock.patch.object(lowering, "lower_jaxpr_to_triton_module", capture):
        jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    return texts


_DEF = re.compile(r"^\s*(%[\w]+)(?::\d+)? = ([\w.\"]+)(.*)$")
_BITS = {"i1": 1, "i8": 8, "f8E4M3FN": 8, "f8E5M2": 8, "i16": 16, "f16": 16, "bf16": 16, "i32": 32, "f32": 32,
         "i64": 64}
# Ops Triton's bit-width walk looks through: elementwise, shape and load ops.
_WALKED = ("tt.bitcast", "tt.join", "tt.reshape", "tt.trans", "tt.expand_dims", "tt.broadcast", "tt.load",
           "tt.addptr", "tt.extern_elementwise", "tt.splat", "tt.fp_to_fp")


def join_kwidth_hazards(ttir: str) -> list[str]:
    """The ``tt.dot`` ops of ``ttir`` that Triton's MMA layout pass (AccelerateMatmul's
    ``computeOrigBitWidth``) gives a kWidth too wide for their K: it takes an operand's bit width from
    the narrowest load behind it and halves it when a ``tt.join`` is behind it too; kWidth = 32 / bits
    then needs K ≥ 4 · kWidth, and a join on an axis other than K with a shorter K reads wrong operand
    values (triton-lang/triton#10645). Replayed here because interpret mode never runs that pass."""
    defs = {}
    for line in ttir.splitlines():
        m = _DEF.match(line)
        if m:
            defs[m.group(1)] = (m.group(2), m.group(3))
    hazards = []
    for name, (op, rest) in defs.items():
        if op != "tt.dot":
            continue
        a, b = re.findall(r"%[\w]+", rest)[:2]
        rows, k, dtype = re.findall(r"tensor<(\d+)x(\d+)x(\w+)>", rest)[0]
        k = int(k)

        def bits_behind(value):
            seen, stack, joins, bits = set(), [value], 0, _BITS[dtype]
            while stack:
                v = stack.pop()
                if v in seen or v not in defs:
                    continue
                seen.add(v)
                o, r = defs[v]
                if not (o.startswith(("arith.", "math.")) or o in _WALKED):
                    continue
                joins += o == "tt.join"
                if o == "tt.load":
                    loaded = re.search(r"tensor<[\dx]*x!tt\.ptr<(\w+)>>", r)
                    if loaded and loaded.group(1) in _BITS:
                        bits = min(bits, _BITS[loaded.group(1)])
                stack += re.findall(r"%[\w]+", r.split(":")[0])
            return bits // 2 if joins else bits

        kwidth = 32 // min(bits_behind(a), bits_behind(b))
        if 4 * kwidth > k:
            hazards.append(f"{name} = tt.dot with K = {k}: kWidth {kwidth} needs K >= {4 * kwidth}")
    return hazards
