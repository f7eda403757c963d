"""The prefill flash-attention kernel (pallas_kernels/mla/triton_attention.py, interpret mode on CPU)
against softmax attention in float64 NumPy with an explicit position mask."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.mla.triton_attention import AttentionBlocks, prefill_attention
from reference_numpy import rel_err

H, N, P, V = 3, 16, 8, 16
BLOCKS = AttentionBlocks(block_q=16, block_k=16)
_attention = jax.jit(prefill_attention, static_argnames=("scale", "blocks"))


def _inputs(B: int, T: int, S: int, dtype, seed: int):
    keys = jax.random.split(jax.random.key(seed), 5)
    shapes = [(B, T, H, N), (B, T, H, P), (B, S, H, N), (B, S, P), (B, S, H, V)]
    return [(2.0 * jax.random.normal(k, s)).astype(dtype) for k, s in zip(keys, shapes)]


def _numpy_attention(q_nope, q_pe, k_nope, k_pe, v, positions, scale):
    qn, qp, kn, kp, vv = (np.asarray(a, np.float64) for a in (q_nope, q_pe, k_nope, k_pe, v))
    scores = (np.einsum("bthn,bshn->bhts", qn, kn) + np.einsum("bthp,bsp->bhts", qp, kp)) * scale
    visible = np.arange(kn.shape[1])[None, None, None, :] <= np.asarray(positions)[:, None, :, None]
    scores = np.where(visible, scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    return np.einsum("bhts,bshv->bthv", probs / probs.sum(-1, keepdims=True), vv)


@pytest.mark.parametrize("dtype,tolerance", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_ragged_chunks_match_masked_softmax(dtype, tolerance):
    """Two sequences at different offsets; T and S not multiples of the blocks; the second sequence's
    last queries sit past the last key (they see every key)."""
    B, T, S = 2, 37, 70
    inputs = _inputs(B, T, S, dtype, seed=0)
    positions = jnp.array([0, 40])[:, None] + jnp.arange(T)
    got = _attention(*inputs, positions, scale=0.25, blocks=BLOCKS)
    assert got.shape == (B, T, H, V) and got.dtype == jnp.float32
    assert rel_err(got, _numpy_attention(*inputs, positions, 0.25)) < tolerance


def test_one_query_per_sequence_and_default_blocks():
    """T = 1 (block_q shrinks to 16) with the default key blocks: a query sees keys 0..position."""
    inputs = _inputs(2, 1, 150, jnp.float32, seed=1)
    positions = jnp.array([[5], [149]])
    got = _attention(*inputs, positions, scale=0.5, blocks=AttentionBlocks())
    assert rel_err(got, _numpy_attention(*inputs, positions, 0.5)) < 1e-5


def test_bad_shapes_name_the_argument():
    q_nope, q_pe, k_nope, k_pe, v = _inputs(1, 4, 8, jnp.float32, seed=2)
    positions = jnp.arange(4)[None]
    with pytest.raises(ValueError, match="k_pe must be"):
        prefill_attention(q_nope, q_pe, k_nope, k_pe[:, :, :4], v, positions, 0.5)
    with pytest.raises(ValueError, match="positions must be"):
        prefill_attention(q_nope, q_pe, k_nope, k_pe, v, positions[:, :3], 0.5)
    with pytest.raises(ValueError, match="integers"):
        prefill_attention(q_nope, q_pe, k_nope, k_pe, v, positions.astype(jnp.float32), 0.5)
    with pytest.raises(ValueError, match="block_k must be a power of two"):
        AttentionBlocks(block_k=48)
