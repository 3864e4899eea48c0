"""Quantization schemes: what to quantize a weight to, how to lay it out for a kernel, how to apply it.

The lifecycle follows vLLM's, without its class hierarchy:

1. ``scheme.quantize_weight(w)`` (online quantization) or ``from_checkpoint`` (a quantized checkpoint)
   gives a QTensor in PyTorch orientation ``[N, K]``, quantized along K;
2. ``scheme.process_weights_after_loading(qw)`` re-lays it once for the best implementation this device
   has (a Pallas kernel's tile layout, or the QTensor itself for the XLA reference);
3. ``scheme.apply(x, prepared, bias)`` computes ``x @ W.T + bias``; the implementation picks its own path
   by the batch size M.

Implementations register with ``register_impl``; the best one a device supports lays the weight out,
unless its ``prepare`` declines that weight (returns None), and the XLA reference (dequantize + dot,
or XLA's native FP8 dot) serves every scheme on every device.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any, Callable

import jax
import jax.numpy as jnp

from jquant.schemes import dispatch as device_lib
from jquant.formats import quantize
from jquant.qtensor import QTensor
from jquant.schemes.spec import (ACTIVATION_MODES, ActivationSpec, LayoutSpec, WeightSpec,  # noqa: F401
                                 weight_spec_from_options)


@dataclasses.dataclass(frozen=True)
class Scheme:
    """A quantization scheme (hashable, static under jit).

    Attributes:
      name: registry name.
      weight: how the weight is quantized (format, bits, group size, ...).
      activation: how activations are quantized before the GEMM (mode ``"none"``: weight-only).
      min_capability: minimum CUDA capability for the fast path (0: anywhere); below it the XLA
        reference runs.
      checkpoint_layout: the ``to_checkpoint`` layout vLLM checkpoints of this scheme use.
      layout: options for that layout (``checkpoint_format="gptq_v2"``, ...).

    Examples:
      >>> import jax, jax.numpy as jnp, numpy as np, jquant
      >>> scheme = jquant.get_scheme("int4_g32")
      >>> scheme.weight.format, scheme.weight.group_size, scheme.weight_only, scheme.checkpoint_layout
      ('int4', 32, True, 'gptq')

      Quantize a weight ``[N, K]``, lay it out once for a device, then apply it:

      >>> w = np.random.default_rng(0).standard_normal((16, 64)).astype(np.float32)
      >>> qw = scheme.quantize_weight(w)
      >>> qw.shape, qw.k_axis
      ((16, 64), 1)
      >>> prepared = scheme.process_weights_after_loading(qw, jax.devices("cpu")[0])
      >>> x = np.random.default_rng(1).standard_normal((2, 64)).astype(np.float32)
      >>> y = scheme.apply(x, prepared)  # x @ W.T with the quantized W
      >>> y.shape
      (2, 16)
      >>> bool(jnp.allclose(y, x @ qw.dequantize().T, atol=1e-4))
      True

      A scheme is hashable (a static argument under ``jit``) and saves as a dict:

      >>> jquant.Scheme.from_dict(scheme.to_dict()) == scheme
      True
    """

    name: str
    weight: WeightSpec
    activation: ActivationSpec = ActivationSpec()
    min_capability: int = 0
    checkpoint_layout: str | None = None
    layout: LayoutSpec = LayoutSpec()
    description: str = ""

    def __post_init__(self):
        for field, cls in (("weight", WeightSpec), ("activation", ActivationSpec), ("layout", LayoutSpec)):
            if not isinstance(getattr(self, field), cls):
                raise TypeError(f"scheme {self.name!r}: {field} must be {cls.__name__}(...), got "
                                f"{getattr(self, field)!r}")
        if self.activation.mode == "llm_int8" and self.weight.format != "int8_bnb":
            raise ValueError(f"scheme {self.name!r}: activation mode 'llm_int8' runs bitsandbytes' 'int8_bnb' "
                             f"weights, got {self.weight.format!r}")

    @property
    def weight_format(self) -> str:
        return self.weight.format

    @property
    def weight_only(self) -> bool:
        return self.activation.mode == "none"

    def layout_kwargs(self) -> dict[str, Any]:
        """The layout options as ``to_checkpoint`` / ``from_checkpoint`` keywords."""
        return self.layout.kwargs()

    def to_dict(self) -> dict[str, Any]:
        """The scheme as JSON-able nested dicts (``from_dict`` reads it back)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Scheme":
        """Reads ``to_dict``'s output, or the flat form of older saves (``weight_format`` with
        ``weight_options``, ``activation`` a mode string with ``activation_options``, ``layout_options``)."""
        d = dict(d)
        if "weight_format" in d:
            weight = weight_spec_from_options(d.pop("weight_format"), dict(d.pop("weight_options", ())))
            activation = ActivationSpec(d.pop("activation", "none"), **dict(d.pop("activation_options", ())))
            return cls(weight=weight, activation=activation, layout=LayoutSpec(**dict(d.pop("layout_options", ()))),
                       **d)
        return cls(weight=WeightSpec(**d.pop("weight")), activation=ActivationSpec(**d.pop("activation")),
                   layout=LayoutSpec(**d.pop("layout")), **d)

    def quantize_weight(self, w: jax.Array) -> QTensor:
        """Quantizes a float weight ``[N, K]`` (out_features, in_features) along K."""
        if getattr(w, "ndim", None) != 2:
            raise ValueError(f"scheme {self.name!r}: weight must be 2-D [N, K], got shape "
                             f"{tuple(getattr(w, 'shape', ()))}")
        group = self.activation.group_size
        if self.activation.mode == "dynamic_per_token_group" and w.shape[1] % group:
            raise ValueError(f"scheme {self.name!r} quantizes activations in groups of {group} along K, but the "
                             f"weight {tuple(w.shape)} has K={w.shape[1]}, not a multiple of {group}")
        qw = quantize(w, self.weight.format, axis=1, **self.weight.quantize_kwargs())
        return qw if qw.k_axis is not None else qw.replace(k_axis=1)  # (per-tensor, 2-D tiles)

    def quantize_kernel(self, kernel: jax.Array) -> QTensor:
        """Quantizes a Flax kernel ``[K, N]`` (stored transposed, as ``quantize_weight`` does)."""
        if getattr(kernel, "ndim", None) != 2:
            raise ValueError(f"scheme {self.name!r}: kernel must be 2-D [K, N], got shape "
                             f"{tuple(getattr(kernel, 'shape', ()))}")
        return self.quantize_weight(jnp.asarray(kernel).T)

    def process_weights_after_loading(self, qweight: QTensor, device: jax.Device | None = None) -> "Prepared":
        """Re-lays ``qweight`` once for the best implementation available on ``device``."""
        _check_weight(self, qweight)
        for impl in candidate_impls(self, device):
            data = impl.prepare(self, qweight)
            if data is not None:  # None: this implementation cannot take this particular weight
                return Prepared(data=data, impl=impl.name, shape=qweight.shape)
        raise AssertionError("the XLA implementation takes every weight")

    def apply(self, x: jax.Array, weight: "Prepared | QTensor", bias: jax.Array | None = None, *,
              input_scale: jax.Array | None = None) -> jax.Array:
        """``x @ W.T + bias`` for ``x [..., K]`` (bf16, fp16 or fp32) and a prepared (or plain QTensor)
        weight ``[N, K]``.

        ``input_scale`` is the calibrated activation scale of a static scheme (a checkpoint's per-weight
        ``input_scale``; QParam passes its own); without it a static scheme uses ``activation.input_scale``.
        """
        dtype = getattr(x, "dtype", None)
        if dtype is None or not jnp.issubdtype(dtype, jnp.floating) or jnp.dtype(dtype).itemsize < 2:
            # Integer codes would enter the dot as they are (and come back as zeros or garbage).
            raise TypeError(f"scheme {self.name!r}: activations x must be bfloat16, float16 or float32, got "
                            f"{dtype}; cast them first (x.astype(jnp.bfloat16))")
        if isinstance(weight, QTensor):
            _check_weight(self, weight)
            weight = Prepared(data=weight, impl="xla", shape=weight.shape)
        if not isinstance(weight, Prepared):
            raise TypeError(f"weight must be a Prepared or QTensor, got {type(weight).__name__}")
        if x.shape[-1] != weight.shape[1]:
            raise ValueError(f"scheme {self.name!r}: x has shape {tuple(x.shape)} but the weight expects "
                             f"K={weight.shape[1]} (weight shape {weight.shape})")
        if bias is not None and bias.shape != (weight.shape[0],):
            raise ValueError(f"bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")
        if self.activation.mode != "static":
            return _run(self, x, weight, bias)
        if input_scale is None:
            if self.activation.input_scale is None:
                raise ValueError(f"scheme {self.name!r} quantizes activations with a static scale: pass "
                                 "input_scale= (a checkpoint's per-weight input_scale), or use a QParam that "
                                 "carries one (load_hf_checkpoint does)")
            input_scale = self.activation.input_scale
        input_scale = jnp.asarray(input_scale)
        if input_scale.size != 1 or not jnp.issubdtype(input_scale.dtype, jnp.floating):
            raise ValueError(f"scheme {self.name!r}: input_scale must be one float (per tensor), got "
                             f"{input_scale.dtype} with shape {tuple(input_scale.shape)}")
        return _run(self, x, weight, bias, input_scale=input_scale.reshape(()))


@dataclasses.dataclass(frozen=True)
class Prepared:
    """A weight laid out for one implementation (a pytree; ``impl`` and ``shape`` are static).

    Examples:
      >>> import jax, numpy as np, jquant
      >>> scheme = jquant.get_scheme("int8_ch")
      >>> w = np.random.default_rng(0).standard_normal((16, 64)).astype(np.float32)
      >>> prepared = scheme.process_weights_after_loading(scheme.quantize_weight(w), jax.devices("cpu")[0])
      >>> prepared.impl, prepared.shape, type(prepared.data).__name__  # the XLA reference keeps the QTensor
      ('xla', (16, 64), 'QTensor')
      >>> x = np.ones((3, 64), np.float32)
      >>> jax.jit(lambda x, weight: scheme.apply(x, weight))(x, prepared).shape
      (3, 16)
    """

    data: Any
    impl: str = "xla"
    shape: tuple[int, ...] = ()


jax.tree_util.register_dataclass(Prepared, data_fields=["data"], meta_fields=["impl", "shape"])


@dataclasses.dataclass(frozen=True)
class Impl:
    """An implementation of ``apply`` for the schemes it ``supports`` on a device capability.

    ``run(scheme, x, data, bias)``; for schemes with static activations ``apply`` also passes
    ``input_scale=`` (a 0-d fp32 array), so an implementation that supports them takes that keyword.
    """

    name: str
    supports: Callable[[Scheme, int, str], bool]
    prepare: Callable[[Scheme, QTensor], Any]
    run: Callable[[Scheme, jax.Array, Any, jax.Array | None], jax.Array]
    priority: int = 0


_IMPLS: dict[str, Impl] = {}
_SCHEMES: dict[str, Scheme] = {}
_WARNED: set[str] = set()


def _run(scheme: Scheme, x: jax.Array, weight: Prepared, bias: jax.Array | None, **kwargs) -> jax.Array:
    if math.prod(x.shape[:-1]) == 0:
        # No tokens (an empty batch, an expert no token chose): the activation quantizers have no amax
        # to take and the kernels no row to tile, so the empty product is made here.
        return jnp.zeros((*x.shape[:-1], weight.shape[0]), x.dtype)
    return _IMPLS[weight.impl].run(scheme, x, weight.data, bias, **kwargs)


def register_impl(impl: Impl) -> None:
    _IMPLS[impl.name] = impl


def candidate_impls(scheme: Scheme, device: jax.Device | None = None) -> list[Impl]:
    """Implementations that can run ``scheme`` on ``device``, best first (the XLA reference last)."""
    cap = device_lib.compute_capability(device)
    plat = device_lib.platform(device)
    usable = sorted((i for i in _IMPLS.values() if i.supports(scheme, cap, plat)), key=lambda i: -i.priority)
    if usable[0].name == "xla" and plat == "gpu" and cap < scheme.min_capability and scheme.name not in _WARNED:
        _WARNED.add(scheme.name)
        warnings.warn(f"scheme {scheme.name!r} needs compute capability {scheme.min_capability} for its fast "
                      f"path; this device has {cap}: using the XLA reference", stacklevel=3)
    return usable


def register_scheme(scheme: Scheme, *, overwrite: bool = False) -> Scheme:
    """Makes ``scheme`` available by name (``get_scheme``, rules of ``quantize_params``); returns it.

    Examples:
      >>> from jquant import Scheme, WeightSpec, get_scheme, register_scheme
      >>> scheme = register_scheme(Scheme("int3_g32", WeightSpec.integer(3, 32)))
      >>> get_scheme("int3_g32").weight.format
      'int3'
      >>> register_scheme(scheme)
      Traceback (most recent call last):
          ...
      ValueError: scheme 'int3_g32' is already registered (pass overwrite=True to replace it)
      >>> register_scheme(scheme, overwrite=True) is scheme
      True
    """
    if not isinstance(scheme, Scheme):
        raise TypeError(f"register_scheme expects a Scheme, got {type(scheme).__name__}")
    if scheme.name in _SCHEMES and not overwrite:
        raise ValueError(f"scheme {scheme.name!r} is already registered (pass overwrite=True to replace it)")
    _SCHEMES[scheme.name] = scheme
    return scheme


def get_scheme(name: str | Scheme) -> Scheme:
    """The registered scheme called ``name`` (a Scheme is returned as it is).

    Examples:
      >>> import jquant
      >>> scheme = jquant.get_scheme("nvfp4")
      >>> scheme.weight.format, scheme.checkpoint_layout
      ('nvfp4', 'compressed-tensors')
      >>> jquant.get_scheme(scheme) is scheme
      True
      >>> jquant.get_scheme("int4_g7")
      Traceback (most recent call last):
          ...
      ValueError: unknown scheme 'int4_g7'; registered schemes: (...)
    """
    if isinstance(name, Scheme):
        return name
    if not isinstance(name, str):
        raise TypeError(f"scheme name must be a str, got {type(name).__name__}")
    if name not in _SCHEMES:
        raise ValueError(f"unknown scheme {name!r}; registered schemes: {schemes()}")
    return _SCHEMES[name]


def schemes() -> tuple[str, ...]:
    """Names of the registered schemes, sorted.

    Examples:
      >>> import jquant
      >>> {"int4_g128", "int4_g128_asym", "int8_ch", "fp8_e4m3_tensor", "nvfp4", "nf4"} <= set(jquant.schemes())
      True
    """
    return tuple(sorted(_SCHEMES))


def _check_weight(scheme: Scheme, qweight: QTensor) -> None:
    if not isinstance(qweight, QTensor):
        raise TypeError(f"scheme {scheme.name!r}: weight must be a QTensor, got {type(qweight).__name__}")
    if qweight.fmt != scheme.weight.format or qweight.ndim != 2:
        raise ValueError(f"scheme {scheme.name!r} expects a 2-D {scheme.weight.format!r} weight, got "
                         f"fmt={qweight.fmt!r} with shape {qweight.shape}")
    if qweight.k_axis not in (None, 1):
        raise ValueError(f"scheme {scheme.name!r} takes weights [N, K] with K on axis 1; this {qweight.shape} "
                         f"QTensor records K on axis {qweight.k_axis} (a [K, N] kernel): quantize W.T, or "
                         "use scheme.quantize_kernel for a Flax kernel")
