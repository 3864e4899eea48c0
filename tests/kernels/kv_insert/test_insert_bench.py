"""The KV-insert benchmark's plumbing on CPU (the kernel interpreted, timings meaningless) and its CLI."""

import pytest

from jquant.apps import cli
from jquant.bench import device_hbm_bytes_per_s
from jquant.kernels.kv_insert import InsertConfig, bench


def test_run_times_kernels_and_reference_and_checks_their_bits():
    small = InsertConfig(block_tokens=4, num_warps=2)
    records = bench.run(tokens=(8,), kv_dtypes=("int8_per_token_head", "turboquant_3bit_nc"), reps=2,
                        interpret=True, inserts=1, log=lambda s: None, configs=(None, small))
    launch = {"block_tokens": 4, "num_warps": 2}
    assert [(r["kv_dtype"], r["kernel_covers"], r["bit_exact"], r["config"]) for r in records] == [
        ("int8_per_token_head", True, True, None), ("int8_per_token_head", True, True, launch),
        ("turboquant_3bit_nc", False, True, None), ("turboquant_3bit_nc", False, True, launch)]
    r = records[0]
    # 8 tokens x 8 heads x (bf16 K and V read: 512 B + int8 codes and float32 scales written: 264 B).
    assert r["useful_bytes"] == 8 * 8 * (512 + 264) and r["time_us"] > 0 and r["baselines"]["xla"] > 0
    # the floor is at the rate measured on this device, which the record carries
    assert r["hbm_tb_per_s"] == round(device_hbm_bytes_per_s() / 1e12, 3)
    assert r["byte_floor_us"] == pytest.approx(1e6 * r["useful_bytes"] / device_hbm_bytes_per_s())
    table = bench.to_markdown(records)
    assert "| int8_per_token_head | 8 | default |" in table and "| 4/2w |" in table and "(reference)" in table


def test_inserts_per_batch_bounds():
    assert bench.inserts_per_batch(8) == 1000 and bench.inserts_per_batch(32768) == 64
    assert bench.inserts_per_batch(10**7) == 16


def test_cli_checks_options_then_says_no_gpu(capsys, tmp_path, monkeypatch):
    from jquant.schemes import dispatch
    monkeypatch.setattr(dispatch, "is_gpu", lambda: False)   # the no-GPU path, on any machine
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "insert", "--kv-dtypes", "fp4"])
    assert e.value.code == 2 and "unknown kv_cache_dtype 'fp4'" in capsys.readouterr().err
    assert cli.main(["bench", "insert", "--tokens", "8", "--out", str(tmp_path)]) == 1
    assert "no GPU present" in capsys.readouterr().err and not list(tmp_path.iterdir())
