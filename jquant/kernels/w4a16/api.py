"""``w4a16_matmul``: ``x @ W`` for a 4-bit weight laid out by ``prepack_nk``, dispatched by M and
device.

Implementations (``impl``):
* ``"mgpu"``: the Mosaic GPU kernel (Hopper), every M up to ``MGPU_MAX_M``.
* ``"pallas"``: the kernel, nothing else (an error where no Hopper GPU can run it).
* ``"xla"``: dequantize to ``x``'s dtype, then ``jnp.dot`` with fp32 accumulation (XLA/cuBLAS).
* ``"reference"``: dequantize in fp32, fp32 dot (the exact twin; slow on GPUs).
* ``"auto"``: on Hopper, ``mgpu`` up to ``MGPU_MAX_M`` rows (``MGPU_MAX_M_SMALL_WEIGHT`` for
  weights under 8192×8192), else xla; xla on other GPUs; reference on CPU
  (``jquant.schemes.dispatch.w4a16_impl``, with the rest of the device policy). With
  ``interpret=True`` the kernel runs on any device.

Forcing ``"mgpu"`` where no Hopper GPU can run it warns once and runs the XLA path (the reference
on CPU). The kernel's modules (Mosaic GPU's Pallas backend) are imported on the first call that
runs it, not with this module.
"""

from __future__ import annotations

import warnings

import jax.numpy as jnp

from jquant.schemes import dispatch as device_lib
from jquant.schemes.dispatch import (MGPU_LARGE_WEIGHT, MGPU_MAX_M, MGPU_MAX_M_SMALL_WEIGHT,  # noqa: F401
                                     compute_capability, has_wgmma)
from jquant.kernels.w4a16.layout import PackedW4NK, reference_nk
from jquant.kernels.w4a16.config import MgpuConfig
from jquant.qtensor import QTensor

IMPLS = ("auto", "pallas", "mgpu", "xla", "reference")

_warned: set[str] = set()


def warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def resolve_impl(impl: str, m: int, interpret: bool = False,
                 weight_elems: int = MGPU_LARGE_WEIGHT) -> str:
    """The implementation ``w4a16_matmul`` runs for ``impl`` at ``m`` rows on the default device,
    for a weight of ``weight_elems`` = N·K weights.

    Examples:
      >>> import jax
      >>> from jquant.kernels.w4a16 import resolve_impl
      >>> resolve_impl("xla", 8), resolve_impl("reference", 8)  # asked for by name: run as asked
      ('xla', 'reference')
      >>> resolve_impl("auto", 8, interpret=True)  # the kernel in interpret mode, on any device
      'mgpu'
      >>> jax.default_backend() != "cpu" or resolve_impl("auto", 8) == "reference"  # CPU: the fp32 reference
      True
    """
    return resolve_kernel_impl(impl, interpret, lambda cc: device_lib.w4a16_impl(m, cc, weight_elems), "w4a16")


def resolve_kernel_impl(impl: str, interpret: bool, auto, kernel: str) -> str:
    """What a Mosaic GPU kernel's op runs for ``impl``: ``"xla"`` / ``"reference"`` as asked,
    ``"mgpu"`` in interpret mode, ``auto(capability)`` (the dispatch policy) for ``"auto"``, the
    kernel where a Hopper GPU runs it, else an error (``"pallas"``) or XLA with a warning once
    (``"mgpu"``). ``kernel`` names the op in the warning.

    Examples:
      >>> from jquant.kernels.w4a16.api import resolve_kernel_impl
      >>> resolve_kernel_impl("xla", False, lambda cc: "mgpu", "w8a16"), resolve_kernel_impl("auto", True, None, "w8a16")
      ('xla', 'mgpu')
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl in ("xla", "reference"):
        return impl
    if interpret:
        return "mgpu"
    cc = compute_capability()  # 0 off NVIDIA GPUs
    if impl == "auto":
        return auto(cc)
    if not has_wgmma(cc):
        where = device_lib.platform() if cc == 0 else f"compute capability {cc}"
        if impl == "pallas":
            raise ValueError(f"impl='pallas' needs a Hopper GPU (sm_90), not {where}; pass "
                             "interpret=True to run the kernel in interpret mode")
        warn_once(f"{kernel}:{cc}", f"impl='mgpu' ({kernel}) cannot run on {where}; using the XLA path instead")
        return device_lib.w4a16_fallback(cc)
    return "mgpu"


def check_matmul_args(x, k: int, n: int, bias, config, config_type):
    """``x`` as an array ``[..., K]`` of bf16 / fp16 / fp32 and ``bias`` ``[N]`` (or None), or the
    error naming what is wrong; ``config`` must be a ``config_type`` or None.

    Examples:
      >>> import jax.numpy as jnp
      >>> from jquant.kernels.w4a16.api import check_matmul_args
      >>> check_matmul_args(jnp.ones((2, 8)), 8, 4, None, None, object)[0].shape
      (2, 8)
    """
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating) or x.dtype.itemsize not in (2, 4):
        raise TypeError(f"x must be bf16, fp16 or fp32, got {x.dtype} (shape {tuple(x.shape)})")
    if x.ndim < 1 or x.shape[-1] != k or x.size == 0:
        raise ValueError(f"x has shape {tuple(x.shape)}; expected [..., K={k}], non-empty")
    if bias is not None:
        bias = jnp.asarray(bias)
        if bias.shape != (n,):
            raise ValueError(f"bias has shape {tuple(bias.shape)}; expected ({n},)")
    if config is not None and not isinstance(config, config_type):
        names = " or ".join(t.__name__ for t in (config_type if isinstance(config_type, tuple) else (config_type,)))
        raise TypeError(f"config must be an {names}, got {type(config).__name__}")
    return x, bias


def w4a16_matmul(x, packed: PackedW4NK | QTensor, *, bias=None, impl: str = "auto",
                 config: MgpuConfig | None = None, interpret: bool = False):
    """``x`` ``[..., K]`` (bf16 / fp16 / fp32) contracted with a 4-bit weight's K axis; fp32
    accumulation, result ``[..., N]`` in ``x``'s dtype. ``bias`` is an optional ``[N]`` vector.

    The weight is a ``PackedW4NK``, whose K axis is that of the ``[K, N]`` codes it was packed
    from (``x @ W`` for those codes; a scheme's prepared weight holds its ``[N, K]`` QTensor's
    codes transposed, so this is ``Scheme.apply``'s ``x @ W.T``), or a 4-bit ``[N, K]`` QTensor
    recording ``k_axis=1`` (``x @ W.T``), laid out for the kernel on every call
    (``Scheme.process_weights_after_loading`` lays it out once); any other ``k_axis`` is refused.

    ``config`` overrides the kernel's launch (an ``MgpuConfig``); ``interpret`` runs the kernel in
    Pallas interpret mode (any device; every never-written output element is NaN there).

    Examples:
      A 4-bit ``[N, K]`` QTensor in groups of 32: the product is ``x @ W.T`` with ``W`` dequantized.

      >>> import jax.numpy as jnp, numpy as np, jquant
      >>> from jquant.kernels.w4a16 import w4a16_matmul
      >>> rng = np.random.default_rng(0)
      >>> w = jquant.quantize(rng.standard_normal((8, 64)).astype(np.float32), "int4", group_size=32)
      >>> x = jnp.asarray(rng.standard_normal((2, 3, 64)), jnp.float32)  # [..., K]
      >>> y = w4a16_matmul(x, w, impl="xla")
      >>> y.shape, str(y.dtype), bool(jnp.allclose(y, x @ w.dequantize().T, atol=1e-4))
      ((2, 3, 8), 'float32', True)
      >>> y = w4a16_matmul(x.astype(jnp.bfloat16), w, bias=jnp.ones(8), impl="xla")  # in x's dtype
      >>> str(y.dtype), bool(jnp.allclose(y, x @ w.dequantize().T + 1, atol=0.1))
      ('bfloat16', True)
    """
    if isinstance(packed, QTensor):
        packed = _pack_qtensor(packed)
    if not isinstance(packed, PackedW4NK):
        raise TypeError("packed must be a PackedW4NK (prepack_nk) or a 4-bit QTensor, got "
                        f"{type(packed).__name__}")
    x, bias = check_matmul_args(x, packed.k, packed.n, bias, config, MgpuConfig)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, packed.k)
    return _matmul(x2, packed, bias, impl, config, interpret).reshape(*lead, packed.n)


def _pack_qtensor(qt: QTensor) -> PackedW4NK:
    # Imported here: scheme_impl imports this module.
    from jquant.kernels.w4a16.from_qtensor import prepack_for_kernels, unified_w4

    if qt.ndim != 2 or qt.k_axis != 1:
        raise ValueError(f"w4a16_matmul takes a QTensor weight [N, K] with k_axis=1 (x @ W.T); this "
                         f"{qt.fmt} QTensor of shape {qt.shape} records k_axis={qt.k_axis}: quantize the "
                         "[N, K] weight along axis 1 (Scheme.quantize_weight), or use jquant.qdot")
    args = unified_w4(qt)
    packed = None if args is None else prepack_for_kernels(args)
    if packed is None:
        raise ValueError(f"w4a16_matmul: a {qt.fmt} QTensor with shape {qt.shape} and block {qt.block} has "
                         "no 4-bit kernel layout (4-bit codes in groups of 16, 32 or 64·j along K, or per "
                         "channel); use Scheme.apply or jquant.qdot")
    return packed


def _matmul(x2, packed: PackedW4NK, bias, impl, config, interpret):
    kind = resolve_impl(impl, x2.shape[0], interpret, weight_elems=packed.n * packed.k)
    if kind == "mgpu" and x2.dtype == jnp.float32:
        if impl == "auto":   # the kernel's wgmma takes 16-bit x; fp32 x keeps full precision in XLA
            kind = device_lib.w4a16_fallback(compute_capability())
        else:
            raise TypeError(f"impl={impl!r} runs the Mosaic GPU kernel, which takes bf16 or fp16 x; "
                            f"got float32 x of shape {tuple(x2.shape)} (cast it, or use impl='auto')")
    if kind == "reference":
        return reference_nk(x2, packed, bias)
    if kind == "xla":
        # XLA:CPU cannot always run a bf16 × bf16 → f32 dot; there the operands go to f32 first.
        dtype = jnp.float32 if device_lib.is_cpu() else x2.dtype
        return reference_nk(x2, packed, bias, dtype)
    # Imported here: Mosaic GPU's Pallas backend took ~0.3 s of `import jquant`'s ~1.3 s on a
    # 2-core CPU host (python -X importtime), and only a kernel call needs it.
    from jquant.kernels.w4a16.mosaic_gpu import w4a16_mgpu_matmul

    return w4a16_mgpu_matmul(x2, packed, bias, config=config, interpret=interpret)
