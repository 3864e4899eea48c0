"""Flax integration: quantize_params by path rules on linen params and NNX models."""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jquant.flax import QLinear, QParam, quantize_nnx, quantize_params, quantized_apply


class TinyLM(nn.Module):
    @nn.compact
    def __call__(self, ids):
        x = nn.Embed(64, 128, name="embed")(ids)
        x = nn.LayerNorm(name="norm")(x)
        h = nn.gelu(nn.Dense(256, name="up_proj")(x))
        x = x + nn.Dense(128, name="down_proj")(h)
        return nn.Dense(64, use_bias=False, name="head")(x)


def _linen():
    model = TinyLM()
    ids = jax.random.randint(jax.random.key(0), (2, 7), 0, 64)
    params = model.init(jax.random.key(1), ids)["params"]
    return model, params, ids


def _rel_err(a, b):
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def test_linen_rules_first_match_wins_and_defaults_skip():
    model, params, ids = _linen()
    rules = [(r".*head/kernel", None), (r".*up_proj/kernel", "int4_g128"), (r".*_proj/kernel", "int8_ch")]
    qparams, report = quantize_params(params, rules)
    assert report.quantized == {"up_proj/kernel": "int4_g128", "down_proj/kernel": "int8_ch"}
    assert report.kept == ("head/kernel",) and report.unused_rules == ()
    assert isinstance(qparams["up_proj"]["kernel"], QParam)
    assert not isinstance(qparams["embed"]["embedding"], QParam)  # embeddings, norms, biases stay float
    assert qparams["up_proj"]["bias"] is params["up_proj"]["bias"]
    ref = model.apply({"params": params}, ids)
    out = jax.jit(lambda p, i: quantized_apply(model, {"params": p}, i))(qparams, ids)
    assert out.shape == ref.shape and _rel_err(out, ref) < 0.1  # int4 on a 128-wide K: ~5%
    deq = jax.tree.map(lambda l: l.qtensor.dequantize().T if isinstance(l, QParam) else l, qparams,
                       is_leaf=lambda l: isinstance(l, QParam))
    chex.assert_trees_all_close(out, model.apply({"params": deq}, ids), rtol=1e-4, atol=1e-4)


def test_scheme_name_quantizes_every_kernel_online():
    model, params, ids = _linen()
    qparams, report = quantize_params(params, "fp8_e4m3_channel")
    assert set(report.quantized) == {"up_proj/kernel", "down_proj/kernel", "head/kernel"}
    assert _rel_err(quantized_apply(model, {"params": qparams}, ids), model.apply({"params": params}, ids)) < 0.1


def test_unused_rule_is_an_error_or_a_report():
    _, params, _ = _linen()
    with pytest.raises(ValueError, match=r"q_proj"):
        quantize_params(params, [(r".*q_proj/kernel", "int8_ch")])
    _, report = quantize_params(params, [(r".*q_proj/kernel", "int8_ch")], strict=False)
    assert report.unused_rules == (r".*q_proj/kernel",)


def test_incompatible_scheme_names_the_parameter():
    params = {"odd": {"kernel": jax.random.normal(jax.random.key(0), (100, 32))}}
    with pytest.raises(ValueError, match=r"'odd/kernel'.*int4_g128"):
        quantize_params(params, "int4_g128")


def test_bad_rules():
    _, params, _ = _linen()
    with pytest.raises(ValueError, match="unknown scheme"):
        quantize_params(params, [(r".*", "int3_g7")])
    with pytest.raises(ValueError, match="regex"):
        quantize_params(params, [(r"(", "int8_ch")])
    with pytest.raises(TypeError, match="rule"):
        quantize_params(params, [42])


class TinyNNX(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(128, 256, rngs=rngs)
        self.layers = nnx.List([nnx.Linear(256, 256, use_bias=False, rngs=rngs) for _ in range(2)])
        self.down = nnx.Linear(256, 128, rngs=rngs)

    def __call__(self, x):
        x = nnx.gelu(self.up(x))
        for layer in self.layers:
            x = x + layer(x)
        return self.down(x)


def test_nnx_model_runs_quantized():
    model = TinyNNX(nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(3), (4, 128), jnp.bfloat16)
    ref = model(x).astype(jnp.float32)
    report = quantize_nnx(model, [(r"layers/.*", "int4_g128"), (r".*", "int8_ch")])
    assert report.quantized == {"layers/0/kernel": "int4_g128", "layers/1/kernel": "int4_g128",
                                "up/kernel": "int8_ch", "down/kernel": "int8_ch"}
    assert isinstance(model.layers[0], QLinear) and isinstance(model.up, QLinear)
    out = nnx.jit(lambda m, x: m(x))(model, x).astype(jnp.float32)
    assert _rel_err(out, ref) < 0.2  # 4-bit residual layers on random weights
    # Exactly the float model run with the dequantized kernels (up to bf16 rounding).
    deq = TinyNNX(nnx.Rngs(0))
    for name in ("up", "down"):
        getattr(deq, name).kernel[...] = getattr(model, name).qkernel.get_value().qtensor.dequantize().T
    for i in range(2):
        deq.layers[i].kernel[...] = model.layers[i].qkernel.get_value().qtensor.dequantize().T
    assert _rel_err(out, deq(x).astype(jnp.float32)) < 0.02
    graphdef, state = nnx.split(model)  # the quantized model still splits and merges
    chex.assert_trees_all_equal(nnx.merge(graphdef, state)(x), model(x))


def test_prepare_params_after_inspection():
    from jquant.flax import prepare_params
    from jquant.schemes.scheme import Prepared

    _, params, _ = _linen()
    raw, _ = quantize_params(params, "int8_ch", prepare=False)
    assert not isinstance(raw["up_proj"]["kernel"].weight, Prepared)
    prepared = prepare_params(raw)
    assert isinstance(prepared["up_proj"]["kernel"].weight, Prepared)
    chex.assert_trees_all_equal(prepared["up_proj"]["kernel"].qtensor.data, raw["up_proj"]["kernel"].qtensor.data)


def test_skip_takes_predicates_and_a_single_pattern():
    _, params, _ = _linen()
    qparams, report = quantize_params(params, "int8_ch", skip=(r".*embed.*", lambda path: path.startswith("down")))
    assert set(report.quantized) == {"up_proj/kernel", "head/kernel"}
    assert not isinstance(qparams["down_proj"]["kernel"], QParam)
    _, report = quantize_params(params, "int8_ch", skip=r"head/kernel")  # one regex, not its characters
    assert set(report.quantized) == {"up_proj/kernel", "down_proj/kernel"}
    with pytest.raises(TypeError, match="skip entry"):
        quantize_params(params, "int8_ch", skip=(3,))


def test_static_scheme_input_scale_rides_in_the_qparam():
    from jquant.schemes.builtin import fp8_tensor
    from jquant.flax import prepare_params

    model, params, ids = _linen()
    scheme = fp8_tensor(static_activations=True)
    raw, _ = quantize_params(params, [(r".*_proj/kernel", scheme), (r".*", None)], prepare=False)
    raw = jax.tree.map(lambda l: QParam(l.weight, l.scheme, jnp.float32(0.02)) if isinstance(l, QParam) else l, raw,
                       is_leaf=lambda l: isinstance(l, QParam))
    prepared = prepare_params(raw)
    assert float(prepared["up_proj"]["kernel"].input_scale) == np.float32(0.02)
    out = jax.jit(lambda p, i: quantized_apply(model, {"params": p}, i))(prepared, ids)
    assert _rel_err(out, model.apply({"params": params}, ids)) < 0.1
    leaves = jax.tree_util.tree_leaves(prepared["up_proj"]["kernel"])
    assert any(leaf.shape == () and leaf.dtype == jnp.float32 for leaf in leaves)  # an array leaf, not static


def test_plain_linen_apply_on_quantized_params_says_to_use_quantized_apply():
    model = nn.Dense(64)   # square: Flax's shape check passes and the Dense reaches jnp.asarray(kernel)
    x = jnp.ones((2, 64))
    qparams, _ = quantize_params(model.init(jax.random.key(0), x)["params"], "int8_ch")
    with pytest.raises(TypeError, match=r"quantized parameter \(QParam of scheme 'int8_ch'\).*quantized_apply "
                                        r"or inside jquant.flax.intercept_quantized\(\)"):
        model.apply({"params": qparams}, x)
    assert quantized_apply(model, {"params": qparams}, x).shape == (2, 64)
