"""The several-weights matvec kernel (pallas_kernels/matvec.py, interpret mode on CPU) against
jnp.einsum at precision HIGHEST on float32-cast operands, rounded once to the output dtype."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.functional.norms import rms_norm
from pallas_kernels.matvec import MAX_ROWS, MatvecBlocks, matvecs

# bn = 8 (16 in the dot form), bk = 64: N = 5 is below the block, 20 and 13 are not multiples of
# it, D = 200 not of bk.
ROWS, DOT = MatvecBlocks(bn=8, bk=64), MatvecBlocks(bn=16, bk=64, dot=True)
WEIGHTS = [(5, jnp.bfloat16), (20, jnp.float32), (16, jnp.bfloat16), (13, jnp.float32)]
OUT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float32, jnp.float32)


def _reference(x, w, dtype):
    f32 = jnp.float32
    return jnp.einsum("md,nd->mn", x.astype(f32), w.astype(f32), precision=jax.lax.Precision.HIGHEST).astype(dtype)


@pytest.mark.parametrize("m,x_dtype,blocks", [(1, jnp.bfloat16, ROWS), (3, jnp.float32, ROWS),
                                              (3, jnp.bfloat16, DOT)])
def test_matches_einsum_on_random_data(m, x_dtype, blocks):
    depth = 200
    keys = jax.random.split(jax.random.key(m), len(WEIGHTS) + 1)
    x = jax.random.normal(keys[0], (m, depth), jnp.float32).astype(x_dtype)
    weights = [jax.random.normal(k, (n, depth), jnp.float32).astype(d) for k, (n, d) in zip(keys[1:], WEIGHTS)]
    outs = matvecs(x, weights, OUT_DTYPES, blocks=blocks)
    for out, w, dtype in zip(outs, weights, OUT_DTYPES):
        ref = _reference(x, w, dtype)
        assert out.shape == ref.shape and out.dtype == ref.dtype
        tolerance = 1e-5 if dtype == jnp.float32 else 1e-2  # summation order; one bf16 ulp
        np.testing.assert_allclose(np.float32(out), np.float32(ref), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("m,blocks", [(1, ROWS), (3, DOT)])
def test_rms_norm_inside_matches_norm_then_einsum(m, blocks):
    """``norm``: x RMS-normed in the kernel (two bf16 rows of very different scale) against
    ``rms_norm`` then the einsums."""
    depth, eps = 200, 1e-5
    keys = jax.random.split(jax.random.key(10 + m), len(WEIGHTS) + 2)
    x = jax.random.normal(keys[0], (m, depth), jnp.float32) * jnp.array([30.0, 0.01, 1.0])[:m, None]
    x = x.astype(jnp.bfloat16)
    norm_weight = (1.0 + 0.1 * jax.random.normal(keys[1], (depth,))).astype(jnp.bfloat16)
    weights = [jax.random.normal(k, (n, depth), jnp.float32).astype(d) for k, (n, d) in zip(keys[2:], WEIGHTS)]
    outs = matvecs(x, weights, OUT_DTYPES, norm=(norm_weight, eps), blocks=blocks)
    normed = rms_norm(x, norm_weight, eps)
    for out, w, dtype in zip(outs, weights, OUT_DTYPES):
        tolerance = 1e-5 if dtype == jnp.float32 else 1e-2
        np.testing.assert_allclose(np.float32(out), np.float32(_reference(normed, w, dtype)), rtol=tolerance,
                                   atol=tolerance)


@pytest.mark.parametrize("blocks,norm", [(MatvecBlocks(), False), (MatvecBlocks(bn=16, dot=True), True)])
def test_lowers_for_cuda_through_triton(blocks, norm):
    """Pallas' Triton lowering of the kernel (masked row and column tiles, two dtypes, with and without
    the RMSNorm), on the CPU."""
    args = [jax.ShapeDtypeStruct(s, d) for s, d in
            [((3, 2000), jnp.bfloat16), ((100, 2000), jnp.float32), ((16, 2000), jnp.bfloat16)]]
    rms = (jnp.ones((2000,), jnp.float32), 1e-6) if norm else None
    fn = lambda x, *w: matvecs(x, w, (jnp.float32, jnp.bfloat16), norm=rms, blocks=blocks, interpret=False)
    assert "xla.gpu.triton" in jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_bad_inputs_are_refused():
    x = jnp.zeros((2, 64), jnp.bfloat16)
    w = jnp.zeros((8, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="1 <= M"):
        matvecs(jnp.zeros((MAX_ROWS + 1, 64), jnp.bfloat16), [w])
    with pytest.raises(ValueError, match="D = 64"):
        matvecs(x, [w, jnp.zeros((8, 32), jnp.bfloat16)])
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        matvecs(x, [w.astype(jnp.float16)])
    with pytest.raises(ValueError, match="out_dtypes"):
        matvecs(x, [w, w], [jnp.float32])
    with pytest.raises(ValueError, match="norm weight"):
        matvecs(x, [w], norm=(jnp.ones((32,)), 1e-6))
    with pytest.raises(ValueError, match="at least one"):
        matvecs(x, [])
    with pytest.raises(ValueError, match="power of two"):
        MatvecBlocks(bn=12)
    with pytest.raises(ValueError, match="bn and bk >= 16"):
        MatvecBlocks(bn=8, dot=True)
