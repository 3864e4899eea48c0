"""Calibration algorithms: a thin model-facing file and a pure-math ``*_core.py`` per algorithm.

* ``calibrate``: a Llama quantized layer by layer from calibration activations (``calibrate_llama``
  with ``gptq_group`` or ``rtn_group``).
* ``gptq`` / ``gptq_core``: GPTQ for one linear layer (Hessian, dampening, block updates, groups,
  act-order), to a QTensor that exports to the ``gptq`` layout.
* ``awq_core``: AWQ's activation-aware scale search and clip search for one linear layer.
* ``smoothquant_core``: SmoothQuant's activation-to-weight scale migration.
* ``rotation``: block-wise Walsh–Hadamard transforms of weights and activations.
"""

from jquant.algorithms.calibrate import calibrate_llama, gptq_group, rtn_group
from jquant.algorithms.gptq import Hessian, accumulate_hessian, gptq_quantize_kernel, gptq_quantize_weight

__all__ = ["Hessian", "accumulate_hessian", "calibrate_llama", "gptq_group", "gptq_quantize_kernel",
           "gptq_quantize_weight", "rtn_group"]
