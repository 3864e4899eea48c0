"""GPTQ for one linear layer: calibration activations in, a QTensor of an integer scheme out.

The QTensor has the format, blocks and scale dtype the scheme's RTN ``quantize_weight``
gives (so it exports to the ``gptq`` layout, loads back and ``apply``s through the scheme); only
its values differ, and it dequantizes to exactly the weight the GPTQ loop produced. The math lives
in ``gptq_core``; walking a model layer by layer is the caller's business.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

import jax
import jax.numpy as jnp
import numpy as np

from jquant.algorithms.gptq_core import GPTQResult, gptq_quantize, gptq_quantize_e2m1, hessian_update
from jquant.formats import mx, nvfp4
from jquant.formats.exact import exact_divide
from jquant.formats.integer import quantize_int_with_params
from jquant.formats.packing import pack_bits
from jquant.qtensor import QTensor
from jquant.schemes.scheme import Scheme, get_scheme
from jquant.schemes.spec import WeightSpec


_DAMP_RETRIES = 3
FP4_FORMATS = ("mxfp4", "nvfp4")  # E2M1 codes with a multiplier per block along K


@dataclasses.dataclass(frozen=True)
class Hessian:
    """A running GPTQ Hessian ``2/n · Σ xᵀx`` over ``n`` rows (a pytree: it can cross ``jit``).

    Examples:
      >>> import jax.numpy as jnp, numpy as np
      >>> from jquant.algorithms import Hessian
      >>> x = np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32)
      >>> hessian = Hessian.zeros(4).update(x)
      >>> int(hessian.n), hessian.h.shape
      (8, (4, 4))
      >>> bool(jnp.allclose(hessian.h, 2 / 8 * x.T @ x, atol=1e-5))
      True
    """

    h: jax.Array
    n: jax.Array

    @classmethod
    def zeros(cls, k: int) -> "Hessian":
        return cls(h=jnp.zeros((k, k), jnp.float32), n=jnp.int32(0))

    def update(self, x: jax.Array) -> "Hessian":
        """This Hessian with the rows of ``x [..., K]`` added."""
        if np.shape(x)[-1:] != self.h.shape[:1]:
            raise ValueError(f"activations must be [..., {self.h.shape[0]}], got shape {tuple(np.shape(x))}")
        return Hessian(*hessian_update(self.h, self.n, x))


jax.tree_util.register_dataclass(Hessian, data_fields=["h", "n"], meta_fields=[])


def accumulate_hessian(inputs: Iterable[jax.Array] | jax.Array, k: int) -> Hessian:
    """The Hessian of calibration batches ``[..., K]`` (one array is one batch).

    Examples:
      Batches add up to the Hessian of all their rows:

      >>> import jax.numpy as jnp, numpy as np
      >>> from jquant.algorithms import accumulate_hessian
      >>> x = np.random.default_rng(0).standard_normal((2, 4, 16)).astype(np.float32)  # [batch, seq, K]
      >>> hessian = accumulate_hessian([x[:1], x[1:]], 16)
      >>> int(hessian.n), bool(jnp.allclose(hessian.h, accumulate_hessian(x, 16).h, atol=1e-5))
      (8, True)
    """
    if isinstance(inputs, (jax.Array, np.ndarray)):
        inputs = (inputs,)
    hessian = Hessian.zeros(k)
    for x in inputs:
        hessian = hessian.update(x)
    return hessian


def takes_scheme(scheme: Scheme) -> bool:
    """Whether ``gptq_quantize_weight`` quantizes to ``scheme``'s weights (integer, MXFP4 or NVFP4)."""
    return scheme.weight.family == "int" or scheme.weight.format in FP4_FORMATS


def int_weight_spec(scheme: str | Scheme | WeightSpec) -> WeightSpec:
    """The integer ``WeightSpec`` of a scheme name, a Scheme or a spec."""
    spec = scheme if isinstance(scheme, WeightSpec) else get_scheme(scheme).weight
    if spec.family != "int":
        name = scheme.name if isinstance(scheme, Scheme) else scheme if isinstance(scheme, str) else "the spec"
        raise ValueError(f"GPTQ quantizes to integer formats (int*/uint*) and {' / '.join(FP4_FORMATS)} "
                         f"(gptq_quantize_weight); {name} has format {spec.format!r}")
    return spec


def to_qtensor(result: GPTQResult, spec: WeightSpec, dtype=jnp.float32) -> QTensor:
    """The QTensor of a GPTQ result in ``spec``'s format; ``dtype`` is recorded as the weight's."""
    scale_dtype = jnp.dtype(spec.scale_dtype or jnp.float32)
    qt = quantize_int_with_params(result.weight, spec.bits, result.scale, result.zero, result.g_idx, axis=1,
                                  scale_dtype=scale_dtype)
    return qt.replace(dtype=dtype)


def fp4_block_multipliers(qt: QTensor) -> jax.Array:
    """``[N, K / block]`` float32 multiplier of each block of an MXFP4 / NVFP4 weight QTensor (what
    its codes' E2M1 values are multiplied by when it dequantizes)."""
    if qt.fmt == "nvfp4":
        return nvfp4.block_scales(qt)
    return mx.block_multipliers(qt)


def fp4_with_codes(qt: QTensor, weight: jax.Array) -> QTensor:
    """``qt`` (a round-to-nearest MXFP4 / NVFP4 QTensor) with its codes replaced by those of ``weight``,
    whose every value is an E2M1 value times its block's multiplier (GPTQ's output)."""
    scales = qt.expand(fp4_block_multipliers(qt))
    safe = jnp.where(scales == 0, 1.0, scales)
    codes = mx.e2m1_codes(exact_divide(jnp.asarray(weight, jnp.float32), safe), "even", "negative")
    return qt.replace(data=pack_bits(codes, 4, qt.pack_axis))


def gptq_quantize_weight(weight: jax.Array, inputs: Iterable[jax.Array] | jax.Array | Hessian, *,
                         scheme: str | Scheme | WeightSpec = "int4_g128", damp_percent: float = 0.01,
                         block_size: int = 128, act_order: bool = False, static_groups: bool = False) -> QTensor:
    """GPTQ-quantizes a weight ``[N, K]`` (out_features, in_features) for ``scheme``.

    Args:
      weight: ``[N, K]`` float weight.
      inputs: the layer's calibration activations, batches ``[..., K]`` (an iterable, or one
        array), or a ``Hessian`` already accumulated from them.
      scheme: an integer scheme (``"int4_g128"``, ``"int4_g32"``, ``"int4_g128_asym"``, ``"int8_ch"``,
        ...) or a ``WeightSpec`` (``WeightSpec.integer(4, 64, symmetric=False, scale_dtype="float16")``):
        bits, group size, symmetry and scale dtype come from it. Symmetric formats use GPTQ's scale
        ``2·amax / (2**b-1)``.
      damp_percent, block_size, act_order, static_groups: as ``gptq_core.gptq_quantize``.

    Examples:
      Calibration inputs whose channels differ in scale, as a layer's do:

      >>> import jax.numpy as jnp, numpy as np, jquant
      >>> from jquant.algorithms import gptq_quantize_weight
      >>> rng = np.random.default_rng(0)
      >>> w = rng.standard_normal((16, 64)).astype(np.float32)
      >>> x = rng.standard_normal((256, 64)).astype(np.float32) * np.linspace(0.1, 3, 64, dtype=np.float32)
      >>> qt = gptq_quantize_weight(w, x, scheme="int4_g32")
      >>> qt.fmt, qt.shape, qt.block, str(qt.scale.dtype)  # what the scheme's RTN quantize_weight gives
      ('int4', (16, 64), (1, 32), 'float16')

      GPTQ minimises the layer's output error, so there it beats the scheme's own ``quantize_weight``:

      >>> rtn = jquant.get_scheme("int4_g32").quantize_weight(w)
      >>> def output_error(q):
      ...     return float(jnp.mean((x @ (q.dequantize() - w).T) ** 2))
      >>> output_error(qt) < output_error(rtn)
      True
      >>> sorted(jquant.to_checkpoint(qt, "gptq"))
      ['g_idx', 'qweight', 'qzeros', 'scales']
    """
    fp4_scheme = None if isinstance(scheme, WeightSpec) else get_scheme(scheme)
    fp4 = fp4_scheme is not None and fp4_scheme.weight.format in FP4_FORMATS
    spec = fp4_scheme.weight if fp4 else int_weight_spec(scheme)
    weight = jnp.asarray(weight)
    if weight.ndim != 2:
        raise ValueError(f"weight must be 2-D [N, K], got shape {tuple(weight.shape)}")
    hessian = inputs if isinstance(inputs, Hessian) else accumulate_hessian(inputs, weight.shape[1])
    if not np.isfinite(np.asarray(weight)).all() or not np.isfinite(np.asarray(hessian.h)).all():
        raise ValueError("GPTQ needs finite weights and calibration activations (found NaN or Inf)")
    rtn = fp4_scheme.quantize_weight(weight) if fp4 else None
    # A Hessian too ill-conditioned for its Cholesky factor gives NaN: retry with 10x the dampening
    # (as gptqmodel's automatic damping does) rather than return a silently broken weight.
    damps = [damp_percent] + [max(damp_percent, 0.01) * 10**i for i in range(1, _DAMP_RETRIES + 1)]
    for damp in damps:
        if fp4:
            result = gptq_quantize_e2m1(weight, hessian.h, fp4_block_multipliers(rtn), damp_percent=damp,
                                        block_size=block_size, act_order=act_order)
        else:
            result = gptq_quantize(weight, hessian.h, bits=spec.bits, group_size=spec.group_size,
                                   symmetric=spec.symmetric, damp_percent=damp,
                                   block_size=block_size, act_order=act_order, static_groups=static_groups,
                                   scale_dtype=spec.scale_dtype or jnp.float32)
        if np.isfinite(np.asarray(result.weight)).all():
            return fp4_with_codes(rtn, result.weight) if fp4 else to_qtensor(result, spec, weight.dtype)
    raise ValueError(f"GPTQ's Cholesky factorisation failed even at damp_percent={damps[-1]}; "
                     "the calibration activations are degenerate")


def gptq_quantize_kernel(kernel: jax.Array, inputs: Iterable[jax.Array] | jax.Array | Hessian,
                         **options) -> QTensor:
    """``gptq_quantize_weight`` for a Flax kernel ``[K, N]``; the QTensor is ``[N, K]`` as
    ``Scheme.quantize_kernel`` returns it.

    Examples:
      >>> import numpy as np
      >>> from jquant.algorithms import gptq_quantize_kernel, gptq_quantize_weight
      >>> rng = np.random.default_rng(0)
      >>> kernel = rng.standard_normal((64, 16)).astype(np.float32)  # [K, N]
      >>> x = rng.standard_normal((256, 64)).astype(np.float32)
      >>> qt = gptq_quantize_kernel(kernel, x, scheme="int4_g32")
      >>> qt.shape, qt.k_axis
      ((16, 64), 1)
      >>> bool((qt.dequantize() == gptq_quantize_weight(kernel.T, x, scheme="int4_g32").dequantize()).all())
      True
    """
    kernel = jnp.asarray(kernel)
    if kernel.ndim != 2:
        raise ValueError(f"kernel must be 2-D [K, N], got shape {tuple(kernel.shape)}")
    return gptq_quantize_weight(kernel.T, inputs, **options)
