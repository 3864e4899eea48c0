"""The device policy of jquant.schemes.dispatch, per architecture, on fake devices."""

import dataclasses
import warnings

import jax.numpy as jnp
import pytest

from conftest import ON_GPU
import jquant
from jquant.schemes import dispatch
from jquant.schemes import scheme as scheme_lib


@dataclasses.dataclass(frozen=True)  # hashable: compute_capability caches per device
class FakeDevice:
    platform: str
    device_kind: str
    compute_capability: str | None = None


HOPPER = FakeDevice("gpu", "NVIDIA H200", "9.0")
ADA = FakeDevice("gpu", "NVIDIA L4", "8.9")
AMPERE = FakeDevice("gpu", "NVIDIA A100-SXM4-80GB", "8.0")
BLACKWELL = FakeDevice("gpu", "NVIDIA B200", "10.0")
BLACKWELL_RTX = FakeDevice("gpu", "NVIDIA GeForce RTX 5090", "12.0")
TURING = FakeDevice("gpu", "Tesla T4", "7.5")
CPU = FakeDevice("cpu", "cpu")

# device → (capability, Mosaic GPU wgmma kernels, Triton-backend Pallas kernels, decode attention impl,
#           native FP8 dot, 4-bit GEMM "auto" at M=1, at M=MGPU_MAX_M + 1)
POLICY = [
    (HOPPER, 90, True, True, "pallas", True, "mgpu", "xla"),
    (ADA, 89, False, True, "pallas", True, "xla", "xla"),
    (AMPERE, 80, False, True, "pallas", True, "xla", "xla"),
    (BLACKWELL, 100, False, True, "pallas", True, "xla", "xla"),
    (BLACKWELL_RTX, 120, False, True, "pallas", True, "xla", "xla"),
    (TURING, 75, False, False, "xla", True, "xla", "xla"),
    (CPU, 0, False, False, "xla", False, "reference", "reference"),
]


@pytest.mark.parametrize("device, cc, mosaic, triton, attention, fp8_dot, w4_small_m, w4_large_m", POLICY,
                         ids=lambda v: v.device_kind if isinstance(v, FakeDevice) else None)
def test_policy_per_architecture(device, cc, mosaic, triton, attention, fp8_dot, w4_small_m, w4_large_m):
    assert dispatch.compute_capability(device) == cc
    assert dispatch.is_gpu(device) == (device.platform == "gpu") and dispatch.is_cpu(device) == (device is CPU)
    assert dispatch.device_name(device) == f"{device.platform}:{device.device_kind}"
    assert dispatch.has_wgmma(cc) == mosaic and dispatch.runs_mosaic_gpu(device) == mosaic
    assert dispatch.runs_triton_pallas(device) == triton
    assert dispatch.decode_attention_impl(device) == attention
    assert dispatch.native_fp8_dot(device) == fp8_dot
    assert dispatch.w4a16_impl(1, cc) == w4_small_m
    assert dispatch.w4a16_impl(dispatch.MGPU_MAX_M + 1, cc) == w4_large_m
    assert dispatch.w4a16_fallback(cc) == ("reference" if device is CPU else "xla")


@pytest.mark.parametrize("device", [row[0] for row in POLICY], ids=lambda d: d.device_kind)
def test_decode_attention_runs_a_float32_query_on_xla(device):
    """The attention kernels' tensor-core operands are 16-bit: a float32 query stays on XLA everywhere."""
    assert dispatch.decode_attention_impl(device, jnp.float32) == "xla"
    assert dispatch.decode_attention_impl(device, jnp.float16) == dispatch.decode_attention_impl(device)


def test_w4a16_m_thresholds_on_hopper():
    small = 4096 * 4096  # launch-bound past M = 128
    assert dispatch.w4a16_impl(dispatch.MGPU_MAX_M, 90) == "mgpu"
    assert dispatch.w4a16_impl(dispatch.MGPU_MAX_M_SMALL_WEIGHT, 90, small) == "mgpu"
    assert dispatch.w4a16_impl(dispatch.MGPU_MAX_M_SMALL_WEIGHT + 1, 90, small) == "xla"


def test_sm_count_reads_the_gpus_core_count():
    @dataclasses.dataclass(frozen=True)
    class Counted(FakeDevice):
        core_count: int = 0

    assert dispatch.sm_count(Counted("gpu", "NVIDIA H100 80GB HBM3", "9.0", 132)) == 132
    assert dispatch.sm_count(HOPPER) == 0   # no count: not persistent
    assert dispatch.sm_count(Counted("cpu", "cpu", None, 16)) == 0


@pytest.mark.skipif(ON_GPU, reason="states the CPU host's dispatch; a GPU run checks the GPU's in the kernels' tests")
def test_this_host_has_no_sm_count():
    assert dispatch.sm_count() == 0


def test_non_cuda_capability_strings_are_no_cuda_device():
    assert dispatch.compute_capability(FakeDevice("gpu", "AMD Instinct MI250X", "gfx90a")) == 0
    assert dispatch.compute_capability(FakeDevice("gpu", "unknown")) == 0
    assert dispatch.compute_capability(FakeDevice("tpu", "TPU v5 lite", "9.0")) == 0


@pytest.mark.skipif(ON_GPU, reason="states the CPU host's dispatch; a GPU run checks the GPU's in the kernels' tests")
def test_this_host_is_a_cpu():
    assert dispatch.platform() == "cpu" and dispatch.is_cpu() and not dispatch.is_gpu()
    assert dispatch.device_name().startswith("cpu:") and dispatch.compute_capability() == 0
    from jquant.kernels.decode_attention import choose_impl

    assert choose_impl(jnp.zeros((1, 2, 16)), jnp.zeros((1, 8, 2, 16))) == "xla"


@pytest.mark.parametrize("device, impls", [(HOPPER, ["pallas_w4a16", "xla"]), (ADA, ["xla"]), (BLACKWELL, ["xla"]),
                                           (BLACKWELL_RTX, ["xla"]), (CPU, ["xla"])])
def test_scheme_dispatch_reads_the_given_device(device, impls):
    scheme = jquant.get_scheme("int4_g128")
    assert [i.name for i in scheme_lib.candidate_impls(scheme, device)] == impls
    qw = scheme.quantize_weight(jnp.ones((128, 256), jnp.float32))
    # Laying the weight out needs no GPU; only running the kernel would.
    assert scheme.process_weights_after_loading(qw, device).impl == impls[0]


def test_fp8_below_its_capability_warns_once():
    scheme = jquant.get_scheme("fp8_e4m3_tensor")
    scheme_lib._WARNED.discard(scheme.name)
    with pytest.warns(UserWarning, match="needs compute capability 89 .* has 80"):
        assert [i.name for i in scheme_lib.candidate_impls(scheme, AMPERE)] == ["xla"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scheme_lib.candidate_impls(scheme, AMPERE)
        scheme_lib.candidate_impls(scheme, CPU)  # no fast path is missed off GPUs: no warning
