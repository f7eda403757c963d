"""The decode MoE's expert prefetch (pallas_kernels/prefetch.py): its boxes cover each expert's rows
inside their bounds, its Mosaic GPU lowering for CUDA on the CPU, its errors. A prefetch changes no
value, so interpret mode runs no kernel; the MoE kernels' ``after`` operand is tested with them
(tests/test_mx_matmul.py) and the layer's wiring in tests/test_pallas_switch.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.prefetch import BOX, box_grid, box_origin, prefetch_experts_l2, prefetchable


@pytest.mark.parametrize("shape", [(768, 512), (1024, 24), (96, 64), (2 * BOX + 8, BOX), (1000, 16)])
def test_boxes_cover_the_slice_inside_its_bounds(shape):
    rows, cols, total = box_grid(shape)
    assert rows <= BOX and cols <= BOX
    seen = np.zeros(shape, bool)
    for row0, col0 in zip(*(np.asarray(a) for a in box_origin(np.arange(total), shape))):
        assert 0 <= row0 <= shape[0] - rows and 0 <= col0 <= shape[1] - cols
        seen[row0 : row0 + rows, col0 : col0 + cols] = True
    assert seen.all()


@pytest.mark.parametrize("experts_shape", [(1, 8), (5, 3)])
def test_lowers_for_cuda_through_mosaic_gpu(experts_shape):
    """mini-like stacks (codes and scales of w1 and w2), 8 pairs or 15 (padded to a 128-byte copy)."""
    stacks = [jax.ShapeDtypeStruct(s, jnp.uint8) for s in [(64, 768, 512), (64, 768, 32), (64, 1024, 384)]]
    fn = lambda *a: prefetch_experts_l2(a[:-1], a[-1], programs=16, interpret=False)
    args = [*stacks, jax.ShapeDtypeStruct(experts_shape, jnp.int32)]
    assert "mosaic_gpu" in jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_what_can_be_prefetched_and_bad_inputs():
    assert prefetchable(jnp.zeros((2, 4, 32), jnp.uint8)) and not prefetchable(jnp.zeros((2, 4, 24), jnp.uint8))
    experts = jnp.zeros((1, 8), jnp.int32)
    with pytest.raises(ValueError, match="at least one stack"):
        prefetch_experts_l2([], experts)
    with pytest.raises(ValueError, match=r"stack 1 must be \[E, N, D\] with rows a multiple of 16 bytes"):
        prefetch_experts_l2([jnp.zeros((2, 4, 32), jnp.uint8), jnp.zeros((2, 4, 24), jnp.uint8)], experts)
    with pytest.raises(ValueError, match="non-empty integer"):
        prefetch_experts_l2([jnp.zeros((2, 4, 32), jnp.uint8)], jnp.zeros((1, 8), jnp.float32))
