"""Operands whose offsets wrap in JAX's Triton lowering (2**31 to 2**32 one-byte elements: 32-bit signed
offsets) never reach a Triton kernel: the grouped MX product takes the Mosaic GPU kernel instead, or raises;
the fused decode MoE gives way to the other MoE paths. Shapes only (``jax.ShapeDtypeStruct``, traced and
lowered, never allocated): such operands are gigabytes."""

import jax
import jax.numpy as jnp
import pytest

from k3jax import use_implementation
from k3jax.mx import MXTensor
from pallas_kernels._triton import offsets_wrap
from pallas_kernels.mx_matmul import grouped_mx_matmul
from pallas_kernels.mx_matmul import ops

U8, BF16 = jnp.uint8, jnp.bfloat16


def shape(*dims, dtype=U8):
    return jax.ShapeDtypeStruct(dims, dtype)


@pytest.mark.parametrize("array, wraps", [
    (shape(2**31), False), (shape(2**31 + 1), True), (shape(2**32), True), (shape(2**32 + 1), False),
    (shape(163840, 7168, dtype=BF16), False),      # K3's output head: 2.35 GB, but 1.2e9 elements
    (shape(2**31 + 1, dtype=BF16), False),          # over 2**32 bytes: 64-bit offsets
    (shape(448, 3072, 1792), True),                 # w1 codes of 448 of K3's experts (measured wrong)
    (shape(384, 3072, 1792), False),                # of 384 (measured right)
    (shape(896, 3072, 1792), False),                # all 896: 64-bit offsets
])
def test_offsets_wrap_by_size(array, wraps):
    assert offsets_wrap(array) is wraps
    assert offsets_wrap(shape(8), array) is wraps


def _grouped(x, codes, scales, sizes):
    """(Each test traces its own lambda around it: jax.jit caches traces by function.)"""
    return grouped_mx_matmul(x, MXTensor(codes, scales, "mxfp4"), sizes, interpret=False)


GROUPED_ARGS = (shape(32, 3584, dtype=BF16), shape(448, 3072, 1792), shape(448, 3072, 112), shape(448, dtype=jnp.int32))


def test_grouped_mx_matmul_wrapping_stack_takes_mosaic_gpu(monkeypatch):
    """Codes of 448 of K3's experts: the grouped product lowers for CUDA through Mosaic GPU, not Triton."""
    monkeypatch.setattr(ops, "mosaic_gpu_runs", lambda: True)
    text = jax.jit(lambda *a: _grouped(*a)).trace(*GROUPED_ARGS).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text and "triton" not in text


def test_grouped_mx_matmul_wrapping_stack_raises_without_mosaic_gpu(monkeypatch):
    monkeypatch.setattr(ops, "mosaic_gpu_runs", lambda: False)
    with pytest.raises(ValueError, match="offsets wrap"):
        jax.jit(lambda *a: _grouped(*a)).trace(*GROUPED_ARGS)


def test_fused_decode_moe_not_for_wrapping_stacks():
    """The fused decode MoE kernels (Triton) index the whole stacks: at `mini`'s widths, where they run at one
    token, over 4096 experts (1.6 GB of w1 codes) but not over 6000 (2.4 GB)."""
    from k3jax.layers.moe import _fused_decode

    stack = lambda e: MXTensor(shape(e, 768, 512), shape(e, 768, 32), "mxfp4")
    with use_implementation("pallas"):
        assert _fused_decode(stack(4096), 1, 8, tiled=False)
        assert not _fused_decode(stack(6000), 1, 8, tiled=False)
