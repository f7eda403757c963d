"""MLA's decode attention over the latent cache (pallas_kernels/latent_attention.py, interpret mode on CPU)
against softmax attention in float64 NumPy with an explicit position mask."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.latent_attention import LatentBlocks, latent_attention
from reference_numpy import rel_err

H, R, P = 20, 32, 16  # two head blocks of 16, the second ragged
_attention = jax.jit(latent_attention, static_argnames=("scale", "keys", "blocks"))


def _inputs(B: int, S: int, dtype, seed: int):
    keys = jax.random.split(jax.random.key(seed), 4)
    shapes = [(B, H, R), (B, H, P), (B, S, R), (B, S, P)]
    q_lat, q_pe, c_kv, k_pe = [2.0 * jax.random.normal(k, s) for k, s in zip(keys, shapes)]
    return q_lat, q_pe.astype(dtype), c_kv.astype(dtype), k_pe.astype(dtype)


def _numpy_attention(q_lat, q_pe, c_kv, k_pe, positions, scale, keys, dtype):
    """The operands rounded to the cache's dtype (as the kernel's products take them), then float64."""
    ql, qp, c, kp = (np.asarray(jnp.asarray(a).astype(dtype), np.float64) for a in (q_lat, q_pe, c_kv, k_pe))
    scores = (np.einsum("bhr,bsr->bhs", ql, c) + np.einsum("bhp,bsp->bhs", qp, kp)) * scale
    key = np.arange(c.shape[1])[None, None, :]
    scores = np.where((key <= np.asarray(positions)[:, None, None]) & (key < keys), scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    return np.einsum("bhs,bsr->bhr", probs / probs.sum(-1, keepdims=True), c)


@pytest.mark.parametrize("dtype,tolerance", [(jnp.float32, 1e-6), (jnp.bfloat16, 2e-3)])
@pytest.mark.parametrize("split_keys", [32, 64])  # four splits (the XLA merge; a split past a position) or one
def test_ragged_positions_match_masked_softmax(dtype, tolerance, split_keys):
    """Three sequences at positions 0, 40 and past the key bound (keys = 100 of S = 110: the rest unread);
    the key blocks (16) do not divide the keys."""
    B, S, keys = 3, 110, 100
    inputs = _inputs(B, S, dtype, seed=split_keys)
    positions = jnp.array([0, 40, 105])
    blocks = LatentBlocks(block_h=16, block_k=16, split_keys=split_keys)
    got = _attention(*inputs, positions, scale=0.125, keys=keys, blocks=blocks)
    assert got.shape == (B, H, R) and got.dtype == jnp.float32
    assert rel_err(got, _numpy_attention(*inputs, positions, 0.125, keys, dtype)) < tolerance


def test_bad_operands_name_the_argument():
    q_lat, q_pe, c_kv, k_pe = _inputs(1, 8, jnp.float32, seed=0)
    positions = jnp.array([3])
    with pytest.raises(ValueError, match="k_pe must be"):
        latent_attention(q_lat, q_pe, c_kv, k_pe[:, :, :4], positions, 0.5)
    with pytest.raises(ValueError, match="positions must be"):
        latent_attention(q_lat, q_pe, c_kv, k_pe, jnp.array([3, 4]), 0.5)
    with pytest.raises(ValueError, match="integers"):
        latent_attention(q_lat, q_pe, c_kv, k_pe, positions.astype(jnp.float32), 0.5)
    with pytest.raises(ValueError, match=r"keys must be in \[1, S = 8\]"):
        latent_attention(q_lat, q_pe, c_kv, k_pe, positions, 0.5, keys=9)
    with pytest.raises(ValueError, match="split_keys must be a multiple"):
        LatentBlocks(block_k=32, split_keys=48)
