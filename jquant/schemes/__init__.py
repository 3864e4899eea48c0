"""Quantization schemes: typed specs, the named schemes, the one dispatch and the XLA implementation.

Calling the package lists the registered scheme names (``jquant.schemes()``).

Examples:
  >>> import jquant
  >>> "int4_g128" in jquant.schemes()
  True
  >>> jquant.schemes.scheme.get_scheme("nvfp4").weight.format
  'nvfp4'
"""

from jquant._callable_module import make_callable  # noqa: E402
from jquant.schemes.scheme import schemes  # noqa: E402

make_callable(__name__, schemes)   # jquant.schemes() lists the schemes; jquant.schemes.* is this package
