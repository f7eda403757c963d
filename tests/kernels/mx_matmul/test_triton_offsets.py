"""Operands whose offsets wrap in JAX's Triton lowering (2**31 to 2**32 one-byte elements: 32-bit signed
offsets) never reach a Triton kernel: the grouped MX product takes the Mosaic GPU kernel instead, or raises;
the split decode MoE gives way to the other MoE paths. Shapes only (``jax.ShapeDtypeStruct``, traced and
lowered, never allocated): such operands are gigabytes."""

import jax
import jax.numpy as jnp
import pytest

import pallas_kernels._platform
from k3jax import use_implementation
from k3jax.mx import MXTensor
from pallas_kernels._triton import offsets_wrap
from pallas_kernels.moe import triton_split
from pallas_kernels.moe.ops import _split_runs
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
    monkeypatch.setattr(pallas_kernels._platform, "mosaic_gpu_runs", lambda: True)
    text = jax.jit(lambda *a: _grouped(*a)).trace(*GROUPED_ARGS).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text and "triton" not in text


def test_grouped_mx_matmul_wrapping_stack_raises_without_mosaic_gpu(monkeypatch):
    monkeypatch.setattr(pallas_kernels._platform, "mosaic_gpu_runs", lambda: False)
    with pytest.raises(ValueError, match="offsets wrap"):
        jax.jit(lambda *a: _grouped(*a)).trace(*GROUPED_ARGS)


def test_split_moe_not_for_wrapping_stacks():
    """The split decode MoE kernels (Triton) index the whole stacks: at `mini`'s widths, where they run at one
    token, over 4096 experts (1.6 GB of w1 codes) but not over 6000 (2.4 GB)."""
    stack = lambda e: MXTensor(shape(e, 768, 512), shape(e, 768, 32), "mxfp4")
    with use_implementation("pallas"):
        assert _split_runs(stack(4096), 1, 8, tiled=False)
        assert not _split_runs(stack(6000), 1, 8, tiled=False)


def _k3_stacks(experts: int):
    """w1, w3 [E, 3072, 3584] and w2 [E, 3584, 3072]: K3's routed experts, E of them on a device."""
    up = MXTensor(shape(experts, 3072, 1792), shape(experts, 3072, 112), "mxfp4")
    down = MXTensor(shape(experts, 3584, 1536), shape(experts, 3584, 96), "mxfp4")
    return up, up, down


@pytest.mark.parametrize("entry", ["fused_moe_mx_split", "routed_moe_mx_split"])
def test_split_moe_entries_raise_for_wrapping_stacks(entry):
    """Called directly, the split MoE kernels refuse stacks whose offsets wrap (448 of K3's experts), naming the
    operand."""
    x, weights, experts = shape(1, 3584, dtype=BF16), shape(1, 16, dtype=jnp.float32), shape(1, 16, dtype=jnp.int32)
    act = lambda g, u: g * u
    stacks = _k3_stacks(448)
    with pytest.raises(ValueError, match=r"w1\.codes: 2466250752 one-byte elements.* offsets wrap"):
        if entry == "routed_moe_mx_split":
            logits, bias = shape(1, 448, dtype=jnp.float32), shape(448, dtype=jnp.float32)
            triton_split.routed_moe_mx_split(x, *stacks, logits, bias, act, k=16, renormalize=True, scaling_factor=1.0,
                                             interpret=False)
        else:
            triton_split.fused_moe_mx_split(x, *stacks, weights, experts, act, interpret=False)


@pytest.mark.parametrize("rows", [1, 32])
def test_dense_mx_matmul_raises_for_wrapping_weights(rows, monkeypatch):
    """A dense MXFP4 weight of 2**20 x 4608 (2.4e9 code bytes) on the Triton kernels: a ValueError naming it
    (at one row where the Mosaic GPU kernel does not run)."""
    monkeypatch.setattr(pallas_kernels._platform, "mosaic_gpu_runs", lambda: False)
    w = MXTensor(shape(2**20, 2304), shape(2**20, 144), "mxfp4")
    with pytest.raises(ValueError, match=r"w\.codes: 2415919104 one-byte elements"):
        ops.mx_matmul(shape(rows, 4608, dtype=BF16), w, interpret=False)


@pytest.mark.parametrize("rows, groups, bm", [(32, 448, 8), (4096, 448, 8), (2047, 64, 8), (2048, 64, 16),
                                              (32768, 896, 16), (4096, 64, 32), (16384, 64, 64), (65536, 64, 64)])
def test_wrapping_stack_tiles_follow_the_density_rule(rows, groups, bm):
    """The fallback tiles as the tiled MoE does (``default_bm``, half the rows a group holds, as a power of two
    from 8 to 64): 4096 pairs over 448 experts took 3.1 ms in 8-row tiles against 9.6 in 64-row ones (MX run 16),
    K3's 2048-token chunk (32768 over 896) 17.2 ms in 16-row ones against 24.6 in 8 (twenty-eighth session),
    `mini`'s prefill chunk (16384 over 64) is fastest in 64-row tiles."""
    assert ops._mosaic_grouped_blocks(rows, groups).bm == bm
