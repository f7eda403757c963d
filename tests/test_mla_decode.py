"""pallas_kernels.mla_decode (interpret mode on CPU) against k3jax.functional.mla.absorbed_attention."""

import jax
import jax.numpy as jnp
import pytest

from k3jax.functional.mla import absorbed_attention
from pallas_kernels.mla_decode import DecodeBlocks, absorbed_decode

B, H, N, P, V, S = 2, 3, 8, 4, 8, 45  # S: not a multiple of block_s 8
SCALE = 0.3


def _inputs(key, R, dtype):
    k = jax.random.split(key, 5)
    return (jax.random.normal(k[0], (B, H, N)), jax.random.normal(k[1], (B, H, P)),
            jax.random.normal(k[2], (B, S, R)).astype(dtype), jax.random.normal(k[3], (B, S, P)).astype(dtype),
            (R ** -0.5 * jax.random.normal(k[4], (H * (N + V), R))).astype(dtype))


@pytest.mark.parametrize("R, dtype, window, splits, positions", [
    (16, jnp.float32, None, 1, (0, S - 1)),
    (32, jnp.bfloat16, None, 3, (S - 1, 0)),
    (32, jnp.float32, 40, 2, (17, 39)),
])
def test_matches_absorbed_attention(R, dtype, window, splits, positions):
    """One token per sequence at different positions (the first and the last slot among them), whole
    cache or a window, one or several splits (the last one partly or wholly past a position)."""
    q_nope, q_pe, c_kv, k_pe, kv_b = _inputs(jax.random.key(R + splits), R, dtype)
    positions = jnp.array(positions, jnp.int32)
    out = absorbed_decode(q_nope, q_pe, c_kv, k_pe, kv_b, positions, SCALE, window=window,
                          blocks=DecodeBlocks(block_s=8, block_n=4, splits=splits))
    W = S if window is None else window
    visible = jnp.arange(W)[None, None, :] <= positions[:, None, None]
    ref = absorbed_attention(q_nope[:, None], q_pe[:, None], c_kv[:, :W], k_pe[:, :W], kv_b, visible, SCALE)[:, 0]
    assert out.shape == (B, H, V) and out.dtype == jnp.float32
    # bf16: the kernel rounds its matmul operands to bf16, the CPU reference keeps them float32
    tol = 2e-2 if dtype == jnp.bfloat16 else 1e-5
    assert float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref)) < tol


@pytest.mark.parametrize("splits", [1, 4])
def test_lowers_for_cuda_through_triton(splits):
    """Pallas' Triton lowering at mini's head shapes (bf16, S not a multiple of block_s), on the CPU."""
    args = [jax.ShapeDtypeStruct(s, d) for s, d in
            [((2, 16, 128), jnp.bfloat16), ((2, 16, 64), jnp.bfloat16), ((2, 200, 512), jnp.bfloat16),
             ((2, 200, 64), jnp.bfloat16), ((16 * 256, 512), jnp.bfloat16), ((2,), jnp.int32)]]
    fn = lambda *a: absorbed_decode(*a, 0.1, window=192, blocks=DecodeBlocks(splits=splits), interpret=False)
    assert "xla.gpu.triton" in jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_bad_inputs_are_refused():
    q_nope, q_pe, c_kv, k_pe, kv_b = _inputs(jax.random.key(0), 16, jnp.float32)
    positions = jnp.zeros((B,), jnp.int32)
    with pytest.raises(ValueError, match="k_pe must be"):
        absorbed_decode(q_nope, q_pe, c_kv, k_pe[:, :-1], kv_b, positions, SCALE)
    with pytest.raises(ValueError, match="kv_b must be"):
        absorbed_decode(q_nope, q_pe, c_kv, k_pe, kv_b[:, :8], positions, SCALE)
    with pytest.raises(ValueError, match="positions must be"):
        absorbed_decode(q_nope, q_pe, c_kv, k_pe, kv_b, positions[:1], SCALE)
    with pytest.raises(ValueError, match="power of two"):
        absorbed_decode(q_nope[..., :6], q_pe, c_kv, k_pe, kv_b[: H * 14], positions, SCALE)
    with pytest.raises(ValueError, match="window"):
        absorbed_decode(q_nope, q_pe, c_kv, k_pe, kv_b, positions, SCALE, window=S + 1)
    with pytest.raises(ValueError, match="power of two"):
        DecodeBlocks(block_s=12)
