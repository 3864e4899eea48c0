"""QTensor as a pytree: jit, vmap, tree_map, donation, sharding, byte accounting."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jquant
from jquant import QTensor

# One representative per format family; [N, K] weights quantized along K.
CASES = [
    ("int4", {"group_size": 32}),
    ("uint4", {"group_size": 32}),
    ("int8", {}),
    ("fp8_e4m3", {"granularity": "channel"}),
    ("mxfp4", {}),
    ("nvfp4", {}),
    ("nf4", {}),
]
IDS = [c[0] for c in CASES]


def weight(seed=0, shape=(64, 128)):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


@pytest.fixture(params=CASES, ids=IDS)
def qt(request):
    fmt, opts = request.param
    return jquant.quantize(weight(), fmt, axis=1, **opts)


def test_is_pytree_with_static_metadata(qt):
    leaves, treedef = jax.tree_util.tree_flatten(qt)
    assert all(isinstance(l, jax.Array) for l in leaves)
    rebuilt = jax.tree_util.tree_unflatten(treedef, leaves)
    assert rebuilt == qt or all(np.array_equal(a, b) for a, b in zip(leaves, jax.tree_util.tree_leaves(rebuilt)))
    assert isinstance(jax.tree.map(lambda a: a, qt), QTensor)


def test_jit_matches_eager(qt):
    eager = qt.dequantize()
    jitted = jax.jit(lambda q: q.dequantize())(qt)
    chex.assert_trees_all_equal(eager, jitted)
    assert eager.shape == qt.shape


def test_vmap_over_stacked_qtensors(qt):
    fmt, opts = next(c for c in CASES if c[0] == qt.fmt)
    other = jquant.quantize(weight(1), fmt, axis=1, **opts)
    stacked = jax.tree.map(lambda a, b: jnp.stack([a, b]), qt, other)
    out = jax.vmap(lambda q: q.dequantize())(stacked)
    chex.assert_trees_all_equal(out[0], qt.dequantize())
    chex.assert_trees_all_equal(out[1], other.dequantize())


def test_donation(qt):
    expected = qt.dequantize()
    fn = jax.jit(lambda q: jax.tree.map(lambda a: a, q), donate_argnums=0)
    donated = jax.tree.map(jnp.copy, qt)
    out = fn(donated)
    chex.assert_trees_all_equal(out.dequantize(), expected)
    assert all(leaf.is_deleted() for leaf in jax.tree_util.tree_leaves(donated))


def test_named_sharding_keeps_scales_with_data(qt):
    devices = np.array(jax.devices()[:8])
    if devices.size < 8:
        pytest.skip("needs 8 (simulated) devices: conftest sets XLA_FLAGS")
    mesh = Mesh(devices, ("tp",))
    sharded = jax.device_put(qt, qt.sharding_tree(NamedSharding(mesh, P("tp", None))))
    for leaf in jax.tree_util.tree_leaves(sharded):
        if leaf.ndim == 2:
            assert leaf.sharding.spec == P("tp", None)
            assert leaf.addressable_shards[0].data.shape[0] == leaf.shape[0] // 8
    chex.assert_trees_all_equal(jax.jit(lambda q: q.dequantize())(sharded), qt.dequantize())


def test_sharding_that_splits_a_group_is_refused():
    mesh = Mesh(np.array(jax.devices()[:8]), ("tp",))
    qt = jquant.quantize(weight(shape=(16, 128)), "int4", axis=1, group_size=32)  # 4 groups along K
    with pytest.raises(ValueError, match="cut a block"):
        qt.sharding_tree(NamedSharding(mesh, P(None, "tp")))


def test_nbytes_counts_every_leaf():
    qt = jquant.quantize(weight(), "int4", axis=1, group_size=32)
    expected = sum(l.size * l.dtype.itemsize for l in jax.tree_util.tree_leaves(qt))
    assert qt.nbytes == expected
    assert qt.data.nbytes == 64 * 128 // 2  # two codes per byte
    assert 4.0 < qt.bits_per_weight < 6.0


def test_errors():
    with pytest.raises(TypeError, match="QTensor"):
        jquant.dequantize(jnp.ones(3))
    bogus = QTensor(data=jnp.zeros(4, jnp.uint8), scale=jnp.ones(1), fmt="int99", shape=(4,), block=(4,))
    with pytest.raises(ValueError, match="int99"):
        bogus.dequantize()
    with pytest.raises(ValueError, match="unknown format"):
        jquant.quantize(weight(), "int99")
    with pytest.raises(TypeError, match="fmt"):
        jquant.quantize(weight(), 4)
