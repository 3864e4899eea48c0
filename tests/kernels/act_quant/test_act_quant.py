"""The e4m3 activation-quantization kernel (interpreted on CPU, compiled under JQUANT_TEST_GPU=1) returns
the formats' QTensor bit for bit: per token and per 1 × G group (UE8M0 or not), bf16 / fp16 / float32
inputs, on rows built to break it (zeros, -0.0, NaN, ±Inf, subnormals, the dtype's max, e4m3 rounding
midpoints, the scale floors). The reference runs on the CPU, whose division is IEEE, on every machine."""

import functools

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from conftest import ON_GPU
from cuda_lowering import lower_for_cuda
from jquant.formats import fp8
from jquant.kernels.act_quant import ActQuantConfig, quantize_fp8_activations, quantize_scheme_activation
from jquant.kernels.act_quant import bench
from jquant.schemes import builtin
from jquant.schemes.xla import quantize_activation

MODES = {"token": (None, False), "group": (128, False), "group_ue8m0": (128, True)}
DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


def _reference(x, group_size, ue8m0):
    """The formats' function on the CPU (IEEE division): the bits vLLM's CUDA kernels write."""
    cpu = jax.devices("cpu")[0]
    fn = (functools.partial(fp8.quantize_fp8_per_token) if group_size is None else
          functools.partial(fp8.quantize_fp8_per_token_group, group_size=group_size, ue8m0=ue8m0))
    with jax.default_device(cpu):
        return fn(jax.device_put(x, cpu))


def assert_same_qtensor(out, ref):
    """Same metadata; codes and scales equal bit for bit, but a NaN only has to be a NaN (a GPU's NaN
    is positive, x86's default NaN negative)."""
    assert jax.tree.structure(out) == jax.tree.structure(ref)
    codes, ref_codes = (np.asarray(q.data).view(np.uint8) for q in (out, ref))
    nan = lambda c: (c & 0x7F) == 0x7F
    np.testing.assert_array_equal(nan(codes), nan(ref_codes))
    np.testing.assert_array_equal(np.where(nan(codes), 0, codes), np.where(nan(ref_codes), 0, ref_codes))
    scale, ref_scale = (np.asarray(q.scale, np.float32) for q in (out, ref))
    np.testing.assert_array_equal(np.isnan(scale), np.isnan(ref_scale))
    np.testing.assert_array_equal(np.where(np.isnan(scale), 0, scale).view(np.uint32),
                                  np.where(np.isnan(ref_scale), 0, ref_scale).view(np.uint32))


def _midpoints():
    """448, then every positive e4m3 value and the midpoint above it (ties to even decide): at amax 448
    the per-token scale is 1, so the quotients are these values exactly."""
    grid = np.unique(np.abs(np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)))
    grid = grid[np.isfinite(grid)]
    return np.concatenate([[448.0], grid, (grid[:-1] + grid[1:]) / 2]).astype(np.float32)


def adversarial_rows(k: int, dtype, rng) -> np.ndarray:
    """[14, k] rows of ``dtype`` (as float32) that each break a different step."""
    info = ml_dtypes.finfo(dtype)
    tiny = float(info.smallest_subnormal)
    rows = rng.standard_normal((14, k)).astype(np.float32) * 3
    rows[0] = 0.0
    rows[1] = -0.0
    rows[2, rng.integers(k)] = np.nan
    rows[3, rng.integers(k)] = np.inf
    rows[4, :2] = (-np.inf, np.inf)
    mid = _midpoints()
    rows[5] = np.resize(np.concatenate([mid, -mid]), k)
    rows[6] = tiny * rng.integers(-8, 9, k)                               # subnormals only
    rows[7, ::5] = float(info.max) * rng.choice([-1, 1], rows[7, ::5].shape)
    rows[8] = rng.standard_normal(k) * 1e-3
    rows[8, rng.integers(k)] = 1e4 if dtype != jnp.float16 else 6e4         # quotients in e4m3's subnormals
    rows[9] = rng.standard_normal(k) * 1e-7                                # below the per-token floor
    rows[10] = np.float32(2.0) ** rng.integers(-20, 15, k)                 # powers of two
    rows[11] = -rows[11]
    rows[12, rng.integers(k, size=3)] = np.nan
    rows[13] = 1e-12                                                       # below the group's 1e-10 floor
    return np.asarray(jnp.asarray(rows, dtype).astype(jnp.float32))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_adversarial_rows_match_the_formats(mode, dtype, interpret):
    group_size, ue8m0 = MODES[mode]
    rng = np.random.default_rng()
    rows = np.concatenate([adversarial_rows(384, dtype, rng), rng.standard_normal((3, 384)).astype(np.float32)])
    x = jnp.asarray(rng.permutation(rows), dtype)                # 17 rows: the last block of 4 partial
    out = quantize_fp8_activations(x, group_size, ue8m0=ue8m0, impl="pallas", interpret=interpret,
                                   config=ActQuantConfig(block_rows=4, num_warps=4))
    assert_same_qtensor(out, _reference(x, group_size, ue8m0))


@settings(max_examples=12)
@given(rows=st.integers(1, 40), groups=st.integers(1, 4), group=st.sampled_from([64, 96, 128]),
       mode=st.sampled_from(sorted(MODES)), scale=st.sampled_from([1e-30, 1e-4, 1.0, 1e3, 1e30]),
       seed=st.integers(0, 2**31))
def test_random_shapes_and_magnitudes_match_the_formats(rows, groups, group, mode, scale, seed):
    group_size, ue8m0 = MODES[mode]
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((rows, groups * group)) * scale, jnp.float32)
    out = quantize_fp8_activations(x, group_size and group, ue8m0=ue8m0, impl="pallas", interpret=not ON_GPU)
    assert_same_qtensor(out, _reference(x, group_size and group, ue8m0))


def test_nan_and_inf_at_a_models_size(interpret):
    """256 × 4096 bf16 with a NaN in one row and an Inf in another: only those rows change."""
    rng = np.random.default_rng()
    x = rng.standard_normal((256, 4096)).astype(np.float32)
    nan_row, inf_row = rng.choice(256, 2, replace=False)
    x[nan_row, rng.integers(4096)] = np.nan
    x[inf_row, rng.integers(4096)] = -np.inf
    x = jnp.asarray(x, jnp.bfloat16)
    for group_size in (None, 128):
        out = quantize_fp8_activations(x, group_size, impl="pallas", interpret=interpret)
        ref = _reference(x, group_size, False)
        assert_same_qtensor(out, ref)
        assert np.isnan(np.asarray(out.scale)[nan_row]).any() and not np.isnan(np.delete(
            np.asarray(out.scale), [nan_row, inf_row], axis=0)).any()


def test_leading_axes_and_one_row(interpret):
    rng = np.random.default_rng()
    for shape in ((2, 3, 256), (1, 256), (256,)):
        x = jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
        out = quantize_fp8_activations(x, impl="pallas", interpret=interpret)
        assert out.shape == shape and out.data.shape == shape
        assert_same_qtensor(out, _reference(x, None, False))


def test_scheme_activations_take_the_kernel_with_the_same_bits(interpret):
    """The W8A8 FP8 schemes' activations: per token and per 1 × 128 group through the kernel, the same
    QTensor as the schemes' XLA path; per-tensor and static ones are that path itself."""
    x = jnp.asarray(np.random.default_rng().standard_normal((9, 512)) * 5, jnp.bfloat16)
    for scheme in (builtin.fp8_channel(), builtin.fp8_block(), builtin.fp8_block(ue8m0=True),
                   builtin.fp8_tensor(), builtin.fp8_tensor(static_activations=True)):
        scale = jnp.float32(0.02) if scheme.activation.mode == "static" else None
        out = quantize_scheme_activation(scheme, x, scale, interpret=interpret)
        chex.assert_trees_all_equal(out, quantize_activation(scheme, x, scale))


def test_lowers_to_one_kernel_for_cuda():
    for shape, group_size, name in (((4096, 14336), None, "token"), ((4096, 7168), 128, "group")):
        text = lower_for_cuda(functools.partial(quantize_fp8_activations, group_size=group_size, impl="pallas"),
                              jax.ShapeDtypeStruct(shape, jnp.bfloat16))
        assert text.count("__gpu$xla.gpu.triton") == 1 and f"jquant_act_quant_fp8_{name}" in text
        assert "stablehlo.divide" not in text          # no XLA division left around the kernel


def test_checks_come_from_the_formats():
    x = jnp.ones((4, 200), jnp.bfloat16)
    with pytest.raises(ValueError, match="group_size"):
        quantize_fp8_activations(x, 128, impl="pallas", interpret=True)
    with pytest.raises(ValueError, match="empty"):
        quantize_fp8_activations(jnp.ones((0, 256), jnp.bfloat16), impl="pallas", interpret=True)
    with pytest.raises(ValueError, match="impl"):
        quantize_fp8_activations(x, impl="cuda")
    with pytest.raises(ValueError, match="power of two"):
        ActQuantConfig(block_rows=6)


def test_bench_checks_bits_and_writes_a_table():
    records = bench.run(((3, 256),), reps=1, interpret=True, log=lambda s: None, calls=2)
    assert [(r["mode"], r["rows"], r["k"], r["bit_exact"]) for r in records] == [
        ("token", 3, 256, True), ("group", 3, 256, True)]
    assert records[0]["useful_bytes"] == 3 * 256 * 3 + 3 * 4 and records[1]["useful_bytes"] == 3 * 256 * 3 + 6 * 4
    assert "| token | 3 × 256 | default |" in bench.to_markdown(records)
    assert all(c.block_rows * 8192 <= 32768 for c in bench.sweep(4096, 8192))


def test_cli_checks_options_then_says_no_gpu(capsys, tmp_path, monkeypatch):
    from jquant.apps import cli
    from jquant.schemes import dispatch
    monkeypatch.setattr(dispatch, "is_gpu", lambda: False)   # the no-GPU path, on any machine
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "act-quant", "--shapes", "4096"])
    assert e.value.code == 2 and "MxK" in capsys.readouterr().err
    assert cli.main(["bench", "act-quant", "--shapes", "8x256", "--out", str(tmp_path)]) == 1
    assert "no GPU present" in capsys.readouterr().err and not list(tmp_path.iterdir())


def test_dispatch_by_rows_and_capability(monkeypatch):
    from jquant.kernels.act_quant import api
    from jquant.schemes import dispatch
    assert dispatch.act_quant_impl(1, 90) == "pallas"       # the pass won at every M timed
    monkeypatch.setattr(dispatch, "ACT_QUANT_KERNEL_MIN_ROWS", 64)
    assert [dispatch.act_quant_impl(r, cc) for r, cc in ((64, 90), (63, 90), (64, 89), (64, 86))] == [
        "pallas", "xla", "pallas", "xla"]
    monkeypatch.setattr(dispatch, "runs_triton_pallas", lambda: True)
    monkeypatch.setattr(dispatch, "compute_capability", lambda: 90)
    assert api.choose_impl(64) == "pallas" and api.choose_impl(1) == "xla"
    # "auto" counts rows over the leading axes: [2, 32, K] is 64 rows
    seen = []
    monkeypatch.setattr(api, "choose_impl", lambda rows: seen.append(rows) or "xla")
    quantize_fp8_activations(jnp.ones((2, 32, 128), jnp.bfloat16))
    assert seen == [64]
