"""Calibration algorithms: a thin model-facing file and a pure-math ``*_core.py`` per algorithm.

* ``calibrate``: a Llama quantized layer by layer from calibration activations (``calibrate_llama``
  with ``gptq_group`` or ``rtn_group``).
* ``gptq`` / ``gptq_core``: GPTQ for one linear layer (Hessian, dampening, block updates, groups,
  act-order), to a QTensor that exports to the ``gptq`` layout.
* ``awq`` / ``awq_core``: AWQ for a Llama (``awq_llama``: scales folded into the norms) and its
  scale and clip searches for one linear layer.
* ``smoothquant`` / ``smoothquant_core``: SmoothQuant for a Llama (``smoothquant_llama``) and its
  activation-to-weight scale migration.
* ``scaling``: where a group's scales fold in a Llama layer.
* ``rotation``: block-wise Walsh–Hadamard transforms of weights and activations (``gptq_group`` /
  ``rtn_group`` take ``rotation=``).
"""

from jquant.algorithms.awq import awq_llama
from jquant.algorithms.calibrate import calibrate_llama, gptq_group, rtn_group
from jquant.algorithms.smoothquant import smoothquant_llama
from jquant.algorithms.gptq import Hessian, accumulate_hessian, gptq_quantize_kernel, gptq_quantize_weight

__all__ = ["Hessian", "accumulate_hessian", "awq_llama", "calibrate_llama", "gptq_group", "gptq_quantize_kernel",
           "gptq_quantize_weight", "rtn_group", "smoothquant_llama"]
