import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jquant.apps.ledger import (NotApplicable, format_table, kv_cache_bytes, scheme_ledger, serving_ledger,
                           weight_ledger)
from jquant.flax import quantize_params


def _params():
    k = jax.random.split(jax.random.key(0), 3)
    return {"embed": {"embedding": jax.random.normal(k[0], (100, 256))},
            "mlp": {"kernel": jax.random.normal(k[1], (256, 512)), "bias": jnp.zeros(512) + 0.5},
            "out": {"kernel": jax.random.normal(k[2], (512, 256))}}


def test_float_params_are_all_float_bytes():
    led = weight_ledger(_params())
    assert led.codes == led.metadata == 0
    assert led.float_params == 4 * (100 * 256 + 256 * 512 + 512 + 512 * 256)


def test_an_unquantized_row_shows_its_float_bits_per_weight():
    params = _params()
    kw = dict(num_layers=1, num_kv_heads=1, head_dim=64, batch=1, context=16)
    half = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    q, _ = quantize_params(params, "int4_g128", prepare=False)
    assert weight_ledger(params).bits_per_weight == 32 and weight_ledger(half).bits_per_weight == 16
    assert weight_ledger(q).bits_per_weight == weight_ledger(q).bits_per_quantized_weight
    table = format_table([serving_ledger("float32", params, **kw), serving_ledger("int4", q, **kw)])
    float_row, int4_row = table.splitlines()[2:]
    assert float_row.split()[-1] == "32.00" and int4_row.split()[-1] == f"{4 + 16 / 128:.2f}"


def test_quantized_ledger_matches_the_pytree_bytes():
    q, _ = quantize_params(_params(), "int4_g128", prepare=False)
    led = weight_ledger(q)
    # int4 codes: half a byte per weight; scales: one fp16 per 128 weights (GPTQ-layout scheme).
    n_q = 256 * 512 * 2
    assert led.codes == n_q // 2 and led.quantized_params == n_q
    assert led.metadata == n_q // 128 * 2
    assert led.float_params == 4 * (100 * 256 + 512)
    leaves = jax.tree_util.tree_leaves(q)
    assert led.total == sum(l.size * l.dtype.itemsize for l in leaves)
    assert led.bits_per_quantized_weight == pytest.approx(4 + 16 / 128)


def test_double_quant_metadata_is_counted():
    q, _ = quantize_params(_params(), "nf4_dq", prepare=False)
    plain, _ = quantize_params(_params(), "nf4", prepare=False)
    assert weight_ledger(q).metadata < weight_ledger(plain).metadata
    assert weight_ledger(q).total == sum(l.size * l.dtype.itemsize for l in jax.tree_util.tree_leaves(q))


def test_kv_cache_arithmetic():
    # SmolLM2-135M: 30 layers, 3 KV heads of 64; 8 sequences × 4096 tokens in bf16 = 2·30·8·4096·3·64·2 bytes.
    assert kv_cache_bytes(num_layers=30, num_kv_heads=3, head_dim=64, batch=8, context=4096) == 754974720
    fp8 = kv_cache_bytes(num_layers=30, num_kv_heads=3, head_dim=64, batch=8, context=4096,
                         kv_dtype="fp8_per_token_head")
    assert fp8 == 2 * 30 * 8 * 4096 * 3 * (64 + 4)


def test_concurrency_is_what_is_left_after_weights():
    params = _params()
    q, _ = quantize_params(params, "int4_g128", prepare=False)
    kw = dict(num_layers=2, num_kv_heads=2, head_dim=64, batch=4, context=1024)
    base, quant = serving_ledger("bf16", params, **kw), serving_ledger("int4", q, **kw)
    budget = base.weights.total + 10 * base.kv_per_sequence
    assert base.max_sequences(budget) == 10
    saved = base.weights.total - quant.weights.total
    assert quant.max_sequences(budget) == 10 + saved // base.kv_per_sequence
    table = format_table([base, quant], budget)
    assert "int4" in table and "max seqs" in table


@pytest.mark.parametrize("kw, match", [
    (dict(kv_dtype="int3"), "kv_dtype"),
    (dict(batch=0), "batch"),
    (dict(context=-1), "context"),
])
def test_bad_kv_arguments(kw, match):
    args = dict(num_layers=2, num_kv_heads=2, head_dim=64, batch=1, context=16) | kw
    with pytest.raises(ValueError, match=match):
        kv_cache_bytes(**args)


def test_a_scheme_that_does_not_fit_is_a_row_with_its_reason():
    params = {"mlp": {"kernel": jnp.ones((96, 64))}, "out": {"kernel": jnp.ones((64, 128))}}
    kw = dict(num_layers=1, num_kv_heads=1, head_dim=64, batch=1, context=16)
    row = scheme_ledger("int4_g128", params, r".*kernel", **kw)
    assert row == NotApplicable("int4_g128", row.reason)
    assert row.reason.startswith("parameter 'mlp/kernel' (shape (96, 64)) cannot be quantized with scheme "
                                 "'int4_g128'") and "not divisible by group_size 128" in row.reason
    assert row.reason.endswith("[out, in] = (64, 96), in groups along the input dimension 96)")
    fits = scheme_ledger("int8_ch", params, r".*kernel", **kw)
    assert fits.weights.quantized_params == 96 * 64 + 64 * 128
    lines = format_table([serving_ledger("f32", params, **kw), row, fits], 2**20).splitlines()
    assert lines[3] == f"{'int4_g128':<24}n/a: {row.reason}" and lines[4].startswith("int8_ch ")


def test_ratio_is_a_dash_when_no_baseline_sequence_fits():
    params = _params()
    kw = dict(num_layers=2, num_kv_heads=2, head_dim=64, batch=4, context=1024)
    base = serving_ledger("f32", params, **kw)
    table = format_table([base, base], base.weights.total // 2)
    assert "nan" not in table and table.splitlines()[-1].endswith(f"{0:>10d}{'-':>9}")


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8", "int8_per_token_head", "turboquant_k3v4_nc",
                                      "turboquant_3bit_nc"])
def test_kv_bytes_are_what_the_cache_allocates(kv_dtype):
    from jquant.kv import PagedCache
    kw = dict(num_layers=5, kv_heads=2, head_dim=32, batch=3, max_len=40, page_size=16)
    cache = jax.eval_shape(lambda: PagedCache.allocate(kv_dtype, **kw))
    per_token = [a for layer in cache.layers for a in jax.tree.leaves(layer) if a.ndim >= 3]
    allocated = sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in per_token)
    assert kv_cache_bytes(num_layers=5, num_kv_heads=2, head_dim=32, batch=3, context=40,
                          kv_dtype=kv_dtype) == allocated
