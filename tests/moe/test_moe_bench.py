"""``jquant bench moe`` on CPU with tiny layers: the records' fields, the byte floor, option checks, and
the optional tokamax candidate through stand-in ``tokamax`` / ``qwix`` modules."""

import dataclasses
import json
import sys
import types

import chex
import jax
import jax.numpy as jnp
import pytest

from conftest import ON_GPU
from jquant.apps import bench as bench_cli
from jquant.kernels.moe import bench
from jquant.models.moe import quantize_experts

GPT_OSS = bench.SHAPES["gpt-oss-20b"].tiny()   # 8 experts, top-4, hidden = intermediate = 64


# tokamax is no dependency of jquant: stand-ins of its API (and qwix's QArray), whose Mosaic GPU
# implementation refuses, as it does off Hopper.

@dataclasses.dataclass(frozen=True)
class _QArray:
    qvalue: jax.Array
    scale: jax.Array
    zero_point: jax.Array | None = None
    qtype: object = None


jax.tree_util.register_dataclass(_QArray, data_fields=["qvalue", "scale", "zero_point"], meta_fields=["qtype"])


def _ragged_dot(lhs, rhs, group_sizes, preferred_element_type=None, implementation=None):
    if implementation == "mosaic":
        raise NotImplementedError("no Mosaic GPU here")
    k = rhs.qvalue.shape[1]
    w = rhs.qvalue.astype(jnp.float32) * jnp.repeat(rhs.scale.astype(jnp.float32), k // rhs.scale.shape[1], 1)
    return jax.lax.ragged_dot(lhs, w.astype(lhs.dtype), group_sizes, preferred_element_type=preferred_element_type)


@pytest.fixture
def fake_tokamax(monkeypatch):
    monkeypatch.setitem(sys.modules, "qwix", types.SimpleNamespace(QArray=_QArray))
    monkeypatch.setitem(sys.modules, "tokamax", types.SimpleNamespace(ragged_dot=_ragged_dot))


@pytest.mark.skipif(ON_GPU, reason="a CPU smoke run of the bench; on the GPU it times for real")
def test_cpu_smoke_run_writes_the_records(tmp_path, capsys, fake_tokamax):
    assert bench_cli.main(["moe", "--tiny", "--allow-cpu", "--shapes", "gpt-oss-20b", "--tokens", "1",
                           "--formats", "int4_g32", "--reps", "1", "--out", str(tmp_path)]) == 0
    assert "wrote" in capsys.readouterr().out
    records = json.loads((tmp_path / "moe.json").read_text())
    assert [(r["shape"], r["format"], r["tokens"]) for r in records] == [("gpt-oss-20b-tiny", "int4_g32", 1)]
    for r in records:
        assert {"device", "jax_version", "commit", "date"} <= set(r) and r["device"].startswith("cpu")
        assert (r["num_experts"], r["top_k"], r["hidden"], r["intermediate"]) == (8, 4, 64, 64)
        assert r["weight_shapes"] == {"gate_up_proj": [8, 128, 64], "down_proj": [8, 64, 64]}
        assert r["layer"]["activation"] == "gptoss_swiglu" and r["weight_fmt"] == "int4" and r["impl"] == "xla"
        assert set(r["baselines"]) == {"bf16_ragged_dot", "dequant_ragged_dot", "tokamax"} and r["time_us"] > 0
        assert r["speedup_vs_bf16"] == pytest.approx(r["baselines"]["bf16_ragged_dot"] / r["time_us"], rel=1e-2)
        assert r["tokamax"] == "ok" and r["tokamax_impl"] == "default"   # Mosaic refused: the default chain
        assert r["active_experts"] == 4   # one token: its top-4
        # the byte floor: the experts hit, the router (weight and bias, bf16), x and y
        router = 8 * 64 * 2 + 8 * 2
        assert r["bytes_touched"] == pytest.approx(r["active_experts"] * r["expert_bytes"] + router
                                                   + 2 * r["tokens"] * 64 * 2, abs=1)
        assert r["byte_floor_us"] == pytest.approx(1e6 * r["bytes_touched"] / r["hbm_bytes_per_s"], rel=1e-2)
        assert 0 < r["byte_floor_us"] < r["bf16_byte_floor_us"]   # int4 experts: fewer bytes than bf16
    md = (tmp_path / "moe.md").read_text()
    assert md.startswith("# MoE layer benchmark\n\ncpu:") and "| gpt-oss-20b-tiny | int4_g32 | 1 | 4/8 | " in md


@pytest.mark.skipif(ON_GPU, reason="a CPU smoke run of the bench; on the GPU it times for real")
def test_options_are_checked_and_a_gpu_is_required(tmp_path, capsys):
    for bad in (["--shapes", "mixtral"], ["--formats", "int3"], ["--tokens", "0"]):
        with pytest.raises(SystemExit):
            bench_cli.main(["moe", "--allow-cpu", *bad])
    assert "--formats: unknown ['int3']" in capsys.readouterr().err
    assert bench_cli.main(["moe", "--out", str(tmp_path)]) == 1   # no GPU and no --allow-cpu
    assert "no GPU present" in capsys.readouterr().err and not (tmp_path / "moe.json").exists()


def test_help_names_the_benchs_defaults():
    sub = next(a for a in bench_cli.build_parser()._actions if a.dest == "bench")
    text = sub.choices["moe"].format_help().replace("\n", " ")
    text = " ".join(text.split())
    for name, shape in bench.SHAPES.items():
        assert f"{name} {','.join(shape.formats)}" in text
    assert ",".join(map(str, bench.TOKENS)) in text


def test_shapes_are_the_models():
    ds = bench.SHAPES["deepseek-v3"].model()
    assert (ds.num_experts, ds.top_k, ds.hidden, ds.intermediate) == (256, 8, 7168, 2048)
    assert (ds.scoring, ds.n_group, ds.topk_group, ds.routed_scaling_factor) == ("sigmoid", 8, 4, 2.5)
    go = bench.SHAPES["gpt-oss-20b"].model()
    assert (go.num_experts, go.top_k, go.hidden, go.intermediate, go.activation) == (32, 4, 2880, 2880,
                                                                                      "gptoss_swiglu")
    assert go.router_bias and go.expert_bias and go.dtype == jnp.bfloat16
    tiny = bench.SHAPES["deepseek-v3"].tiny().model()
    assert (tiny.num_experts, tiny.n_group, tiny.topk_group, tiny.scoring) == (16, 4, 2, "sigmoid")
    qw = bench.SHAPES["qwen3-30b-a3b"].model()
    assert (qw.num_experts, qw.top_k, qw.hidden, qw.intermediate) == (128, 8, 2048, 768)
    assert (qw.scoring, qw.normalize_weights, qw.shared_expert, qw.activation) == ("softmax", True, False, "swiglu")


def test_tokamax_runs_the_same_int4_weights_inside_the_layer(fake_tokamax):
    assert (bench.tokamax_status("int4_g32"), bench.tokamax_status("mxfp4")) == ("ok", "n/a")
    model = GPT_OSS.model()
    params = bench.random_params(model, jax.random.key(1))
    qparams, _ = quantize_experts(params, "int4_g32")
    tparams = bench.tokamax_params(qparams)
    rhs = tparams["gate_up_proj"].rhs
    assert rhs.qvalue.dtype == jnp.int4 and rhs.qvalue.shape == (8, 64, 128) and rhs.scale.shape == (8, 2, 128)
    x = jax.random.normal(jax.random.key(2), (5, 64), jnp.bfloat16)
    apply = jax.jit(lambda p, x: model.apply({"params": p}, x).astype(jnp.float32))
    chex.assert_trees_all_close(apply(tparams, x), apply(qparams, x), atol=1e-2, rtol=1e-2)


def test_tokamax_absent_is_recorded(monkeypatch):
    monkeypatch.setitem(sys.modules, "tokamax", None)   # import tokamax raises ImportError
    assert bench.tokamax_status("int4_g32") == "absent"
    assert "| absent |" in bench.to_markdown([dict(
        shape="s", format="mxfp4", tokens=1, active_experts=1, num_experts=2, time_us=2.0,
        baselines={"bf16_ragged_dot": 1.0, "dequant_ragged_dot": 3.0}, tokamax="absent", speedup_vs_bf16=0.5,
        byte_floor_us=0.1, pct_of_byte_floor=5.0, spread_pct=1.0)])
    # a cell whose candidates all failed: each says why where the record knows it; ratios against them "—"
    oom = "JaxRuntimeError: RESOURCE_EXHAUSTED: Out of memory while trying to allocate 28.02GiB"
    assert ("| s | mxfp4 | 4096 | 2/2 | failed | failed (out of memory) | failed: ValueError: no | absent |  |  | — "
            "| 9.0 | — |  |  |") in bench.to_markdown([dict(
                shape="s", format="mxfp4", tokens=4096, active_experts=2, num_experts=2, time_us=None, baselines={},
                tokamax="absent", speedup_vs_bf16=None, byte_floor_us=9.0, pct_of_byte_floor=None, spread_pct=None,
                failed={"bf16_ragged_dot": oom, "dequant_ragged_dot": "ValueError: no"})])


def test_a_candidate_that_fails_is_recorded_and_the_rest_timed():
    how = bench._How(reps=1, warmup=1, retries=0, max_spread_pct=25.0, min_batch_s=1e-4, max_copies=1,
                     hbm_bytes_per_s=1e12, meta={}, log=lambda s: None)

    def out_of_memory(x):
        raise RuntimeError("RESOURCE_EXHAUSTED: out of memory")

    x = jnp.ones(8)
    times, _, failed = bench._time_cell({"quantized": (lambda x: x + 1, [(x,)]), "tokamax": (out_of_memory, [(x,)]),
                                         "bf16_ragged_dot": (lambda x: x * 2, [(x,)])}, how)
    assert sorted(times) == ["bf16_ragged_dot", "quantized"]
    assert failed == {"tokamax": "RuntimeError: RESOURCE_EXHAUSTED: out of memory"}
    assert bench._time_cell({"quantized": (out_of_memory, [(x,)])}, how) == ({}, [], {  # nothing left to time
        "quantized": "RuntimeError: RESOURCE_EXHAUSTED: out of memory"})


@pytest.mark.skipif(ON_GPU, reason="a CPU smoke run of the bench; on the GPU it times for real")
def test_profile_traces_the_quantized_layer_of_every_cell(tmp_path):
    assert bench_cli.main(["moe", "--tiny", "--allow-cpu", "--shapes", "gpt-oss-20b", "--tokens", "1",
                           "--formats", "int4_g32", "--reps", "1", "--out", str(tmp_path / "out"),
                           "--profile", str(tmp_path / "traces")]) == 0
    (record,) = json.loads((tmp_path / "out" / "moe.json").read_text())
    assert isinstance(record["profile"]["quantized"], dict)   # empty on CPU: its trace holds no GPU kernels
    traced = tmp_path / "traces" / "gpt-oss-20b-tiny_int4_g32_t1_quantized"
    assert list(traced.rglob("*.trace.json.gz"))   # what summarize_trace reads


@pytest.mark.multidevice
def test_split_run_on_simulated_devices_writes_the_records(tmp_path, capsys):
    # conftest gives 8 simulated CPU devices; the timings mean nothing, the records' fields do.
    assert bench_cli.main(["moe", "--tiny", "--allow-cpu", "--shapes", "gpt-oss-20b", "--tokens", "4",
                           "--formats", "mxfp4", "--reps", "1", "--tp", "1,2", "--fp8-collectives",
                           "--out", str(tmp_path)]) == 0
    assert "wrote" in capsys.readouterr().out
    records = json.loads((tmp_path / "moe_tp.json").read_text())
    cells = [(r["tp"], r["mode"], r["collectives"]) for r in records]
    assert cells == [(1, "expert", "psum"), (1, "tensor", "psum"), (2, "expert", "psum"), (2, "expert", "fp8"),
                     (2, "tensor", "psum"), (2, "tensor", "fp8")]
    for r in records:
        assert {"device", "jax_version", "commit", "date"} <= set(r) and r["format"] == "mxfp4"
        assert r["time_us"] > 0 and r["one_device_us"] > 0 and r["tokens"] == 4
        assert set(r["spread_pct"]) == ({"split", "one_device"} | ({"no_collectives"} if r["tp"] > 1 else set()))
    one, two = (next(r for r in records if r["tp"] == n and r["mode"] == "expert") for n in (1, 2))
    assert two["device_bytes"] < one["device_bytes"]  # each of 2 devices holds 4 of the 8 experts
    assert "| gpt-oss-20b-tiny | mxfp4 | 4 | 2 | tensor | fp8 |" in (tmp_path / "moe_tp.md").read_text()


@pytest.mark.multidevice
def test_split_options_are_checked(capsys):
    for argv, match in ((["--fp8-collectives"], "--fp8-collectives needs --tp"),
                        (["--tp", "1,99"], "--tp 99: each must lie in 1..8"),
                        (["--tp", "2", "--tp-modes", "data"], "--tp-modes: each of expert, tensor")):
        with pytest.raises(SystemExit):
            bench_cli.main(["moe", "--allow-cpu", *argv])
        assert match in capsys.readouterr().err
