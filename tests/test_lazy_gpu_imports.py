"""``import jquant`` and everything short of running the kernel (registering the Hopper impl,
laying a weight out, the XLA and reference paths) load no Pallas GPU backend."""

import os
import subprocess
import sys

_GPU_MODULES = ("jax.experimental.pallas.mosaic_gpu", "jax.experimental.pallas.triton",
                "jax._src.pallas.mosaic_gpu", "jax._src.pallas.triton")

_CHECK = f"""
import sys
{{body}}
loaded = sorted(m for m in sys.modules if m.startswith({_GPU_MODULES!r}))
print(",".join(loaded))
"""


def _loaded_gpu_modules(body: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", _CHECK.format(body=body)], check=True,
                         capture_output=True, text=True,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"}).stdout
    return [m for m in out.strip().split(",") if m]


def test_import_and_cpu_paths_load_no_pallas_gpu_module():
    body = """
import jax, jax.numpy as jnp
import jquant
from jquant.kernels.w4a16 import prepack_nk, w4a16_matmul
from jquant.kernels.w4a16.from_qtensor import _prepare
scheme = jquant.get_scheme("int4_g128")
qt = scheme.quantize_weight(jnp.ones((128, 256), jnp.float32))
packed = _prepare(scheme, qt)
x = jnp.ones((2, 256), jnp.bfloat16)
for impl in ("auto", "xla", "reference"):
    w4a16_matmul(x, packed, impl=impl).block_until_ready()
"""
    assert _loaded_gpu_modules(body) == []


def test_the_kernel_module_loads_mosaic_gpu():
    """The names above are the ones the kernel really imports (else the test above is vacuous)."""
    loaded = _loaded_gpu_modules("import jquant.kernels.w4a16.mosaic_gpu")
    assert "jax.experimental.pallas.mosaic_gpu" in loaded
