import os

import pytest

# JQUANT_TEST_GPU=1 runs the same tests on the real accelerator: the CPU pin is lifted and the
# `interpret` fixture turns Pallas interpret mode off, so kernels compile for the GPU.
ON_GPU = os.environ.get("JQUANT_TEST_GPU") == "1"
if ON_GPU:
    # pytest -n N runs N processes on one GPU: with JAX's default preallocation (75 % of the memory each)
    # the later workers failed cuDNN and autotuning with 1.5 MB free (H100, tests/kernels/w8a16, -n 4).
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
else:
    # Eight simulated CPU devices so sharding tests run anywhere; must precede the first jax import.
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import hypothesis  # noqa: E402

if ON_GPU:
    import jax  # noqa: E402

    # The references are float64: float32 dots must be float32 on the GPU too. XLA's default there is
    # TF32 (~1e-3 relative), which failed every float32 MoE layer test on the H100; users choose the
    # same with jax_default_matmul_precision, and bf16 dots are unaffected.
    jax.config.update("jax_default_matmul_precision", "float32")

hypothesis.settings.register_profile("ci", max_examples=25, deadline=None, derandomize=True)
hypothesis.settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture
def interpret() -> bool:
    """Whether Pallas kernels run in interpret mode: on CPU yes, under JQUANT_TEST_GPU=1 no."""
    return not ON_GPU


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs the GPU: run with JQUANT_TEST_GPU=1 on the device")
    for item in items:
        if "gpu" in item.keywords and not ON_GPU:
            item.add_marker(skip)
        if "multidevice" in item.keywords:
            import jax
            if jax.device_count() < 8:   # the 8 simulated CPU devices above, or 8 accelerators
                item.add_marker(pytest.mark.skip(reason=f"needs 8 devices, there are {jax.device_count()}"))


if ON_GPU:
    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(item, call):
        """A CUDA fault (misaligned address, illegal access) poisons the process's context, so every
        later test in it would fail for no fault of its own. Under pytest-xdist (``-n``) the worker
        exits after naming the test that hit it, and a fresh worker takes the rest; without it the
        run stops there, with its summary."""
        outcome = yield
        report = outcome.get_result()
        if not (report.failed and call.excinfo is not None and "CUDA_ERROR_" in str(call.excinfo.value)):
            return
        message = f"CUDA fault in {item.nodeid}: {str(call.excinfo.value)[:300]}"
        if os.environ.get("PYTEST_XDIST_WORKER"):
            import sys
            sys.stderr.write(f"\n{message}\n")
            sys.stderr.flush()
            os._exit(3)
        item.session.shouldstop = message
