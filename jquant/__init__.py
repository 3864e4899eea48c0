"""jquant: LLM quantization for JAX, bit-exact with the PyTorch world's checkpoint formats."""

from jquant.qtensor import QTensor, dequantize
import jquant.formats as formats  # the package, callable: formats() lists the format names
from jquant.formats import quantize
from jquant.checkpoint import from_checkpoint, layouts, to_checkpoint
from jquant.ops import qdot
from jquant.schemes.scheme import Prepared, Scheme, get_scheme, register_scheme
import jquant.schemes as schemes  # the package, callable: schemes() lists the scheme names
from jquant.schemes.spec import ActivationSpec, LayoutSpec, WeightSpec
from jquant.schemes import xla as _xla_reference  # noqa: F401  (registers the XLA implementation)
from jquant.schemes import builtin as _builtin_schemes  # noqa: F401  (registers the named schemes)
from jquant.kernels.w4a16 import from_qtensor as _pallas_impl  # noqa: F401  (registers the Hopper kernels)
from jquant.kernels.w8a16 import from_qtensor as _pallas_w8_impl  # noqa: F401  (registers the 8-bit kernels)
from jquant.kernels.fp8_gemm import from_qtensor as _pallas_fp8_impl  # noqa: F401
from jquant.checkpoint.hf_config import scheme_from_config

__all__ = [
    "ActivationSpec", "LayoutSpec", "Prepared", "QTensor", "Scheme", "WeightSpec", "dequantize", "formats", "from_checkpoint", "get_scheme", "layouts",
    "qdot", "quantize", "register_scheme", "scheme_from_config", "schemes", "to_checkpoint",
]
