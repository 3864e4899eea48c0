"""The benchmark harness on CPU with tiny shapes (the kernels in interpret mode)."""

import json
import subprocess

import jax.numpy as jnp
import numpy as np
import pytest

import jquant
from jquant.bench import timing
from jquant.bench.timing import source_commit
from jquant.bench import (Timing, array_bytes, copies_for, device_hbm_bytes_per_s, main, roofline, spread_pct,
                          time_fn, time_interleaved, time_steadiest)
from jquant.kernels.w4a16 import bench as bench


def test_time_fn_rotates_inputs_and_reports_per_call_time():
    seen = []

    def fn(a):
        seen.append(a.shape)             # traced once per rotation program
        return a * 2.0

    args = [(jnp.ones((8,)) * i,) for i in range(3)]
    t = time_fn(fn, args, warmup=1, reps=3, calls_per_batch=7)
    assert t.calls_per_batch == 9        # whole rotations of 3 copies
    assert len(t.batches_us) == 3 and t.min_us <= t.median_us and t.min_us > 0
    assert len(seen) == 3                # one trace calls fn on each copy


def test_time_fn_rejects_bad_arguments():
    with pytest.raises(ValueError, match="at least one"):
        time_fn(lambda a: a, [])
    with pytest.raises(ValueError, match="warmup and reps"):
        time_fn(lambda a: a, [(jnp.ones(2),)], reps=0)


def test_time_interleaved_runs_every_candidate_every_round():

    def make(tag):
        def fn(a):
            return a + jnp.float32(tag)
        return fn

    cands = {"a": (make(1), [(jnp.ones(4),)]), "b": (make(2), [(jnp.ones(4),), (jnp.zeros(4),)])}
    t = time_interleaved(cands, warmup=1, reps=4, calls_per_batch=3)
    assert set(t) == {"a", "b"}
    assert len(t["a"].batches_us) == 4 and len(t["b"].batches_us) == 4
    assert t["a"].calls_per_batch == 3 and t["b"].calls_per_batch == 4   # whole rotations
    assert all(v.min_us <= v.median_us for v in t.values())
    with pytest.raises(ValueError, match="'b'"):
        time_interleaved({"a": (make(1), [(jnp.ones(2),)]), "b": (make(1), [])})


def _timing(*batches):
    return Timing(sorted(batches)[len(batches) // 2], min(batches), tuple(batches), 1)


def test_time_steadiest_retimes_a_noisy_cell_and_keeps_the_steadiest_attempt():
    attempts = iter([{"k": _timing(10, 16, 11), "b": _timing(20, 21, 20)},     # 54.5 % spread
                     {"k": _timing(10, 14, 11), "b": _timing(20, 21, 20)},     # 36.4 %
                     {"k": _timing(10, 15, 11), "b": _timing(20, 30, 21)}])    # 47.6 %
    times, spreads = time_steadiest(lambda: next(attempts), max_spread_pct=25, retries=2)
    assert spreads == [54.5, 36.4, 47.6] and times["k"].batches_us == (10, 14, 11)
    steady = iter([{"k": _timing(10, 12, 11)}, {"k": _timing(99, 99, 99)}])
    times, spreads = time_steadiest(lambda: next(steady), max_spread_pct=25, retries=2)
    assert spreads == [18.2] and times["k"].median_us == 11       # steady at once: no retry
    assert spread_pct(_timing(10, 12, 11)) == 18.2
    with pytest.raises(ValueError, match="retries and max_spread_pct must be ≥ 0"):
        time_steadiest(lambda: {}, max_spread_pct=25, retries=-1)


def test_copies_and_roofline():
    # At least 1 GiB per program (the host's dispatch cost), at least twice the L2.
    assert copies_for(117 * 2**20) == 9 and copies_for(117 * 2**20, min_bytes=0) == 2
    assert copies_for(32 * 2**20) == 32 and copies_for(470 * 2**20) == 3
    assert copies_for(2**20) == 64 and copies_for(2**20, max_copies=8) == 8
    r = roofline(30.0, nbytes=int(120e6), flops=2 * 8192 * 28672, hbm_bytes_per_s=4e12)
    assert r.tb_per_s == pytest.approx(4.0)
    assert r.byte_floor_us == pytest.approx(30.0) and r.pct_of_byte_floor == pytest.approx(100.0)
    assert r.tflop_per_s == pytest.approx(2 * 8192 * 28672 / 30e-6 / 1e12)
    with pytest.raises(ValueError, match="positive"):
        roofline(0.0, 1, 1, hbm_bytes_per_s=4e12)
    assert array_bytes({"a": jnp.ones((4, 4), jnp.bfloat16)}, jnp.ones(3)) == 32 + 12


def test_device_hbm_rate_is_measured_once_with_a_probe_for_the_device(monkeypatch):
    from jquant.schemes import dispatch
    probes = []
    monkeypatch.setattr(timing, "measure_hbm_bandwidth", lambda nbytes: probes.append(nbytes) or 3e12)
    try:
        for gpu, nbytes in ((False, 2**22), (True, 2**30)):
            device_hbm_bytes_per_s.cache_clear()
            monkeypatch.setattr(dispatch, "is_gpu", lambda gpu=gpu: gpu)
            assert device_hbm_bytes_per_s() == device_hbm_bytes_per_s() == 3e12
            assert probes.pop() == nbytes and not probes        # one probe a process
    finally:
        device_hbm_bytes_per_s.cache_clear()                    # the fake rate must not reach other tests


def test_w4a16_run_writes_records(tmp_path):
    records = bench.run(shapes=((128, 256),), ms=(1, 16), schemes=("int4_g128", "mxfp4", "nf4"),
                        impls=("auto",), interpret=True, reps=1, log=lambda s: None)
    assert [(r["scheme"], r["M"], r["op"]) for r in records] == [
        ("int4_g128", 1, "w4a16_mgpu"), ("int4_g128", 16, "w4a16_mgpu"), ("mxfp4", 1, "w4a16_mgpu"),
        ("nf4", 1, "w4a16_mgpu")]
    for r in records:
        assert r["time_us"] > 0 and set(r["baselines"]) == {"xla_bf16", "xla_dequant_dot"}
        for key in ("N", "K", "device", "jax_version", "date", "tb_per_s", "tflop_per_s",
                    "speedup_vs_bf16", "pct_of_byte_floor", "config", "commit", "prepared_impl"):
            assert key in r
        assert r["impl"] == "auto" and r["config"] is not None   # the kernel-level A/B path
        assert r["spread_pct"] >= 0 and set(r["baseline_spread_pct"]) == set(r["baselines"])
        assert len(r["attempt_spreads_pct"]) == 1      # interpret mode never re-times
        assert r["hbm_tb_per_s"] == round(device_hbm_bytes_per_s() / 1e12, 3)   # this device's rate
    js, md = bench.write(records, tmp_path)
    assert json.loads(js.read_text()) == records
    assert md.read_text().count("\n| int4_g128 |") == 2
    widest = max(records[0]["spread_pct"], *records[0]["baseline_spread_pct"].values())
    assert md.read_text().splitlines()[6].endswith(f"| {widest} |")


def test_w4a16_sweep_times_each_decode_launch_beside_the_default():
    """--sweep adds one record per valid decode launch (M ≤ 16) of the mgpu impl, each with its own config,
    and none at larger M; every swept launch is a real change of the default that the weight admits."""
    from jquant.kernels.w4a16 import default_mgpu_config, prepack_nk

    packed = prepack_nk(np.zeros((4096, 256), np.int32), np.ones((32, 256), np.float32), group_size=128)
    base = default_mgpu_config(1, packed)
    swept = bench.sweep_configs(1, packed)
    assert len(swept) >= 4 and base not in swept and len(set(swept)) == len(swept)
    for c in swept:
        steps, rem = divmod(packed.k_pad, c.split_k * c.block_k)
        assert rem == 0 and steps >= 2 and packed.n_pad % c.block_n == 0
        assert not c.group_acc or c.block_k % packed.group_size == 0
    assert bench.sweep_configs(64, packed) == []
    records = bench.run(shapes=((128, 1024),), ms=(1, 64), schemes=("int4_g128",), impls=("mgpu",),
                        interpret=True, reps=1, log=lambda s: None, sweep=True)
    m1 = [r for r in records if r["M"] == 1]
    labels = [r["impl"] for r in m1]
    assert labels[0] == "mgpu" and labels[1:] == [f"mgpu#{i}" for i in range(1, len(labels))]
    assert len(labels) > 2 and len({str(r["config"]) for r in m1}) == len(m1)
    assert [r["impl"] for r in records if r["M"] == 64] == ["mgpu"]
    md = bench.to_markdown(records)
    assert "(mgpu#1: " in md and "split-K" in md


def test_w4a16_cells_time_what_users_run(monkeypatch):
    """By default a cell's candidate is scheme.apply on a weight from get_scheme → quantize_weight
    → process_weights_after_loading, and its record says which impl prepared it."""
    seen = {"quantize_weight": [], "process_weights_after_loading": [], "apply": []}
    for method in seen:
        original = getattr(jquant.Scheme, method)

        def spy(self, *a, _m=method, _f=original, **kw):
            seen[_m].append(self.name)
            return _f(self, *a, **kw)
        monkeypatch.setattr(jquant.Scheme, method, spy)
    monkeypatch.setenv("JQUANT_COMMIT", "abc123")
    records = bench.run(shapes=((128, 256),), ms=(1, 16), schemes=("int4_g128", "nvfp4"),
                        interpret=True, reps=1, log=lambda s: None)
    assert [(r["scheme"], r["M"], r["impl"]) for r in records] == [
        ("int4_g128", 1, "scheme"), ("int4_g128", 16, "scheme"), ("nvfp4", 1, "scheme")]
    for method, names in seen.items():
        assert set(names) == {"int4_g128", "nvfp4"}, method
    want = jquant.get_scheme("int4_g128").process_weights_after_loading(
        jquant.get_scheme("int4_g128").quantize_weight(jnp.zeros((128, 256), jnp.bfloat16))).impl
    for r in records:
        assert r["prepared_impl"] == want          # the impl this device prepares weights for
        assert r["op"] == ("w4a16_mgpu" if want == "pallas_w4a16" and r["M"] <= 128 else want)
        assert r["commit"] == source_commit() and r["commit"] != ""
        assert r["time_us"] > 0 and set(r["baselines"]) == {"xla_bf16", "xla_dequant_dot"}
    with pytest.raises(ValueError, match="impls \\['nope'\\] unknown"):
        bench.run(shapes=((128, 256),), ms=(1,), impls=("nope",), interpret=True, log=lambda s: None)


def test_source_commit_prefers_the_environment_over_a_stale_git(tmp_path, monkeypatch):
    """A benchmark machine's copy of the tree may carry an old .git: $JQUANT_COMMIT, when set, wins."""
    monkeypatch.delenv("JQUANT_COMMIT", raising=False)
    assert source_commit(tmp_path) == "unknown"            # a copy without .git, nothing set
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(git + ["init", "-q"], check=True)
    subprocess.run(git + ["commit", "-q", "--allow-empty", "-m", "x"], check=True)
    head = subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    assert source_commit(tmp_path) == head                 # a checkout: its HEAD
    monkeypatch.setenv("JQUANT_COMMIT", "deadbeef")
    assert source_commit(tmp_path) == "deadbeef"          # the variable names the code actually measured


def test_cli_main(tmp_path):
    rc = main(["w4a16", "--out", str(tmp_path), "--shapes", "64x128", "--ms", "1",
               "--schemes", "int4_g128", "--interpret", "--reps", "1"])
    assert rc == 0 and (tmp_path / "w4a16.json").exists() and (tmp_path / "w4a16.md").exists()
    with pytest.raises(SystemExit):
        main(["w4a16", "--shapes", "64by128"])
    for bad in (["--schemes", "int4_g128,nope"], ["--impls", "scheme,fast"]):
        with pytest.raises(SystemExit):
            main(["w4a16", "--interpret", *bad])


def test_gptq_layer_bench_runs_the_plumbing_on_cpu(tmp_path, capsys):
    import json
    from jquant.apps import bench as bench_cli
    assert bench_cli.main(["gptq", "--shrink", "16", "--rows", "4", "--seq-len", "32", "--batch-rows", "2",
                           "--allow-cpu", "--out", str(tmp_path)]) == 0
    (record,) = json.loads((tmp_path / "gptq.json").read_text())
    assert record["shapes"]["down_proj"] == [896, 256] and set(record["per_projection_s"]) == {
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert record["total_s"] > 0 and "device" in record and "commit" in record
    markdown = (tmp_path / "gptq.md").read_text()
    assert "| int4_g128 | True | 4 × 32 |" in markdown and "7 projections, every dimension shrunk 16×" in markdown
    import pytest
    with pytest.raises(SystemExit):
        bench_cli.main(["gptq", "--shrink", "3"])


def test_gptq_markdown_names_no_shrink_for_the_full_layer():
    from jquant.algorithms import bench

    record = dict(scheme="int4_g128", act_order=True, rows=128, seq_len=2048, hessian_s=1.0, gptq_s=2.0,
                  total_s=3.0, per_projection_s={"q_proj": 0.5}, shapes=bench.PROJECTIONS)
    assert "shrunk" not in bench.to_markdown([record])


@pytest.mark.parametrize("argv", [["--rows", "4"], ["--rows", "12", "--batch-rows", "8"], ["--batch-rows", "0"]])
def test_gptq_bench_refuses_rows_that_are_not_whole_batches(argv, capsys):
    from jquant.apps import bench as bench_cli

    with pytest.raises(SystemExit) as e:
        bench_cli.main(["gptq", "--allow-cpu", *argv])
    assert e.value.code == 2 and "--rows must be a positive multiple of --batch-rows" in capsys.readouterr().err


def test_records_go_to_a_folder_named_for_the_device(monkeypatch):
    """``--out`` defaults to bench/results/<device>: cpu here, h100 / h200 on those GPUs, so CPU plumbing
    runs never write into the GPU tables of record."""
    from jquant.apps import bench as cli
    from jquant.schemes import dispatch

    assert cli.default_out() == "bench/results/cpu"
    assert cli.build_parser().parse_args(["decode"]).out is None
    monkeypatch.setattr(dispatch, "is_gpu", lambda device=None: True)
    for kind, folder in (("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200")):
        monkeypatch.setattr(dispatch, "device_kind", lambda device=None, kind=kind: kind)
        assert cli.default_out() == f"bench/results/{folder}"
