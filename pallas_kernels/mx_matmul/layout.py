"""What the MX matmul lowerings share: operand checks, padding and the kernels' weight layout, tile
fitting, the grouped work items. Every lowering of this folder (and the MoE kernels) imports it; it
imports none of them."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from k3jax.mx import BLOCK, ZERO_BLOCK_SCALE_BYTE, MXTensor
from k3jax.typing import Array
from pallas_kernels import _platform
from pallas_kernels.mx_matmul.triton import SCALE_BLOCK_BYTES, MXBlocks

MIN_TILE = 16  # smallest M and N tile of a GPU matrix instruction


def largest_pow2_divisor(n: int, cap: int) -> int:
    """Largest power of two <= cap that divides n."""
    p = 1
    while p * 2 <= cap and n % (p * 2) == 0:
        p *= 2
    return p


def fit_blocks(blocks: MXBlocks, m: int, n: int, k: int) -> MXBlocks:
    """Shrink tiles to the shape: bm <= next power of two of M (bm >= 16, or 1 with gemv), bn | N,
    bk | K (bk >= 32)."""
    bm = 1 if blocks.gemv else max(MIN_TILE, min(blocks.bm, 1 << max(m - 1, 1).bit_length()))
    bn = max(MIN_TILE, largest_pow2_divisor(n, blocks.bn))
    bk = max(BLOCK, largest_pow2_divisor(k, max(blocks.bk, BLOCK)))
    return dataclasses.replace(blocks, bm=bm, bn=bn, bk=bk)


def check_operands(x: Array | MXTensor, w: MXTensor, w_ndim: int) -> tuple[int, int, int]:
    if not isinstance(w, MXTensor) or w.format != "mxfp4" or w.ndim != w_ndim:
        raise ValueError(f"w must be an MXFP4 MXTensor of rank {w_ndim}, got {w!r:.200}")
    if isinstance(x, MXTensor) and x.format != "mxfp8":
        raise ValueError(f"x as an MXTensor must be MXFP8 (W4A8), got {x.format}")
    m, k = x.shape
    n, wk = w.shape[-2:]
    if wk != k:
        raise ValueError(f"x [M, K] = {tuple(x.shape)} and w [..., N, K] = {w.shape} disagree on K")
    if k % BLOCK:
        raise ValueError(f"K = {k} must be a multiple of {BLOCK}")
    return m, n, k


def check_grouped(x: Array | MXTensor, w: MXTensor, group_sizes: Array) -> tuple[int, int, int, int]:
    """``check_operands`` for a stack w [G, N, K] and group_sizes [G]; returns (M, N, K, G)."""
    m, n, k = check_operands(x, w, 3)
    g = w.shape[0]
    if group_sizes.shape != (g,):
        raise ValueError(f"group_sizes must be [G] = [{g}], got {group_sizes.shape}")
    return m, n, k, g


def pad_axis(a: Array, axis: int, size: int, value) -> Array:
    pad = size - a.shape[axis]
    if pad == 0:
        return a
    widths = [(0, 0)] * a.ndim
    widths[axis] = (0, pad)
    return jnp.pad(a, widths, constant_values=value)


def kernel_weight_layout(w: MXTensor, n_pad: int) -> tuple[Array, Array]:
    """Pad weight rows to n_pad (zero codes, unit scales) and view codes [..., N, K/2] as
    [..., N, K/32, 16] and scales [..., N, K/32] as [..., N, K/32, 1] (free reshapes), so a
    kernel's scale broadcast is over a size-1 axis."""
    codes = pad_axis(w.codes, w.ndim - 2, n_pad, 0)
    scales = pad_axis(w.scales, w.ndim - 2, n_pad, ZERO_BLOCK_SCALE_BYTE)
    codes = codes.reshape(*codes.shape[:-1], codes.shape[-1] // SCALE_BLOCK_BYTES, SCALE_BLOCK_BYTES)
    return codes, scales[..., None]


def prepare_operands(x: Array | MXTensor, w: MXTensor, m_pad: int, n_pad: int):
    """Pad rows of x to m_pad, split x into its even and odd columns [M, K/2], the elements the low
    and high nibbles of each code byte meet; weights in the kernel layout."""
    if isinstance(x, MXTensor):
        xv, xs = pad_axis(x.codes, 0, m_pad, 0), pad_axis(x.scales, 0, m_pad, ZERO_BLOCK_SCALE_BYTE)
    else:
        xv, xs = pad_axis(x.astype(jnp.bfloat16), 0, m_pad, 0), None
    return (xv[:, 0::2], xv[:, 1::2], xs, *kernel_weight_layout(w, n_pad))


def resolve_dtype(x, out_dtype, interpret):
    if out_dtype is None:
        out_dtype = jnp.bfloat16 if isinstance(x, MXTensor) else x.dtype
    return jnp.dtype(out_dtype), _platform.interpret() if interpret is None else interpret


def as_bf16(x: Array | MXTensor) -> Array:
    """x as bf16: an MXFP8 ``MXTensor`` decoded (exactly), an array rounded."""
    return x.decode(jnp.bfloat16) if isinstance(x, MXTensor) else x.astype(jnp.bfloat16)


def named_operands(x: Array | MXTensor, w: MXTensor) -> dict:
    """The one-byte arrays a Triton MX kernel indexes, by name (``check_offsets``)."""
    named = {"w.codes": w.codes, "w.scales": w.scales}
    if isinstance(x, MXTensor):
        named |= {"x.codes": x.codes, "x.scales": x.scales}
    return named


def work_items(group_sizes: Array, m: int, bm: int, n_items: int) -> Array:
    """group_sizes int32 [G] -> int32 [4, n_items]: (group, row tile, first row, end row) per item.

    One item per (group, row tile) pair that the group's rows touch (with bm = 1: one per row);
    unused items have an empty row range. A group's rows are [start, end) with start = cumsum -
    size, clipped to M.
    """
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.minimum(jnp.cumsum(sizes), m)
    starts = jnp.minimum(ends, jnp.cumsum(sizes) - sizes)
    first_tile = starts // bm
    n_tiles = jnp.where(ends > starts, (ends - 1) // bm - first_tile + 1, 0)
    item_offset = jnp.cumsum(n_tiles) - n_tiles
    groups = jnp.arange(sizes.shape[0], dtype=jnp.int32)
    group = jnp.repeat(groups, n_tiles, total_repeat_length=n_items)
    index = jnp.arange(n_items, dtype=jnp.int32)
    tile = first_tile[group] + index - item_offset[group]
    valid = index < jnp.sum(n_tiles)
    lo = jnp.where(valid, jnp.maximum(starts[group], tile * bm), 0)
    hi = jnp.where(valid, jnp.minimum(ends[group], (tile + 1) * bm), 0)
    return jnp.stack([group, jnp.where(valid, tile, 0), lo, hi]).astype(jnp.int32)


__all__ = ["MIN_TILE", "as_bf16", "check_grouped", "check_operands", "fit_blocks", "kernel_weight_layout",
           "largest_pow2_divisor", "named_operands", "pad_axis", "prepare_operands", "resolve_dtype", "work_items"]
