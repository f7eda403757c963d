"""MLA's decode attention core in one kernel (pallas_kernels/mla_attention.py, interpret mode on CPU)
against XLA's core (``k3jax.functional.mla.latent_attention``), its CUDA lowering, its input checks,
and the MLA layer's decode step with the kernel against the same step on XLA's ops."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import k3jax.functional.mla as functional_mla
from k3jax.functional.mla import latent_attention
from k3jax.implementation import use_implementation
from k3jax.layers.mla import MLA
from k3jax.presets import preset
from pallas_kernels.mla_attention import AttentionBlocks, decode_latent_attention
from reference_numpy import rel_err

H, R, P, S, SCALE = 3, 48, 8, 37, 0.3  # H, R, P padded inside the kernel; S not a multiple of block_s


def _inputs(T: int, dtype, seed: int):
    """q_lat, q_pe, c_kv, k_pe for B = 2 (q_lat in the cache's dtype: the kernel's operand, exactly)."""
    keys = jax.random.split(jax.random.key(seed), 4)
    q_lat = jax.random.normal(keys[0], (2, T, H, R)).astype(dtype)
    q_pe = jax.random.normal(keys[1], (2, T, H, P)).astype(dtype)
    c_kv = jax.random.normal(keys[2], (2, S, R)).astype(dtype)
    k_pe = (2.0 * jax.random.normal(keys[3], (2, S, P))).astype(dtype)
    return q_lat, q_pe, c_kv, k_pe


@pytest.mark.parametrize("dtype,T,splits,window", [
    (jnp.float32, 1, 1, None),
    (jnp.bfloat16, 2, 1, None),
    (jnp.float32, 2, 3, 30),  # three splits over a window; sequence 0's later splits hold no visible key
    (jnp.bfloat16, 1, 3, None),
])
def test_kernel_matches_xla_core(dtype, T, splits, window):
    """Sequence 0 starts at position 0, sequence 1 ends at the last readable slot."""
    q_lat, q_pe, c_kv, k_pe = _inputs(T, dtype, seed=T + splits)
    last = (window or S) - 1
    pos = jnp.array([np.arange(T), np.arange(last - T + 1, last + 1)], jnp.int32)
    blocks = AttentionBlocks(block_s=16, splits=splits)
    got = decode_latent_attention(q_lat, q_pe, c_kv, k_pe, pos, SCALE, window=window, blocks=blocks)
    want = latent_attention(q_lat, q_pe, c_kv[:, :window], k_pe[:, :window], pos, SCALE)
    assert got.shape == (2, T, H, R) and got.dtype == jnp.float32
    # float32: summation order; bf16: the kernel rounds exp(score - running max) to bf16, XLA on the
    # CPU keeps the probabilities float32
    assert rel_err(got, want) < (1e-5 if dtype == jnp.float32 else 1e-3)  # measured 2e-4
    np.testing.assert_allclose(np.asarray(got[0, 0]), np.asarray(c_kv[0, 0], np.float32)[None].repeat(H, 0),
                               rtol=1e-5 if dtype == jnp.float32 else 0, atol=1e-5)  # one visible key: its row


@pytest.mark.parametrize("B,S_,H_,R_,P_,splits", [(1, 192, 16, 512, 64, None), (2, 4096, 16, 512, 64, None),
                                                  (2, 37, 3, 48, 8, 3)])
def test_lowers_for_cuda_through_triton(B, S_, H_, R_, P_, splits):
    """mini's MLA shape (one split at the decode benchmark's 192 positions, eight at 4096) and a padded
    shape with splits."""
    f = lambda *a: decode_latent_attention(*a, SCALE, blocks=AttentionBlocks(splits=splits), interpret=False)
    args = [jax.ShapeDtypeStruct(s, d) for s, d in [((B, 1, H_, R_), jnp.bfloat16), ((B, 1, H_, P_), jnp.bfloat16),
                                                    ((B, S_, R_), jnp.bfloat16), ((B, S_, P_), jnp.bfloat16),
                                                    ((B, 1), jnp.int32)]]
    assert "xla.gpu.triton" in jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_bad_inputs_are_refused():
    q_lat, q_pe, c_kv, k_pe = _inputs(1, jnp.float32, seed=0)
    pos = jnp.zeros((2, 1), jnp.int32)
    with pytest.raises(ValueError, match="q_lat .* and q_pe .* disagree"):
        decode_latent_attention(q_lat, q_pe[:1], c_kv, k_pe, pos, SCALE)
    with pytest.raises(ValueError, match=r"c_kv must be \[B, S, R\]"):
        decode_latent_attention(q_lat, q_pe, c_kv[..., :16], k_pe, pos, SCALE)
    with pytest.raises(ValueError, match=r"k_pe must be \[B, S, P\]"):
        decode_latent_attention(q_lat, q_pe, c_kv, k_pe[:, :5], pos, SCALE)
    with pytest.raises(ValueError, match="must share a dtype"):
        decode_latent_attention(q_lat, q_pe, c_kv, k_pe.astype(jnp.bfloat16), pos, SCALE)
    with pytest.raises(ValueError, match="pos must be integer"):
        decode_latent_attention(q_lat, q_pe, c_kv, k_pe, pos.astype(jnp.float32), SCALE)
    with pytest.raises(ValueError, match="window = 0"):
        decode_latent_attention(q_lat, q_pe, c_kv, k_pe, pos, SCALE, window=0)
    with pytest.raises(ValueError, match="block_s = 24"):
        AttentionBlocks(block_s=24)


@pytest.mark.parametrize("cache_dtype", [jnp.float32, jnp.bfloat16])
def test_layer_decode_step_with_kernel_equals_xla(monkeypatch, cache_dtype):
    """tiny's MLA layer (every K3 feature), one decode token per sequence at positions 3 and 11 of a
    random 16-slot cache read through a window of 12, on the Pallas path with and without the kernel."""
    layer = MLA(preset("tiny").hidden_size, preset("tiny").mla, rngs=nnx.Rngs(0))
    keys = jax.random.split(jax.random.key(5), 3)
    x = jax.random.normal(keys[0], (2, 1, preset("tiny").hidden_size))
    cache = layer.init_cache(2, 16, cache_dtype)
    cache = type(cache)(jax.random.normal(keys[1], cache.c_kv.shape).astype(cache_dtype),
                        jax.random.normal(keys[2], cache.k_pe.shape).astype(cache_dtype))
    start = jnp.array([3, 11], jnp.int32)
    outs = {}
    with use_implementation("pallas"):
        for kernel in (True, False):
            monkeypatch.setattr(functional_mla, "ATTENTION_KERNEL", kernel)
            outs[kernel] = layer.extend(x, cache, start, window=12)
    (got, got_cache), (want, want_cache) = outs[True], outs[False]
    # bf16: the kernel rounds q_lat and the probabilities to bf16, XLA on the CPU keeps them float32 (2e-3)
    assert rel_err(got, want) < (1e-5 if cache_dtype == jnp.float32 else 5e-3)
    np.testing.assert_array_equal(np.float32(got_cache.c_kv), np.float32(want_cache.c_kv))
