"""The one-kernel Block AttnRes mix (pallas_kernels/attn_res.py, interpret mode on CPU) against the
reference mix (k3jax.functional.attn_res.attn_res_mix) on random data."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.functional.attn_res import attn_res_mix as reference
from pallas_kernels.attn_res import attn_res_mix


@pytest.mark.parametrize("n_blocks,dtype", [(0, jnp.float32), (2, jnp.bfloat16), (3, jnp.float32)])
def test_matches_reference(n_blocks, dtype):
    keys = jax.random.split(jax.random.key(n_blocks), 4)
    N, B, T, D = 3, 2, 3, 96  # D = 3 chunks of 32: the chunked sums
    blocks = (3.0 * jax.random.normal(keys[0], (N, B, T, D))).astype(dtype)
    partial = jax.random.normal(keys[1], (B, T, D)).astype(dtype)
    norm_weight = 1.0 + 0.1 * jax.random.normal(keys[2], (D,))
    proj_weight = 0.3 * jax.random.normal(keys[3], (D,))
    out, weights = attn_res_mix(blocks, jnp.asarray(n_blocks), partial, norm_weight, proj_weight, 1e-6)
    ref_out, ref_weights = reference(blocks, n_blocks, partial, norm_weight, proj_weight, 1e-6)
    np.testing.assert_allclose(weights, ref_weights, rtol=2e-5, atol=1e-7)
    np.testing.assert_allclose(out, ref_out, rtol=2e-5, atol=2e-5)
    assert np.all(np.asarray(weights[:n_blocks]) > 0) and np.all(np.asarray(weights[n_blocks:N]) == 0)


def test_shape_mismatch_is_refused():
    with pytest.raises(ValueError, match="partial"):
        attn_res_mix(jnp.zeros((2, 1, 1, 32)), 1, jnp.zeros((1, 2, 32)), jnp.ones(32), jnp.ones(32), 1e-6)
