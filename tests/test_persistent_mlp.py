"""The persistent dense-MLP benchmark's CPU-checkable parts (benchmarks/persistent_mlp.py; the kernel itself polls
flags, which interpret mode cannot run, so its values are checked on the GPU by the benchmark before it times):

1. ``pack_weights``' items against the gate, up and down weights indexed directly (the zero item included);
2. the benchmark's float32 reference layer against the model's ``DenseMLP`` on the reference path with bf16
   weights and the residual added (the step's roundings it claims), on random data;
3. the kernel lowers for CUDA at `mini`'s shape, and a grid too small for the reduction is refused by name.
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


def test_pack_weights_items():
    gate, up, down = _weights(64, 48)
    w13, w2 = pm.pack_weights(gate, up, down)
    assert w13.shape == (48 // pm.UNITS + 1, 2 * pm.UNITS, 64) and w2.shape == (48 // pm.UNITS + 1, pm.UNITS, 64)
    for i in range(48 // pm.UNITS):
        units = slice(pm.UNITS * i, pm.UNITS * (i + 1))
        np.testing.assert_array_equal(w13[i, :pm.UNITS], gate[units])
        np.testing.assert_array_equal(w13[i, pm.UNITS:], up[units])
        np.testing.assert_array_equal(w2[i], down[:, units].T)
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


def test_kernel_lowers_for_cuda_and_checks_its_grid():
    items = pm.WIDTH // pm.UNITS
    args = (jax.ShapeDtypeStruct((pm.X_ROWS, pm.DIM), jnp.bfloat16),
            jax.ShapeDtypeStruct((items + 1, 2 * pm.UNITS, pm.DIM), jnp.bfloat16),
            jax.ShapeDtypeStruct((items + 1, pm.UNITS, pm.DIM), jnp.bfloat16),
            jax.ShapeDtypeStruct((1,), jnp.int32))
    lower = lambda programs: jax.jit(lambda *a: pm.persistent_mlp(*a, programs=programs)).trace(*args).lower(
        lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lower(132).as_text()
    with pytest.raises(ValueError, match="programs = 64"):
        lower(64)
