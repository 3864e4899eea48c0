"""``jquant bench gemm8`` on CPU: tiny shapes, the kernels in interpret mode; the plumbing, the record
fields and the math of the FP8 kernel forced, not the timings. Under JQUANT_TEST_GPU=1 the swept
launches run compiled on the GPU."""

import dataclasses
import json

import chex
import jax
import jax.numpy as jnp
import pytest

from conftest import ON_GPU
from jquant.apps import bench as cli
from jquant.kernels.fp8_gemm import default_fp8_config
from jquant.kernels.gemv8.config import MAX_ROWS
from jquant.kernels.w8a16 import bench


# A GPU runs the whole benchmark instead of refusing, and its records name the GPU.
CPU_ONLY = pytest.mark.skipif(ON_GPU, reason="the CPU plumbing and refusal; on a GPU the bench runs for real")


def _atol(ref) -> float:
    """A bf16 step of the output where the interpreted and the compiled kernel meet, plus wgmma's
    accumulator on a GPU (1 % of the range); on CPU both sides are fp32 sums."""
    return 1e-2 * float(jnp.abs(ref).max()) if ON_GPU else 2e-2


@CPU_ONLY
def test_gemm8_bench_writes_records_for_every_scheme_and_impl(tmp_path, capsys):
    rc = cli.main(["gemm8", "--interpret", "--shapes", "128x256", "--ms", "1,9", "--reps", "1",
                   "--schemes", "int8_ch,fp8_e4m3_channel_w_only,fp8_e4m3_block128x128", "--out", str(tmp_path)])
    assert rc == 0
    records = json.loads((tmp_path / "gemm8.json").read_text())
    cells = {(r["scheme"], r["impl"], r["M"]) for r in records}
    for m in (1, 9):
        for name in ("int8_ch", "fp8_e4m3_channel_w_only", "fp8_e4m3_block128x128"):
            assert {(name, "scheme", m), (name, "mgpu", m), (name, "xla", m)} <= cells
            assert ((name, "triton", m) in cells) == (m <= MAX_ROWS)   # the GEMV where it runs
    # W8A8 FP8 forces the FP8 GEMM kernel, not the W8A16 one: its launch is the record's
    launches = {r["M"]: r["config"] for r in records
                if r["scheme"] == "fp8_e4m3_block128x128" and r["impl"] == "mgpu"}
    assert launches == {m: dataclasses.asdict(default_fp8_config(m, 256, blocked=True)) for m in (1, 9)}
    for r in records:
        assert r["device"].startswith("cpu") and r["N"] == 128 and r["K"] == 256 and r["time_us"] > 0
        assert r["baselines"]["xla_bf16"] > 0 and "commit" in r and "jax_version" in r
        assert r["w8a8"] == (r["scheme"] == "fp8_e4m3_block128x128")
        assert (r["config"] is not None) == (r["impl"] in ("mgpu", "triton"))
        assert r["hbm_tb_per_s"] > 0                     # the rate of the floor, measured on this device
    assert "| int8_ch | no | 128×256 | 1 | mgpu |" in (tmp_path / "gemm8.md").read_text()


@CPU_ONLY
def test_gemm8_bench_refuses_unknown_schemes_and_cpu_without_interpret(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["gemm8", "--schemes", "int4_g128", "--out", str(tmp_path)])
    assert e.value.code == 2 and "int8_ch" in capsys.readouterr().err
    assert cli.main(["gemm8", "--out", str(tmp_path)]) == 1
    assert "no GPU present" in capsys.readouterr().err and not list(tmp_path.iterdir())
    with pytest.raises(ValueError, match="unknown 8-bit schemes"):
        bench.run(names=["nf4"])


@pytest.mark.parametrize("name", ["fp8_e4m3_tensor", "fp8_e4m3_block128x128"])
def test_the_fp8_kernel_forced_computes_the_schemes_math(name, interpret):
    w = jax.random.normal(jax.random.key(0), (128, 256), jnp.bfloat16)
    x = jax.random.normal(jax.random.key(1), (9, 256), jnp.bfloat16)
    cands = {impl: fn(x, copies[0]) for impl, fn, copies, _ in
             bench._candidates(bench._weight(bench.schemes()[name], w, 1, print), 9, interpret=interpret, sweep=True)}
    assert set(cands) == {"scheme", "mgpu", "xla"}   # no swept launch below 128 rows
    ref = cands["scheme"].astype(jnp.float32)
    chex.assert_trees_all_close(cands["mgpu"].astype(jnp.float32), ref, rtol=2e-2, atol=_atol(ref))


def test_swept_fp8_launches_compute_the_schemes_math(interpret):
    """At 128 rows the block scheme's sweep runs two warpgroups (its default has one) as a snake (one x
    tile, 2 weight tiles: a strip wider than the grid) and persistent (more CTAs than tiles): the
    scheme's result."""
    w = jax.random.normal(jax.random.key(0), (256, 256), jnp.bfloat16)
    x = jax.random.normal(jax.random.key(1), (128, 256), jnp.bfloat16)
    wt = bench._weight(bench.schemes()["fp8_e4m3_block128x128"], w, 1, print)
    launches = bench._candidates(wt, 128, interpret=interpret, sweep=True)
    swept = [(impl, fn, cfg) for impl, fn, _, cfg in launches if impl.startswith("mgpu ")]
    assert [impl for impl, _, _ in swept] == ["mgpu 64x128 wg2 st4 snake8", "mgpu 64x128 wg2 st4 snake8 p132"]
    ref = launches[0][1](x, wt.prepared[0]).astype(jnp.float32)
    for _, fn, _ in swept:
        chex.assert_trees_all_close(fn(x, wt.packed[0]).astype(jnp.float32), ref, rtol=2e-2, atol=_atol(ref))
    channel = bench._weight(bench.schemes()["fp8_e4m3_channel"], w, 1, print).packed[0]
    assert [bench._label(c) for c in bench._sweep(4096, channel)] == [
        "mgpu 64x128 wg1 st4", "mgpu 64x128 wg2 st4 snake8", "mgpu 128x128 wg2 st3", "mgpu 64x256 wg2 st3",
        "mgpu 64x128 wg2 st4 snake8 p132", "mgpu 64x256 wg2 st3 snake8 p132"]
    # (the default, 64 × 256 on the snake grid, is not swept again)
    assert bench._sweep(127, channel) == []


def test_swept_w8a16_launches_compute_the_schemes_math(interpret):
    """At M = 256 the W8_SWEEP launches (256 x rows a CTA 3 and 4 deep, 128 over 256 weight rows) beside
    a small weight's one-warpgroup default: the scheme's result."""
    w = jax.random.normal(jax.random.key(0), (256, 256), jnp.bfloat16)
    x = jax.random.normal(jax.random.key(1), (256, 256), jnp.bfloat16)
    wt = bench._weight(bench.schemes()["int8_ch"], w, 1, print)
    launches = bench._candidates(wt, 256, interpret=interpret, sweep=True)
    swept = [(impl, fn) for impl, fn, _, _ in launches if impl.startswith("mgpu ")]
    assert [impl for impl, _ in swept] == ["mgpu n128 k64 m256 wg2 st3", "mgpu n128 k64 m256 wg2 st4",
                                           "mgpu n256 k64 m128 wg2 st4"]
    ref = launches[0][1](x, wt.prepared[0]).astype(jnp.float32)
    # K = 256 sums of ~±3 reach ~70, where a bf16 step is 0.25: the kernel's other summation order may
    # round there the other way (the default launch does too)
    for _, fn in swept:
        chex.assert_trees_all_close(fn(x, wt.packed[0]).astype(jnp.float32), ref, rtol=1e-2,
                                    atol=1e-2 * float(jnp.abs(ref).max()))
    assert bench._sweep(255, wt.packed[0]) == []
