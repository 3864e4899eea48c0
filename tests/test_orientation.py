"""One orientation convention: a QTensor records its contraction (K) axis and every product honours
it. Square weights, so a product along the wrong axis would run and return a plausible wrong answer
(relative error ~1.4 on random data) instead of failing on shapes."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jquant
from jquant import QTensor
from jquant.kernels.w4a16 import w4a16_matmul

N = K = 64


def _square(seed=0):
    return jax.random.normal(jax.random.key(seed), (N, K), jnp.float32)


def _x():
    return jax.random.normal(jax.random.key(9), (3, K), jnp.float32)


def _rel(a, b):
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def test_quantize_records_the_axis_it_groups_along():
    w = _square()
    assert jquant.quantize(w, "int4", axis=1, group_size=32).k_axis == 1
    assert jquant.quantize(w, "int4", axis=0, group_size=32).k_axis == 0
    assert jquant.quantize(w, "int8", axis=-1).k_axis == 1          # per channel: K is the reduced axis
    assert jquant.quantize(w, "fp8_e4m3", granularity="channel", axis=0).k_axis == 0
    assert jquant.quantize(w, "mxfp4", axis=0).k_axis == 0
    assert jquant.quantize(w, "nvfp4").k_axis == 1
    assert jquant.quantize(w, "nf4").k_axis == 1                    # blocks of 64 inside rows of 64
    # One scale for the whole tensor or 2-D tiles: no axis to record.
    assert jquant.quantize(w, "int8", granularity="tensor").k_axis is None
    assert jquant.quantize(w, "fp8_e4m3", granularity="block", block_size=(32, 32)).k_axis is None
    # bitsandbytes blocks the flattened tensor along its last axis, even where blocks straddle rows.
    assert jquant.quantize(jnp.ones((8, 32)), "nf4", blocksize=64).k_axis == 1


@pytest.mark.parametrize("name", ["int4_g32", "int8_ch", "fp8_e4m3_tensor", "nf4"])
def test_scheme_weights_and_loaded_checkpoints_have_k_on_axis_1(name):
    scheme = jquant.get_scheme(name)
    qw = scheme.quantize_weight(_square())
    assert qw.k_axis == 1
    loaded = jquant.from_checkpoint(jquant.to_checkpoint(qw, scheme.checkpoint_layout), scheme.checkpoint_layout,
                                    **_layout_meta(scheme, qw))
    assert loaded.k_axis == 1 and loaded.shape == (N, K)


def _layout_meta(scheme, qw):
    if scheme.checkpoint_layout == "gptq":
        return dict(bits=4, group_size=qw.block[1], sym=True)
    return {}


def test_right_calls_agree_with_the_float_reference():
    w, x = _square(), _x()
    qw = jquant.get_scheme("int4_g32").quantize_weight(w)          # [N, K], k_axis=1
    wd = qw.dequantize()
    want = x @ wd.T
    chex.assert_trees_all_close(jquant.get_scheme("int4_g32").apply(x, qw), want, rtol=1e-5, atol=1e-5)
    chex.assert_trees_all_close(jquant.qdot(x, qw), want, rtol=1e-5, atol=1e-5)
    chex.assert_trees_all_close(w4a16_matmul(x, qw), want, rtol=1e-5, atol=1e-5)
    # And against the unquantized weight: int4 g32 error, far from the transposed product's ~1.4.
    assert _rel(jquant.qdot(x, qw), x @ w.T) < 0.2
    assert _rel(x @ w, x @ w.T) > 1.0

    kernel = jquant.quantize(w, "int4", axis=0, group_size=32)     # a Flax kernel [K, N], k_axis=0
    chex.assert_trees_all_close(jquant.qdot(x, kernel), x @ kernel.dequantize(), rtol=1e-5, atol=1e-5)
    assert _rel(jquant.qdot(x, kernel), x @ w) < 0.2


def test_every_wrong_call_raises():
    w, x = _square(), _x()
    scheme = jquant.get_scheme("int4_g32")
    kernel = jquant.quantize(w, "int4", axis=0, group_size=32)     # K on axis 0
    with pytest.raises(ValueError, match="K on axis 0"):
        scheme.apply(x, kernel)
    with pytest.raises(ValueError, match="K on axis 0"):
        scheme.process_weights_after_loading(kernel)
    with pytest.raises(ValueError, match="k_axis=0"):
        w4a16_matmul(x, kernel)
    # A 4-bit [N, K] weight that does not say where K is.
    unknown = scheme.quantize_weight(w).replace(k_axis=None)
    with pytest.raises(ValueError, match="k_axis=None"):
        w4a16_matmul(x, unknown)
    # qdot contracts along the recorded axis: a [N, K] weight needs x[..., K] whatever N is.
    wide = jquant.get_scheme("int4_g32").quantize_weight(jax.random.normal(jax.random.key(1), (32, K)))
    with pytest.raises(ValueError, match=r"k_axis=1 \(need x\[..., K\] and w\[N, K\]\)"):
        jquant.qdot(jnp.ones((3, 32)), wide)



def test_qdot_refuses_a_square_weight_of_unknown_orientation():
    w, x = _square(), _x()
    per_tensor = jquant.quantize(w, "fp8_e4m3", granularity="tensor")   # no axis to record
    assert per_tensor.k_axis is None
    with pytest.raises(ValueError, match="does not record its K axis"):
        jquant.qdot(x, per_tensor)
    chex.assert_trees_all_close(jquant.qdot(x, per_tensor.replace(k_axis=1)), x @ per_tensor.dequantize().T,
                                rtol=1e-5, atol=1e-5)
    chex.assert_trees_all_close(jquant.qdot(x, per_tensor.replace(k_axis=0)), x @ per_tensor.dequantize(),
                                rtol=1e-5, atol=1e-5)


def test_k_axis_is_static_metadata_that_survives_jit_and_tree_maps():
    qw = jquant.get_scheme("int4_g32").quantize_weight(_square())
    assert jax.jit(lambda q: q)(qw).k_axis == 1
    assert jax.tree.map(jnp.copy, qw).k_axis == 1
    kernel = jquant.quantize(_square(), "int4", axis=0, group_size=32)
    assert jax.tree_util.tree_structure(qw) != jax.tree_util.tree_structure(qw.replace(k_axis=None))
    chex.assert_trees_all_close(jax.jit(jquant.qdot)(_x(), kernel), jquant.qdot(_x(), kernel))


def test_k_axis_is_checked_and_normalised():
    qt = jquant.quantize(_square(), "int8", axis=1)
    assert qt.replace(k_axis=-1).k_axis == 1
    for bad in (2, -3, True, 1.0):
        with pytest.raises(ValueError, match="k_axis"):
            qt.replace(k_axis=bad)
    legacy = QTensor(data=jnp.zeros((4, 4), jnp.uint8), scale=jnp.ones((4, 1)), fmt="int8", shape=(4, 4),
                     block=(1, 4))
    assert legacy.k_axis is None


def test_save_and_restore_keep_k_axis(tmp_path):
    from jquant.flax.orbax_io import _decode_qtensor, _encode_qtensor, restore_quantized, save_quantized

    params = {"w": jquant.get_scheme("int4_g32").quantize_weight(_square()),
              "kernel": jquant.quantize(_square(1), "int8", axis=0)}
    save_quantized(tmp_path / "ckpt", params)
    restored = restore_quantized(tmp_path / "ckpt")
    assert restored["w"].k_axis == 1 and restored["kernel"].k_axis == 0
    # Structures written before k_axis existed still load (as unknown).
    arrays = {}
    meta = _encode_qtensor(params["w"], "w", arrays)
    del meta["k_axis"]
    old = _decode_qtensor(meta, arrays)
    assert old.k_axis is None
    np.testing.assert_array_equal(np.asarray(old.dequantize()), np.asarray(params["w"].dequantize()))
