"""The decode and attention benchmarks' plumbing on CPU (their timings mean nothing here)."""

import numpy as np

from jquant.kernels.decode_attention import bench as attention_bench
from jquant.kv.cache import PagedCache
from jquant.models import decode_bench
from jquant.models.llama import LlamaConfig, LlamaForCausalLM


def tiny(num_layers, max_len):
    return LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=128, num_layers=num_layers,
                       num_heads=4, num_kv_heads=2, head_dim=32, rope_theta=1e4, rms_norm_eps=1e-5,
                       max_position_embeddings=max_len)


def test_decode_bench_records_every_cell_with_its_floor():
    recs = decode_bench.run(num_layers=2, batches=(2,), ctxs=(40,), schemes=("bf16", "int8_ch"),
                            kv_dtypes=("bf16", "fp8_per_token_head"), reps=1, shape=tiny,
                            meta={"device": "cpu", "commit": "x"}, log=lambda s: None)
    cells = {(r["scheme"], r["kv_dtype"]) for r in recs}
    assert cells == {("bf16", "dense"), ("bf16", "bf16"), ("bf16", "fp8_per_token_head"), ("int8_ch", "bf16"),
                     ("int8_ch", "fp8_per_token_head")}
    for r in recs:
        assert r["time_us"] > 0 and r["byte_floor_us"] > 0 and r["commit"] == "x"
        assert r["baselines"]["bf16_weights_bf16_kv"] > 0
    by = {(r["scheme"], r["kv_dtype"]): r for r in recs}
    # int8 weights and fp8 pages read fewer bytes than bf16 ones.
    assert by[("int8_ch", "fp8_per_token_head")]["step_bytes"] < by[("int8_ch", "bf16")]["step_bytes"] \
        < by[("bf16", "bf16")]["step_bytes"]
    assert "| int8_ch | fp8_per_token_head | 2 | 40 |" in decode_bench.to_markdown(recs)


def test_in_loop_cells_and_a_cache_that_does_not_fit(monkeypatch):
    """``in_loop`` adds the loop's time to every cell; a cache that cannot be allocated fails its cell only."""
    filled = decode_bench.filled_cache

    def no_dense(model, kv, *a):
        if kv is None:
            raise MemoryError("RESOURCE_EXHAUSTED: the dense cache")
        return filled(model, kv, *a)
    monkeypatch.setattr(decode_bench, "filled_cache", no_dense)
    logged = []
    recs = decode_bench.run(num_layers=1, batches=(1,), ctxs=(24,), schemes=("int8_ch",), kv_dtypes=("bf16",),
                            reps=1, shape=tiny, log=logged.append, in_loop=True)
    assert {(r["scheme"], r["kv_dtype"]) for r in recs} == {("bf16", "bf16"), ("int8_ch", "bf16")}
    assert any("FAILED bf16 kv=dense" in line for line in logged)
    for r in recs:
        assert r["loop_time_us"] > 0 and r["loop_speedup_vs_bf16"] > 0
    assert "in-loop µs" in decode_bench.to_markdown(recs)


def test_greedy_loop_is_steps_fed_their_argmax():
    """The in-loop timing runs what ``generate`` runs: each step's argmax is the next step's token."""
    import functools
    import jax
    import jax.numpy as jnp
    from jquant.models.llama import decode_step
    model = LlamaForCausalLM(tiny(2, 64))
    params = {"params": decode_bench.random_bf16_params(model, jax.random.key(3))}
    step = functools.partial(decode_step, model)
    token = jnp.asarray([[5], [9]], jnp.int32)
    cache = decode_bench.filled_cache(model, "bf16", 2, 20, 64, jax.random.key(1))
    want, by_hand = None, decode_bench.filled_cache(model, "bf16", 2, 20, 64, jax.random.key(1))
    t = token
    for _ in range(3):
        want, by_hand = step(params, t, by_hand)
        t = jnp.argmax(want[:, -1], axis=-1).astype(jnp.int32)[:, None]
    got, cache = decode_bench._greedy_loop(step, 3)(params, token, cache)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=1e-2, atol=1e-2)
    np.testing.assert_array_equal(np.asarray(cache.lengths), [23, 23])


def test_filled_cache_holds_ctx_random_tokens():
    import jax
    model = LlamaForCausalLM(tiny(2, 64))
    cache = decode_bench.filled_cache(model, "int8_per_token_head", 3, 20, 64, jax.random.key(1))
    assert isinstance(cache, PagedCache)
    np.testing.assert_array_equal(np.asarray(cache.lengths), [20, 20, 20])
    pages = np.asarray(cache.layers[0].k_pages)
    assert (pages != 0).mean() > 0.9 and np.asarray(cache.layers[0].k_scale).min() > 0


def test_attention_bench_plumbing():
    recs = attention_bench.run(batches=(2,), ctxs=(64,), kv_dtypes=("bf16", "int8_per_token_head",
                                                                     "turboquant_3bit_nc"),
                               reps=1, interpret=True, meta={"device": "cpu"}, log=lambda s: None)
    assert [r["kv_dtype"] for r in recs] == ["bf16", "int8_per_token_head", "turboquant_3bit_nc"]
    assert recs[0]["kv_bytes"] == 2 * 64 * 8 * 512
    assert recs[2]["kv_bytes"] == 2 * 64 * 8 * 102
    assert all(r["time_us"] > 0 and "xla" in r["baselines"] for r in recs)
    assert "| turboquant_3bit_nc | 2 | 64 |" in attention_bench.to_markdown(recs)


def test_attention_floor_is_at_the_rate_given_and_recorded():
    recs = attention_bench.run(batches=(2,), ctxs=(64,), kv_dtypes=("bf16",), reps=1, interpret=True,
                               hbm_bytes_per_s=2e12, meta={"device": "cpu"}, log=lambda s: None)
    assert recs[0]["hbm_tb_per_s"] == 2.0
    assert recs[0]["byte_floor_us"] == round(1e6 * recs[0]["kv_bytes"] / 2e12, 2)


def test_attention_sweep_rows_name_their_launch():
    from jquant.kernels.decode_attention import TuningConfig
    configs = (None, TuningConfig(block_tokens=64, kv_heads_per_program=2),
               TuningConfig(block_tokens=32, operand_dtype="float16"))
    recs = attention_bench.run(batches=(2,), ctxs=(64,), kv_dtypes=("bf16", "turboquant_3bit_nc"), reps=1,
                               interpret=True, meta={"device": "cpu"}, log=lambda s: None, configs=configs)
    # several KV heads a program and an operand dtype are launches of the non-TurboQuant kernel only
    assert [(r["kv_dtype"], r["config"] and r["config"]["kv_heads_per_program"]) for r in recs] == \
        [("bf16", None), ("bf16", 2), ("bf16", 1), ("turboquant_3bit_nc", None)]
    table = attention_bench.to_markdown(recs)
    assert "| bf16 | 2 | 64 | default |" in table and "| bf16 | 2 | 64 | 64 tok, 2 heads |" in table
    assert "| bf16 | 2 | 64 | 32 tok, 1 heads, float16 |" in table
    recs[1]["config"]["num_stages"] = 3
    assert "| bf16 | 2 | 64 | 64 tok, 2 heads, 3 stages |" in attention_bench.to_markdown(recs)
