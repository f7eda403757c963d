"""Pallas MX matmul kernels (interpret mode on CPU) against the decode-then-dot references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.mx import MXTensor
from pallas_kernels.mx_matmul import (
    MXBlocks,
    grouped_mx_matmul,
    grouped_mx_matmul_reference,
    mx_matmul,
    mx_matmul_reference,
)
from reference_numpy import rel_err

# Small tiles so that every kernel loops over several row, column and contracted tiles.
SMALL = MXBlocks(bm=16, bn=32, bk=64)
N, K = 96, 160  # K = 5 scale blocks: not a power of two, not a multiple of bk


def bf16_normal(key, shape):
    """Random activations that bf16 holds exactly (the kernels feed bf16 to the matrix units)."""
    return jax.random.normal(key, shape, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32)


@pytest.fixture(scope="module")
def weight():
    return MXTensor.quantize(jax.random.normal(jax.random.key(10), (N, K)) * 0.05)


@pytest.mark.parametrize("m", [1, 7, 100])
def test_mx_matmul_matches_reference(weight, m):
    x = bf16_normal(jax.random.key(m), (m, K))
    out = mx_matmul(x, weight, blocks=SMALL)
    assert out.shape == (m, N) and out.dtype == jnp.float32
    assert rel_err(out, mx_matmul_reference(x, weight)) < 1e-5


def test_mx_matmul_bf16_input_default_blocks(weight):
    x = bf16_normal(jax.random.key(3), (7, K)).astype(jnp.bfloat16)
    out = mx_matmul(x, weight)
    assert out.dtype == jnp.bfloat16
    assert rel_err(out, mx_matmul_reference(x, weight)) < 1e-2  # bf16 output rounding


def test_mx_matmul_w4a8_equals_quantize_then_reference(weight):
    x = jax.random.normal(jax.random.key(4), (7, K)) * 3.0
    xq = MXTensor.quantize(x, "mxfp8")
    out = mx_matmul(xq, weight, blocks=SMALL, out_dtype=jnp.float32)
    assert rel_err(out, mx_matmul_reference(xq, weight)) < 1e-5
    assert rel_err(out, mx_matmul_reference(x, weight)) < 0.1  # MXFP8 activations stay close


def test_awkward_n_is_padded():
    w = MXTensor.quantize(jax.random.normal(jax.random.key(5), (40, 96)))  # 40 = 16 * 2.5
    x = bf16_normal(jax.random.key(6), (7, 96))
    assert rel_err(mx_matmul(x, w, blocks=SMALL), mx_matmul_reference(x, w)) < 1e-5


G = 6
GROUP_SIZES = jnp.array([7, 0, 20, 0, 1, 15], jnp.int32)  # empty experts; sums to 43 < M = 50


@pytest.fixture(scope="module")
def experts():
    return MXTensor.quantize(jax.random.normal(jax.random.key(11), (G, N, K)) * 0.05)


def test_grouped_matches_ragged_reference(experts):
    m = 50
    x = bf16_normal(jax.random.key(7), (m, K))
    out = grouped_mx_matmul(x, experts, GROUP_SIZES, blocks=SMALL)
    ref = grouped_mx_matmul_reference(x, experts, GROUP_SIZES)
    assert out.shape == (m, N)
    assert rel_err(out, ref) < 1e-5
    assert not np.asarray(out[43:]).any()  # rows past sum(group_sizes) are zero
    for g, (start, size) in enumerate(zip(np.cumsum(GROUP_SIZES) - GROUP_SIZES, GROUP_SIZES)):
        if size:  # each group's rows multiply its own expert
            rows = slice(int(start), int(start + size))
            assert rel_err(out[rows], mx_matmul_reference(x[rows], experts_at(experts, g))) < 1e-5


def experts_at(w: MXTensor, g: int) -> MXTensor:
    return jax.tree_util.tree_map(lambda a: a[g], w)


def test_grouped_w4a8_equals_quantize_then_reference(experts):
    xq = MXTensor.quantize(jax.random.normal(jax.random.key(8), (50, K)), "mxfp8")
    out = grouped_mx_matmul(xq, experts, GROUP_SIZES, blocks=SMALL, out_dtype=jnp.float32)
    assert rel_err(out, grouped_mx_matmul_reference(xq, experts, GROUP_SIZES)) < 1e-5


def test_grouped_group_spanning_tiles_with_default_blocks(experts):
    sizes = jnp.array([0, 33, 0, 0, 2, 0], jnp.int32)  # one group over three 16-row tiles
    x = bf16_normal(jax.random.key(9), (35, K))
    out = grouped_mx_matmul(x, experts, sizes)
    assert rel_err(out, grouped_mx_matmul_reference(x, experts, sizes)) < 1e-5


def test_shape_errors(weight, experts):
    with pytest.raises(ValueError, match="disagree on K"):
        mx_matmul(jnp.ones((4, 64)), weight)
    with pytest.raises(ValueError, match="rank 3"):
        grouped_mx_matmul(jnp.ones((4, K)), weight, GROUP_SIZES)
    with pytest.raises(ValueError, match=r"group_sizes must be \[G\]"):
        grouped_mx_matmul(jnp.ones((4, K)), experts, GROUP_SIZES[:3])
