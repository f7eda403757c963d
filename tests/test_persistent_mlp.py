"""The persistent dense-MLP benchmark's CPU-checkable parts (benchmarks/persistent_mlp.py; the kernel itself polls
flags, which interpret mode cannot run, so its values are checked on the GPU by the benchmark before it times):

1. ``pack_weights``' items against the gate, up and down weights indexed directly (the zero item included);
2. the benchmark's float32 reference layer against the model's ``DenseMLP`` on the reference path with bf16
   weights and the residual added (the step's roundings it claims), on random data;
3. the kernel lowers for CUDA at `mini`'s shape (items of 16 and 32 units, one layer and two a kernel), and a grid
   too small for the reduction, another item size or a probe of several layers is refused by name; a chain's
   weight sets that do not stack by the kernel's layers are refused.
"""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

sys.path.append(str(Path(__file__).resolve().parents[1] / "benchmarks"))
import persistent_mlp as pm  # noqa: E402

from k3jax.layers.mlp import DenseMLP, activation  # noqa: E402


def _weights(dim, width, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    return [(jax.random.normal(k, shape) * shape[1] ** -0.5).astype(jnp.bfloat16)
            for k, shape in zip(keys, [(width, dim), (width, dim), (dim, width)])]


@pytest.mark.parametrize("units", [16, 32])
def test_pack_weights_items(units):
    gate, up, down = _weights(64, 96)
    w13, w2 = pm.pack_weights(gate, up, down, units=units)
    assert w13.shape == (96 // units + 1, 2 * units, 64) and w2.shape == (96 // units + 1, units, 64)
    for i in range(96 // units):
        rows = slice(units * i, units * (i + 1))
        np.testing.assert_array_equal(w13[i, :units], gate[rows])
        np.testing.assert_array_equal(w13[i, units:], up[rows])
        np.testing.assert_array_equal(w2[i], down[:, rows].T)
    assert not w13[-1].any() and not w2[-1].any()


def test_reference_layer_is_the_models_mlp():
    dim, width = 128, 256
    gate, up, down = _weights(dim, width, seed=1)
    mlp = DenseMLP(dim, width, activation("situ"), rngs=nnx.Rngs(0), param_dtype=jnp.bfloat16)
    mlp.gate_proj.weight[...], mlp.up_proj.weight[...], mlp.down_proj.weight[...] = gate, up, down
    x = jax.random.normal(jax.random.key(2), (dim,)).astype(jnp.bfloat16)
    expected = np.asarray(mlp(x[None], residual=x[None])[0].astype(jnp.float32))
    got = pm.reference(x, [(gate, up, down)])
    assert np.linalg.norm(got - expected) / np.linalg.norm(expected) < 1e-2


def _lower(units, programs, layers=1, phases=3):
    items = pm.WIDTH // units
    args = (jax.ShapeDtypeStruct((pm.X_ROWS, pm.DIM), jnp.bfloat16),
            jax.ShapeDtypeStruct((layers, items + 1, 2 * units, pm.DIM), jnp.bfloat16),
            jax.ShapeDtypeStruct((layers, items + 1, units, pm.DIM), jnp.bfloat16),
            jax.ShapeDtypeStruct((1,), jnp.int32))
    return jax.jit(lambda *a: pm.persistent_mlp(*a, programs=programs, phases=phases)).trace(*args).lower(
        lowering_platforms=("cuda",))


@pytest.mark.parametrize("units, layers", [(16, 1), (32, 1), (16, 2)])
def test_kernel_lowers_for_cuda(units, layers):
    assert "mosaic_gpu" in _lower(units, 132, layers).as_text()


def test_kernel_refuses_a_small_grid_other_item_sizes_and_a_probe_of_layers():
    with pytest.raises(ValueError, match="programs = 64"):
        _lower(16, 64)
    with pytest.raises(ValueError, match="u 16 or 32"):
        _lower(8, 132)
    with pytest.raises(ValueError, match="one layer for a probe"):
        _lower(16, 132, layers=2, phases=1)


def test_chain_stacks_weight_sets_by_kernel():
    packed = [(jnp.full((2, 4, 8), i, jnp.bfloat16), jnp.full((2, 2, 8), -i, jnp.bfloat16)) for i in range(4)]
    with pytest.raises(ValueError, match="4 weight sets do not stack 3"):
        pm.persistent_chain(packed, 132, 2, 4, layers=3)
    with pytest.raises(ValueError, match="a chain of 3 layers in kernels of 2"):
        pm.persistent_chain(packed, 132, 2, 4, layers=2)(3)
