"""The ``jquant`` command: help, version, argument checks, and rows for schemes that do not fit a model.

``demo`` and ``ledger`` run on a one-layer Llama whose hidden size (64) no group of 128 divides, put in
place of the SmolLM2 loader, so a scheme that fits no kernel shows up in seconds.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jquant.apps.data
import jquant.models
from jquant.apps import cli
from jquant.models import LlamaConfig, LlamaForCausalLM

TINY = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=2,
                   num_kv_heads=1, head_dim=32, rope_theta=10000.0, rms_norm_eps=1e-5,
                   max_position_embeddings=64)


class _Tokenizer:
    eos_id = 0

    def encode(self, text):
        return [1 + ord(c) % 63 for c in text]

    def decode(self, ids):
        return "".join(chr(65 + i % 26) for i in ids)


@functools.cache
def _tiny_variables():
    ids = jnp.asarray(np.random.default_rng(0).integers(1, TINY.vocab_size, (2, 16)), jnp.int32)
    return ids, jax.jit(LlamaForCausalLM(TINY).init)(jax.random.key(0), ids)


def _int4_g128_error(params) -> str:
    from jquant.checkpoint.hf_checkpoint import PROJECTIONS
    from jquant.flax import quantize_params

    with pytest.raises(ValueError) as e:
        quantize_params(params, [(PROJECTIONS, "int4_g128")], prepare=False)
    return str(e.value)


@pytest.fixture
def tiny_model(monkeypatch):
    ids, variables = _tiny_variables()
    monkeypatch.setattr(jquant.models, "smollm2_path", lambda: "tiny.gguf")
    monkeypatch.setattr(jquant.models, "load_gguf", lambda path: (TINY, variables, {}))
    monkeypatch.setattr(jquant.models, "build_tokenizer", lambda meta: _Tokenizer())
    monkeypatch.setattr(jquant.apps.data, "eval_batches", lambda tok, seq_len, num_seqs: np.asarray(ids))


def _exit_code(argv, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    return e.value.code, capsys.readouterr()


def test_help_lists_the_commands_and_exits_0(capsys):
    code, out = _exit_code(["--help"], capsys)
    assert code == 0 and all(name in out.out for name in ("demo", "bench", "ledger"))


def test_help_texts_say_what_the_commands_and_options_do(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "400")   # argparse wraps no phrase checked here
    out = _exit_code(["--help"], capsys)[1].out
    bench = next(line for line in out.splitlines() if line.strip().startswith("bench "))
    assert all(name in bench for name in ("w4a16", "gemm8", "attention", "insert", "decode", "gptq", "moe"))
    assert "--interpret (w4a16, gemm8), --allow-cpu (decode, gptq, moe)" in bench and "needs a GPU" not in bench
    out = _exit_code(["demo", "--help"], capsys)[1].out
    assert "--kv-seq-len-token" not in out and "on 2 rows of --kv-seq-len tokens" in out
    assert all(f"(default {n})" in out for n in (512, 40, 1024))   # --seq-len, --max-new-tokens, --kv-seq-len
    assert "none: no quantized scheme, so only the float32 row of the weight table" in out
    out = _exit_code(["ledger", "--help"], capsys)[1].out
    assert all(text in out for text in ("(default int8_ch,fp8_e4m3_channel,", "KV cache holds (default 8)",
                                        "(default 8192)", "(default bf16)", "(default 1024.0)"))
    out = _exit_code(["bench", "w4a16", "--help"], capsys)[1].out
    assert "add --impls scheme,mgpu to include the Pallas kernel" in out
    out = _exit_code(["bench", "gemm8", "--help"], capsys)[1].out
    assert "the forced kernel (the mgpu rows) in interpret mode" in out


def test_version(capsys):
    from importlib.metadata import version

    code, out = _exit_code(["--version"], capsys)
    assert code == 0 and out.out.strip() == f"jquant {version('jquant')}"


@pytest.mark.parametrize("argv", [[], ["bogus"], ["--quiet", "demo"]])
def test_no_or_unknown_command_is_a_usage_error(argv, capsys):
    code, out = _exit_code(argv, capsys)
    assert code == 2 and "usage: jquant" in out.err


def test_bench_calls_itself_jquant_bench(capsys):
    code, out = _exit_code(["bench", "--help"], capsys)
    assert code == 0 and out.out.startswith("usage: jquant bench ") and "python -m" not in out.out
    code, out = _exit_code(["bench", "w4a16", "--shapes", "64by128"], capsys)
    assert code == 2 and "jquant bench w4a16: error: argument --shapes" in out.err
    code, out = _exit_code(["bench", "w4a16", "--schemes", "int4"], capsys)
    assert code == 2 and "jquant bench" in out.err and "int4_g128" in out.err


def test_bench_without_a_gpu_says_so(capsys, tmp_path):
    assert jax.default_backend() == "cpu"   # conftest: the tests run on CPU
    rc = cli.main(["bench", "w4a16", "--out", str(tmp_path), "--shapes", "64x128", "--ms", "1"])
    err = capsys.readouterr().err
    assert rc == 1 and "no GPU present" in err and "--interpret" in err
    assert not list(tmp_path.iterdir())


def test_demo_rejects_unknown_schemes_before_any_work(monkeypatch, capsys):
    def no_loading(path):
        raise AssertionError("loaded the model before checking --schemes")

    monkeypatch.setattr(jquant.models, "load_gguf", no_loading)
    code, out = _exit_code(["demo", "--schemes", "int8_ch,bogus"], capsys)
    assert code == 2 and "'bogus'" in out.err and "int4_g128" in out.err   # names the valid ones


def test_demo_prints_the_full_reason_of_a_scheme_that_does_not_fit(tiny_model, capsys):
    rc = cli.main(["demo", "--schemes", "int4_g128", "--seq-len", "16", "--num-seqs", "2"])
    lines = capsys.readouterr().out.splitlines()
    assert rc == 0
    reason = _int4_g128_error(_tiny_variables()[1]["params"])
    assert "is not divisible by group_size 128" in reason and len(reason) > 90
    assert f"{'int4_g128':<28}n/a: {reason}" in lines


def test_ledger_shows_a_scheme_that_does_not_fit_as_na(tiny_model, capsys):
    rc = cli.main(["ledger", "--schemes", "int4_g128,int8_ch", "--context", "64", "--budget-mib", "1"])
    lines = capsys.readouterr().out.splitlines()
    assert rc == 0
    assert f"{'int4_g128':<24}n/a: {_int4_g128_error(_tiny_variables()[1]['params'])}" in lines
    int8 = next(line for line in lines if line.startswith("int8_ch")).split()
    assert len(int8) == 10 and 8 < float(int8[7]) < 9   # a full row: bits/w of int8 codes + scales


@pytest.mark.parametrize("argv, match", [
    (["--budget-mib", "-1"], "argument --budget-mib: must be a positive float"),
    (["--budget-mib", "nan"], "argument --budget-mib: must be a positive float"),
    (["--context", "0"], "argument --context: must be a positive int"),
    (["--batch", "-3"], "argument --batch: must be a positive int"),
    (["--schemes", "int8_ch,int3"], "unknown schemes ['int3']"),
])
def test_ledger_rejects_bad_arguments(argv, match, monkeypatch, capsys):
    monkeypatch.setattr(jquant.models, "load_gguf", lambda path: pytest.fail("loaded the model"))
    code, out = _exit_code(["ledger", *argv], capsys)
    assert code == 2 and match in out.err


def test_model_benches_check_their_options_then_say_no_gpu(capsys, tmp_path):
    code, out = _exit_code(["bench", "decode", "--kv-dtypes", "fp4"], capsys)
    assert code == 2 and "unknown kv_cache_dtype 'fp4'" in out.err
    code, out = _exit_code(["bench", "decode", "--schemes", "int3"], capsys)
    assert code == 2 and "int4_g128" in out.err
    for bench in ("decode", "attention"):
        rc = cli.main(["bench", bench, "--out", str(tmp_path)])
        assert rc == 1 and "no GPU present" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_demo_kv_table(tiny_model, capsys):
    rc = cli.main(["demo", "--schemes", "none", "--kv-cache-dtypes", "int8_per_token_head,fp8",
                   "--seq-len", "16", "--num-seqs", "2", "--max-new-tokens", "2"])
    out = capsys.readouterr().out
    assert rc == 0
    # --schemes none, as its help says: the weight table keeps its float32 row, with no scheme under it.
    weights = out.split("\n\n")[0].splitlines()
    assert weights[-1].startswith("float32 (unquantized)") and weights[-2].startswith("-")
    rows = {line.split(" | ")[0].strip("| "): line for line in out.splitlines() if line.startswith("| ")}
    assert set(rows) >= {"bf16", "int8_per_token_head", "fp8_e4m3"}
    # One layer of one KV head of 32: bf16 128 bytes a token, int8 + a float32 scale per token-head 72.
    assert "| bf16 | 128 | 1.00× |" in rows["bf16"] and "| +0.000 | 100.0% | 100.0% |" in rows["bf16"]
    assert "| int8_per_token_head | 72 | 1.78× |" in rows["int8_per_token_head"]
    # Two PPLs of the same float model, on rows of different lengths: each table says its rows.
    assert "in 2 rows of 16," in out and "2 rows of 1024 (rows of 1024, not 16 as above" in out


def test_demo_rejects_unknown_kv_dtypes_before_any_work(monkeypatch, capsys):
    monkeypatch.setattr(jquant.models, "load_gguf", lambda path: (_ for _ in ()).throw(AssertionError("loaded")))
    code, out = _exit_code(["demo", "--kv-cache-dtypes", "fp8,fp4"], capsys)
    assert code == 2 and "unknown kv_cache_dtype 'fp4'" in out.err and "turboquant_3bit_nc" in out.err


def test_calibrate_refuses_bad_options_before_loading_anything(capsys):
    import pytest
    from jquant.apps import cli
    for argv, message in ((["calibrate", "--group-size", "0"], "--group-size"),
                          (["calibrate", "--method", "rtn", "--act-order"], "GPTQ option"),
                          (["calibrate", "--bits", "5"], "invalid choice"),
                          (["calibrate", "--method", "awq", "--rotate", "32"], "--rotate goes with"),
                          (["calibrate", "--rotate", "48"], "invalid choice"),
                          (["calibrate", "--scheme", "int5_nope"], "int5_nope"),
                          (["calibrate", "--scheme", "mxfp4", "--out", "x"], "--out: no dense checkpoint layout"),
                          (["calibrate", "--scheme", "fp8_e4m3_tensor", "--out", "x"], "write fp8_e4m3_channel"),
                          (["calibrate", "--rotate", "32", "--out", "x"], "no online rotation"),
                          (["calibrate", "--method", "awq", "--asym", "--group-size", "-1"], "need a group size"),
                          # These two were tracebacks after the model had loaded.
                          (["calibrate", "--scheme", "fp8_e4m3_channel"], "use --method rtn, awq or smoothquant"),
                          (["calibrate", "--method", "smoothquant", "--alpha", "5"], "--alpha must be in [0, 1]")):
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        assert e.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--group-size", "128"], "--group-size 128 does not divide the input size K of these weights: "
                              "K = 64 (gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj); use a group size "
                              "dividing every K (64, 128), e.g. --group-size 64 or -1"),
    (["--group-size", "48"], "K = 64 (gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj); K = 128 (down_proj); "
                             "use a group size dividing every K (64, 128), e.g. --group-size 32 or -1"),
    (["--method", "awq", "--asym", "--group-size", "128"], "e.g. --group-size 64\n"),   # AWQ refuses -1
    (["--scheme", "int4_g128"], "--scheme int4_g128 (groups of 128) does not divide"),
    # --method rtn: GPTQ (the default) does not take FP8 schemes, a usage error found first.
    (["--scheme", "fp8_e4m3_block128x128", "--method", "rtn"],
     "cannot be quantized with scheme 'fp8_e4m3_block128x128'"),
])
def test_calibrate_refuses_a_group_that_does_not_divide_k_before_reading_text(argv, message, tiny_model,
                                                                                monkeypatch, capsys):
    monkeypatch.setattr(jquant.apps.data, "britannica_text", lambda: pytest.fail("read the text"))
    code, out = _exit_code(["calibrate", *argv], capsys)
    assert code == 2 and message in out.err and "Traceback" not in out.err


@pytest.mark.parametrize("argv, method", [(["--scheme", "nvfp4"], "compressed-tensors"),
                                          (["--scheme", "int8_ch", "--method", "gptq", "--act-order"],
                                           "compressed-tensors"),
                                          (["--scheme", "int4_g32", "--method", "gptq", "--act-order"], "gptq"),
                                          (["--scheme", "fp8_e4m3_channel", "--method", "smoothquant"],
                                           "compressed-tensors")])
def test_calibrate_writes_a_checkpoint_of_the_scheme_that_loads_back(argv, method, tiny_model, tmp_path, capsys):
    import json

    from jquant import scheme_from_config
    from jquant.checkpoint.hf_checkpoint import load_hf_checkpoint
    from jquant.flax import QParam

    argv = ["--method", "rtn", *argv] if "--method" not in argv else argv
    rc = cli.main(["calibrate", *argv, "--out", str(tmp_path), "--seq-len", "16", "--calib-rows", "2",
                   "--eval-tokens", "32", "--calib-offset", "64"])
    assert rc == 0 and f"wrote {tmp_path}" in capsys.readouterr().out
    config = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    scheme = scheme_from_config(config)
    assert config["quant_method"] == method and scheme.name == argv[argv.index("--scheme") + 1]
    assert config.get("desc_act", "--act-order" in argv) == ("--act-order" in argv)
    loaded = load_hf_checkpoint(tmp_path, _tiny_variables()[1]["params"], prepare=False)
    quantized = [x for x in jax.tree.leaves(loaded, is_leaf=lambda x: isinstance(x, QParam)) if isinstance(x, QParam)]
    assert len(quantized) == 7 * TINY.num_layers
