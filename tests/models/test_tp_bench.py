"""``jquant bench decode --tp``: the tensor-parallel decode benchmark's plumbing on CPU (8 simulated devices;
its timings mean nothing here)."""

import json

import pytest

from jquant.apps import cli

pytestmark = pytest.mark.multidevice   # tensor parallelism over the 8 simulated devices


def _exit_code(argv, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    return e.value.code, capsys.readouterr()


def test_bench_decode_tp_writes_records_with_the_collectives_broken_out(tmp_path, capsys):
    rc = cli.main(["bench", "decode", "--tp", "1,2", "--fp8-collectives", "--allow-cpu", "--shrink", "8",
                   "--layers", "1", "--batches", "2", "--ctxs", "32", "--schemes", "int4_g128", "--kv-dtypes", "fp8",
                   "--reps", "1", "--out", str(tmp_path)])
    assert rc == 0 and "decode_tp.json" in capsys.readouterr().out
    records = json.loads((tmp_path / "decode_tp.json").read_text())
    cells = {(r["tp"], r["collectives"]): r for r in records}
    assert set(cells) == {(1, "psum"), (2, "psum"), (2, "fp8")}
    for r in records:
        assert r["op"] == "decode_step" and r["scheme"] == "int4_g128" and r["kv_dtype"] == "fp8"
        assert r["time_us"] > 0 and r["no_collectives_us"] > 0 and "device" in r and "commit" in r
        assert r["collective_us"] == pytest.approx(r["time_us"] - r["no_collectives_us"], abs=0.2)
        assert r["baselines"]["tp1_us"] == cells[(1, "psum")]["time_us"]
    assert cells[(1, "psum")]["collective_us"] == 0  # one device: nothing exchanged
    # Each of two devices holds half of every projection, every KV head pair's pages: fewer bytes than one.
    assert cells[(2, "psum")]["device_bytes"] < 0.6 * cells[(1, "psum")]["device_bytes"]
    assert cells[(2, "fp8")]["baselines"]["psum_us"] == cells[(2, "psum")]["time_us"]
    table = (tmp_path / "decode_tp.md").read_text()
    assert "| int4_g128 | fp8 | 2 | 32 | 2 | fp8 |" in table and "collectives µs" in table


@pytest.mark.parametrize("argv, match", [
    (["--tp", "1,16"], "--tp 16: each must lie in 1..8"),
    (["--tp", "0"], "--tp 0: each must lie in 1..8"),
    (["--fp8-collectives"], "--fp8-collectives needs --tp"),
    (["--shrink", "3"], "--shrink must be 1, 2, 4 or 8"),
])
def test_bench_decode_tp_rejects_bad_options(argv, match, capsys, tmp_path):
    code, out = _exit_code(["bench", "decode", *argv, "--out", str(tmp_path)], capsys)
    assert code == 2 and match in out.err
    assert not list(tmp_path.iterdir())
