"""The decode step's latent cache write (pallas_kernels/mla/triton_cache.py, interpret mode on CPU)
against ``MLA.latent`` and the scatter with ``mode="drop"``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.functional.norms import rms_norm
from pallas_kernels.mla.triton_cache import write_latents

R, P, S, EPS = 48, 16, 10, 1e-6  # R not a power of two: the padded columns are masked


def _inputs(batch: int, dtype, cache_dtype, seed: int):
    keys = jax.random.split(jax.random.key(seed), 4)
    c = (3.0 * jax.random.normal(keys[0], (batch, R + P))).astype(dtype)
    weight = 1.0 + 0.3 * jax.random.normal(keys[1], (R,))
    c_kv = jax.random.normal(keys[2], (batch, S, R)).astype(cache_dtype)
    k_pe = jax.random.normal(keys[3], (batch, S, P)).astype(cache_dtype)
    return c, weight, c_kv, k_pe


@pytest.mark.parametrize("dtype,cache_dtype", [(jnp.bfloat16, jnp.bfloat16), (jnp.float32, jnp.float32),
                                               (jnp.bfloat16, jnp.float32)])
def test_write_latents_matches_norm_then_scatter(dtype, cache_dtype):
    """Three sequences: one mid-cache, one at the last slot, one past the end (dropped)."""
    c, weight, c_kv, k_pe = _inputs(3, dtype, cache_dtype, seed=1)
    positions = jnp.array([4, S - 1, S], jnp.int32)
    rows = jnp.arange(3)
    want_kv = c_kv.at[rows, positions].set(rms_norm(c[:, :R], weight, EPS).astype(cache_dtype), mode="drop")
    want_pe = k_pe.at[rows, positions].set(c[:, R:].astype(cache_dtype), mode="drop")
    got_kv, got_pe = jax.jit(write_latents, static_argnums=2)(c, weight, EPS, c_kv, k_pe, positions)
    assert got_kv.dtype == cache_dtype and got_pe.dtype == cache_dtype
    tolerance = 1e-6 if dtype == jnp.float32 else 1e-2  # the norm's summation order; one bf16 ulp
    np.testing.assert_allclose(np.float32(got_kv), np.float32(want_kv), rtol=tolerance, atol=tolerance)
    np.testing.assert_array_equal(np.float32(got_pe), np.float32(want_pe))
    untouched = np.ones((3, S), bool)
    untouched[0, 4] = untouched[1, S - 1] = False
    np.testing.assert_array_equal(np.float32(got_kv)[untouched], np.float32(c_kv)[untouched])


def test_lowers_for_cuda_through_triton():
    f = lambda c, w, kv, pe, p: write_latents(c, w, EPS, kv, pe, p, interpret=False)
    args = [jax.ShapeDtypeStruct(s, d) for s, d in [((1, 576), jnp.bfloat16), ((512,), jnp.bfloat16),
                                                    ((1, 192, 512), jnp.bfloat16), ((1, 192, 64), jnp.bfloat16),
                                                    ((1,), jnp.int32)]]
    assert "xla.gpu.triton" in jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_bad_inputs_are_refused():
    c, weight, c_kv, k_pe = _inputs(2, jnp.float32, jnp.float32, seed=0)
    positions = jnp.zeros((2,), jnp.int32)
    with pytest.raises(ValueError, match=r"c must be \[B, R \+ P\]"):
        write_latents(c[:, :R], weight, EPS, c_kv, k_pe, positions)
    with pytest.raises(ValueError, match="P a power of two"):
        write_latents(c[:, :R + 12], weight, EPS, c_kv, k_pe[..., :12], positions)
    with pytest.raises(ValueError, match=r"norm_weight must be \[R\]"):
        write_latents(c, weight[:8], EPS, c_kv, k_pe, positions)
    with pytest.raises(ValueError, match="positions must be integer"):
        write_latents(c, weight, EPS, c_kv, k_pe, positions.astype(jnp.float32))
