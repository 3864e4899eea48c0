"""Dynamic e4m3 activation quantization for the W8A8 FP8 GEMMs, one scale per token or per 1 × G group:
the Triton-backend kernel on a CUDA GPU of capability 8.9 or more, the formats' XLA functions
elsewhere. Both return the same QTensor, bit for bit."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jquant.formats import fp8
from jquant.kernels.act_quant import triton
from jquant.kernels.act_quant.triton import ActQuantConfig
from jquant.qtensor import QTensor
from jquant.schemes import dispatch

IMPLS = ("auto", "pallas", "xla")
INPUT_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


def choose_impl(rows: int) -> str:
    """"pallas" where the kernel runs (a CUDA GPU of capability 8.9 or more) and ``dispatch.act_quant_impl``
    picks it for ``rows`` rows, else "xla".

    Examples:
      >>> import jax
      >>> from jquant.kernels.act_quant import choose_impl
      >>> jax.default_backend() != "cpu" or choose_impl(4096) == "xla"
      True
    """
    if not dispatch.runs_triton_pallas():
        return "xla"
    return dispatch.act_quant_impl(rows, dispatch.compute_capability())


def _kernel_covers(x: jax.Array, group: int) -> bool:
    """bf16 / fp16 / float32 rows, at least one, K a multiple of ``group``, fewer than 2**31 values
    (Pallas' Triton lowering indexes arrays of up to 4 GiB with int32 element offsets)."""
    return x.ndim >= 1 and 1 <= x.size < 2**31 and x.dtype in INPUT_DTYPES and x.shape[-1] % group == 0


def quantize_fp8_activations(x, group_size: int | None = None, *, ue8m0: bool = False,
                             scale_dtype=jnp.float32, impl: str = "auto", config: ActQuantConfig | None = None,
                             interpret: bool = False) -> QTensor:
    """e4m3 codes of ``x [..., K]`` (bf16, fp16 or float32) with one scale per row (``group_size`` None:
    ``fp8.quantize_fp8_per_token``) or per ``group_size`` values (``fp8.quantize_fp8_per_token_group``,
    ``ue8m0`` and ``scale_dtype`` as there): the same QTensor as those functions, bit for bit.

    ``impl``: "pallas" (the kernel), "xla" (the formats' function) or "auto" (``choose_impl`` of the
    number of rows).
    Inputs the kernel does not take (empty, a float dtype other than bf16 / fp16 / float32, 2**31 values
    or more) run the formats' function whatever ``impl``; its checks (a group that does not divide K) run
    first on every path.
    ``config``: the kernel's launch (None: ``triton.default_config``).

    Examples:
      >>> import jax.numpy as jnp, numpy as np
      >>> from jquant.formats import fp8
      >>> from jquant.kernels.act_quant import quantize_fp8_activations
      >>> x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 256)), jnp.bfloat16)
      >>> qt = quantize_fp8_activations(x, impl="pallas", interpret=True)   # the kernel, interpreted
      >>> ref = fp8.quantize_fp8_per_token(x)
      >>> bool(jnp.array_equal(qt.data.view(jnp.uint8), ref.data.view(jnp.uint8))), qt.scale.shape
      (True, (3, 1))
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if group_size is None:
        reference = functools.partial(fp8.quantize_fp8_per_token, fmt="fp8_e4m3")
    else:
        reference = functools.partial(fp8.quantize_fp8_per_token_group, group_size=group_size, ue8m0=ue8m0,
                                      fmt="fp8_e4m3", scale_dtype=scale_dtype)
    expected = jax.eval_shape(reference, x)    # the formats' checks, and the QTensor to fill
    x = jnp.asarray(x)
    group = x.shape[-1] if group_size is None else group_size
    if impl == "auto":
        impl = choose_impl(x.size // max(x.shape[-1], 1) if x.ndim else 1)
    if impl == "xla" or not _kernel_covers(x, group):
        return reference(x)
    rows = x.reshape(-1, x.shape[-1])
    codes, scale = triton.quantize(rows, group, per_group=group_size is not None, ue8m0=ue8m0,
                                   config=config or triton.default_config(rows.shape[0], group),
                                   interpret=interpret)
    return dataclasses.replace(expected, data=codes.reshape(x.shape),
                               scale=scale.reshape(expected.scale.shape).astype(expected.scale.dtype))


def quantize_scheme_activation(scheme, x: jax.Array, input_scale: jax.Array | None = None, *,
                               interpret: bool = False) -> QTensor:
    """``schemes.xla.quantize_activation`` (x quantized as the W8A8 ``scheme`` says), through
    ``quantize_fp8_activations`` for dynamic e4m3 per-token and per-token-group activations (the kernel
    where ``choose_impl`` says, or interpreted with ``interpret``).

    Examples:
      >>> import jax.numpy as jnp, jquant
      >>> from jquant.kernels.act_quant import quantize_scheme_activation
      >>> x = jnp.linspace(-4, 4, 2 * 256, dtype=jnp.bfloat16).reshape(2, 256)
      >>> qt = quantize_scheme_activation(jquant.get_scheme("fp8_e4m3_block128x128"), x, interpret=True)
      >>> qt.data.dtype, qt.scale.shape   # one scale per 1 x 128 group
      (dtype(float8_e4m3fn), (2, 2))
    """
    from jquant.schemes.xla import quantize_activation

    spec = scheme.activation
    if spec.format != "fp8_e4m3" or spec.mode not in ("dynamic_per_token", "dynamic_per_token_group"):
        return quantize_activation(scheme, x, input_scale)
    impl = "pallas" if interpret else "auto"
    group_size = spec.group_size if spec.mode == "dynamic_per_token_group" else None
    return quantize_fp8_activations(x, group_size, ue8m0=bool(spec.ue8m0), impl=impl, interpret=interpret)
