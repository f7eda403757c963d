"""Public entry points of the MX matmuls (forward only, no gradients offered).

``mx_matmul(x, w)``: x [M, K] times an MXFP4 weight [N, K] (PyTorch [out, in] layout) -> [M, N].
``grouped_mx_matmul(x, w, group_sizes)``: rows of x sorted by group, w MXFP4 [G, N, K]; rows of
group g multiply w[g]; groups may be empty; rows past sum(group_sizes) give zeros.

x is either a float array (W4A16: rounded to bf16 for the matrix units) or an MXFP8 ``MXTensor``
(W4A8). Interpret mode is chosen by ``k3jax.implementation.pallas_interpret()`` (True on CPU)
unless ``interpret=`` is given.

Dispatch by M (``default_blocks``): up to ``DECODE_THEN_DOT_MIN_M`` rows the fused kernel
decodes each weight tile in registers (weight streaming; transposed product for small M); from
there on (dense only) the weight is decoded once into a bf16 copy by ``decode_mxfp4_pallas`` and
XLA's bf16 dot (cuBLAS) does the product, since a fused kernel decodes every weight tile again for
each row tile. A single dense row (M = 1) runs the one-row kernel (``MXBlocks.gemv``, no matrix
unit), measured 13% faster there; the grouped kernel keeps the dot path at every M (the one-row
grouped kernel measured 2-5% slower at batch 1). On a GPU under JAX >= 0.11, dense M <= 16 runs the
Mosaic GPU kernel instead (``MXBlocks.mosaic_gpu``, ``mosaic_gpu.py``: weights decoded in registers
straight into wgmma's operand layout; H200: 49 us against 71-80 us for the Triton kernels).

Lowering (``lowering=``): "triton" runs the kernels above, "mosaic_tpu" the Mosaic TPU kernels of
``tpu.py`` (blocks: a ``tpu.TPUBlocks``; TPU interpret mode off a TPU), "auto" (default) the TPU
kernels on a TPU and Triton elsewhere.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from k3jax.implementation import jax_at_least, pallas_interpret
from k3jax.mx import BLOCK, ZERO_BLOCK_SCALE_BYTE, MXTensor
from k3jax.typing import Array
from pallas_kernels._mosaic_gpu import interpret_argument
from pallas_kernels._triton import check_offsets, offsets_wrap
from pallas_kernels.mx_matmul.kernel import (
    SCALE_BLOCK_BYTES,
    MXBlocks,
    decode_mxfp4_pallas,
    grouped_mx_matmul_pallas,
    mx_matmul_pallas,
)

_MIN_TILE = 16  # smallest M and N tile of a GPU matrix instruction
LOWERINGS = ("auto", "triton", "mosaic_tpu")
DECODE_THEN_DOT_MIN_M = 512  # dense rows from which decode-then-cuBLAS beats the fused kernel
MOSAIC_GPU_MAX_M = 16  # dense rows up to which the Mosaic GPU kernel is the default (measured: 1, 16)


def mosaic_gpu_runs() -> bool:
    """Whether the Mosaic GPU kernel (``mosaic_gpu.py``) is the dense default for few rows: on a GPU
    under JAX >= 0.11, where it was measured (Pallas' Mosaic GPU backend of JAX 0.10 is untried)."""
    return jax_at_least(0, 11) and jax.default_backend() == "gpu"


def default_blocks(m: int, grouped: bool = False) -> MXBlocks:
    """Tile sizes and method by the number of rows M, the best of the H200 sweep in
    benchmarks/RESULTS.md at dense M = 1, 16, 512, 4096 and grouped decode / prefill; the rows
    between (dense 17..511) are unmeasured."""
    if m <= MOSAIC_GPU_MAX_M and not grouped and mosaic_gpu_runs():
        return MXBlocks(bk=256, num_stages=2, mosaic_gpu=True)
    if m == 1 and not grouped:
        return MXBlocks(bm=1, bn=32, bk=256, num_warps=4, num_stages=3, gemv=True)
    if grouped:
        if m <= 4096:
            return MXBlocks(bm=16, bn=64, bk=256, num_warps=4, num_stages=3)
        return MXBlocks(bm=128, bn=128, bk=64, num_warps=4, num_stages=4)
    if m <= 16:
        return MXBlocks(bm=16, bn=64, bk=256, num_warps=4, num_stages=3, weights_lhs=True)
    if m <= 128:
        return MXBlocks(bm=32, bn=64, bk=256, num_warps=4, num_stages=3, weights_lhs=True)
    if m < DECODE_THEN_DOT_MIN_M:
        return MXBlocks(bm=128, bn=128, bk=64, num_warps=4, num_stages=4)
    return MXBlocks(bn=32, bk=512, num_warps=4, decode_then_dot=True)


def _largest_pow2_divisor(n: int, cap: int) -> int:
    """Largest power of two <= cap that divides n."""
    p = 1
    while p * 2 <= cap and n % (p * 2) == 0:
        p *= 2
    return p


def _fit_blocks(blocks: MXBlocks, m: int, n: int, k: int) -> MXBlocks:
    """Shrink tiles to the shape: bm <= next power of two of M (bm >= 16, or 1 with gemv), bn | N,
    bk | K (bk >= 32)."""
    bm = 1 if blocks.gemv else max(_MIN_TILE, min(blocks.bm, 1 << max(m - 1, 1).bit_length()))
    bn = max(_MIN_TILE, _largest_pow2_divisor(n, blocks.bn))
    bk = max(BLOCK, _largest_pow2_divisor(k, max(blocks.bk, BLOCK)))
    return dataclasses.replace(blocks, bm=bm, bn=bn, bk=bk)


def _check(x: Array | MXTensor, w: MXTensor, w_ndim: int) -> tuple[int, int, int]:
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


def _check_grouped(x: Array | MXTensor, w: MXTensor, group_sizes: Array) -> tuple[int, int, int, int]:
    """``_check`` for a stack w [G, N, K] and group_sizes [G]; returns (M, N, K, G)."""
    m, n, k = _check(x, w, 3)
    g = w.shape[0]
    if group_sizes.shape != (g,):
        raise ValueError(f"group_sizes must be [G] = [{g}], got {group_sizes.shape}")
    return m, n, k, g


def _pad_axis(a: Array, axis: int, size: int, value) -> Array:
    pad = size - a.shape[axis]
    if pad == 0:
        return a
    widths = [(0, 0)] * a.ndim
    widths[axis] = (0, pad)
    return jnp.pad(a, widths, constant_values=value)


def _kernel_weight_layout(w: MXTensor, n_pad: int) -> tuple[Array, Array]:
    """Pad weight rows to n_pad (zero codes, unit scales) and view codes [..., N, K/2] as
    [..., N, K/32, 16] and scales [..., N, K/32] as [..., N, K/32, 1] (free reshapes), so a
    kernel's scale broadcast is over a size-1 axis."""
    codes = _pad_axis(w.codes, w.ndim - 2, n_pad, 0)
    scales = _pad_axis(w.scales, w.ndim - 2, n_pad, ZERO_BLOCK_SCALE_BYTE)
    codes = codes.reshape(*codes.shape[:-1], codes.shape[-1] // SCALE_BLOCK_BYTES, SCALE_BLOCK_BYTES)
    return codes, scales[..., None]


def _prepare(x: Array | MXTensor, w: MXTensor, m_pad: int, n_pad: int):
    """Pad rows of x to m_pad, split x into its even and odd columns [M, K/2], the elements the low
    and high nibbles of each code byte meet; weights in the kernel layout."""
    if isinstance(x, MXTensor):
        xv, xs = _pad_axis(x.codes, 0, m_pad, 0), _pad_axis(x.scales, 0, m_pad, ZERO_BLOCK_SCALE_BYTE)
    else:
        xv, xs = _pad_axis(x.astype(jnp.bfloat16), 0, m_pad, 0), None
    return (xv[:, 0::2], xv[:, 1::2], xs, *_kernel_weight_layout(w, n_pad))


def _mosaic_tpu(lowering: str) -> bool:
    """Whether ``lowering`` picks the Mosaic TPU kernels ("auto": on a TPU)."""
    if lowering not in LOWERINGS:
        raise ValueError(f"lowering {lowering!r}; expected one of {LOWERINGS}")
    return lowering == "mosaic_tpu" or (lowering == "auto" and jax.default_backend() == "tpu")


def _resolve(x, out_dtype, interpret):
    if out_dtype is None:
        out_dtype = jnp.bfloat16 if isinstance(x, MXTensor) else x.dtype
    return jnp.dtype(out_dtype), pallas_interpret() if interpret is None else interpret


def _bf16(x: Array | MXTensor) -> Array:
    """x as bf16: an MXFP8 ``MXTensor`` decoded (exactly), an array rounded."""
    return x.decode(jnp.bfloat16) if isinstance(x, MXTensor) else x.astype(jnp.bfloat16)


def _decode_then_dot(x, w: MXTensor, blocks: MXBlocks, n_pad: int, out_dtype, interpret: bool) -> Array:
    """Decode w once to bf16 [N, K] (even columns, then odd) with the Pallas decode kernel, and
    multiply x with its columns in the same order by XLA's bf16 dot (float32 accumulation)."""
    n, k = w.shape
    w_planar = decode_mxfp4_pallas(*_kernel_weight_layout(w, n_pad), blocks=blocks, interpret=interpret)
    xv = _bf16(x)
    x_planar = jnp.concatenate([xv[:, 0::2], xv[:, 1::2]], axis=1)
    out = jnp.dot(x_planar, w_planar.reshape(n_pad, k).T, preferred_element_type=jnp.float32)
    return out[:, :n].astype(out_dtype)


def _mosaic_gpu(x, w: MXTensor, blocks: MXBlocks, out_dtype, interpret: bool) -> Array:
    """The Mosaic GPU kernel (``mosaic_gpu.py``) on x decoded to bf16 (exact for MXFP8 x); one row of x
    takes ``out_mn`` (the kernel writes [1, N], measured faster there only)."""
    from pallas_kernels.mx_matmul import mosaic_gpu

    xv = _bf16(x)
    mosaic_blocks = mosaic_gpu.MosaicBlocks(blocks.bk, blocks.num_stages, out_mn=xv.shape[0] == 1)
    return mosaic_gpu.mx_matmul_mosaic(xv, w.codes, w.scales, blocks=mosaic_blocks, out_dtype=out_dtype,
                                       interpret=interpret_argument(interpret))


def _mx_operands(x: Array | MXTensor, w: MXTensor) -> dict:
    """The one-byte arrays a Triton MX kernel indexes, by name (``check_offsets``)."""
    named = {"w.codes": w.codes, "w.scales": w.scales}
    if isinstance(x, MXTensor):
        named |= {"x.codes": x.codes, "x.scales": x.scales}
    return named


@functools.partial(jax.jit, static_argnames=("blocks", "out_dtype", "interpret"))
def _mx_matmul(x, w, *, blocks, out_dtype, interpret):
    m, n, k = _check(x, w, 2)
    if blocks.mosaic_gpu:
        return _mosaic_gpu(x, w, blocks, out_dtype, interpret)
    n_pad = -(-n // _MIN_TILE) * _MIN_TILE
    b = _fit_blocks(blocks, m, n_pad, k)
    if b.decode_then_dot:
        return _decode_then_dot(x, w, b, n_pad, out_dtype, interpret)
    m_pad = -(-m // b.bm) * b.bm
    x_even, x_odd, xs, codes, scales = _prepare(x, w, m_pad, n_pad)
    out = mx_matmul_pallas(x_even, x_odd, xs, codes, scales, blocks=b, out_dtype=out_dtype, interpret=interpret)
    return out[:m, :n]


def mx_matmul(
    x: Array | MXTensor,
    w: MXTensor,
    *,
    blocks: MXBlocks | None = None,
    out_dtype=None,
    interpret: bool | None = None,
    lowering: str = "auto",
) -> Array:
    """x [M, K] (bf16/f32, or MXFP8 ``MXTensor`` for W4A8) times MXFP4 w [N, K] -> [M, N].

    blocks defaults to ``default_blocks(M)``, which also picks the method (module docstring).
    out_dtype defaults to x's dtype (bf16 for MXFP8 x); accumulation is float32. lowering: "auto",
    "triton" or "mosaic_tpu" (module docstring). Operands whose offsets wrap in the Triton kernels
    (``offsets_wrap``: 2**31 to 2**32 one-byte elements) raise a ValueError outside the Mosaic GPU kernel.
    """
    if _mosaic_tpu(lowering):
        from pallas_kernels.mx_matmul import tpu  # tpu.py imports this module

        return tpu.mx_matmul(x, w, blocks=blocks, out_dtype=out_dtype, interpret=interpret)
    out_dtype, interpret = _resolve(x, out_dtype, interpret)
    blocks = blocks or default_blocks(x.shape[0])
    if not (blocks.mosaic_gpu or interpret):
        check_offsets("the Mosaic GPU kernel (MXBlocks(mosaic_gpu=True), up to 64 rows of x) takes them, or "
                      "products over slices of the rows", **_mx_operands(x, w))
    return _mx_matmul(x, w, blocks=blocks, out_dtype=out_dtype, interpret=interpret)


def _work_items(group_sizes: Array, m: int, bm: int, n_items: int) -> Array:
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


def _mosaic_grouped_blocks(m: int, groups: int) -> MXBlocks:
    """The grouped Mosaic GPU kernel's tiles for m rows over ``groups`` groups (``default_bm``, as the tiled
    MoE's)."""
    from pallas_kernels.mx_matmul.mosaic_gpu_grouped import DEFAULT_BLOCKS, default_bm

    return MXBlocks(bm=default_bm(m, groups), bk=DEFAULT_BLOCKS.bk, num_stages=DEFAULT_BLOCKS.stages, mosaic_gpu=True)


def _grouped_mosaic_gpu(x, w: MXTensor, group_sizes, blocks: MXBlocks, out_dtype, interpret: bool) -> Array:
    """The grouped Mosaic GPU kernel (``mosaic_gpu_grouped.py``, blocks.bm x rows per tile) on x decoded to
    bf16 (exact for MXFP8 x)."""
    from pallas_kernels.mx_matmul import mosaic_gpu, mosaic_gpu_grouped

    xv = _bf16(x)
    return mosaic_gpu_grouped.grouped_mx_matmul_mosaic(
        xv, w.codes, w.scales, group_sizes, bm=blocks.bm, blocks=mosaic_gpu.MosaicBlocks(blocks.bk, blocks.num_stages),
        out_dtype=out_dtype, interpret=interpret_argument(interpret))


@functools.partial(jax.jit, static_argnames=("blocks", "out_dtype", "interpret"))
def _grouped_mx_matmul(x, w, group_sizes, *, blocks, out_dtype, interpret):
    m, n, k, g = _check_grouped(x, w, group_sizes)
    if blocks.decode_then_dot:
        raise ValueError("decode_then_dot is dense only; grouped_mx_matmul always runs the fused kernel")
    if blocks.mosaic_gpu:
        return _grouped_mosaic_gpu(x, w, group_sizes, blocks, out_dtype, interpret)
    n_pad = -(-n // _MIN_TILE) * _MIN_TILE
    b = _fit_blocks(blocks, m, n_pad, k)
    m_pad = -(-m // b.bm) * b.bm
    # Each extra non-empty group adds at most one item (a row tile it shares); one-row tiles
    # are never shared.
    n_items = m_pad // b.bm + (min(g, m) - 1 if b.bm > 1 else 0)
    items = _work_items(group_sizes, m, b.bm, n_items)
    x_even, x_odd, xs, codes, scales = _prepare(x, w, m_pad, n_pad)
    out = grouped_mx_matmul_pallas(
        items, x_even, x_odd, xs, codes, scales, blocks=b, out_dtype=out_dtype, interpret=interpret
    )
    covered = jnp.arange(m)[:, None] < jnp.sum(group_sizes)
    return jnp.where(covered, out[:m, :n], jnp.zeros((), out_dtype))


def grouped_mx_matmul(
    x: Array | MXTensor,
    w: MXTensor,
    group_sizes: Array,
    *,
    blocks: MXBlocks | None = None,
    out_dtype=None,
    interpret: bool | None = None,
    lowering: str = "auto",
) -> Array:
    """Ragged MX matmul: x [M, K] rows sorted by group, MXFP4 w [G, N, K], group_sizes int32 [G]
    -> [M, N]; rows of group g multiply w[g]; rows past sum(group_sizes) are zero.

    x is bf16/f32 (W4A16) or an MXFP8 ``MXTensor`` (W4A8); out_dtype defaults to x's dtype (bf16
    for MXFP8 x); accumulation is float32. lowering as in ``mx_matmul``. Stacks whose offsets wrap in the
    Triton kernel (``offsets_wrap``: 2**31 to 2**32 bytes of codes, such as 391 to 780 of K3's experts on
    a device) take the grouped Mosaic GPU kernel; where it does not run, a ValueError.
    """
    if _mosaic_tpu(lowering):
        from pallas_kernels.mx_matmul import tpu  # tpu.py imports this module

        return tpu.grouped_mx_matmul(x, w, group_sizes, blocks=blocks, out_dtype=out_dtype, interpret=interpret)
    out_dtype, interpret = _resolve(x, out_dtype, interpret)
    blocks = blocks or default_blocks(x.shape[0], grouped=True)
    operands = _mx_operands(x, w)
    if not (blocks.mosaic_gpu or interpret) and offsets_wrap(*operands.values()):
        if not mosaic_gpu_runs():
            check_offsets("the grouped Mosaic GPU kernel, which takes them, does not run here", **operands)
        blocks = _mosaic_grouped_blocks(x.shape[0], w.shape[0])
    return _grouped_mx_matmul(x, w, group_sizes, blocks=blocks, out_dtype=out_dtype, interpret=interpret)


__all__ = ["LOWERINGS", "MXBlocks", "default_blocks", "grouped_mx_matmul", "mx_matmul"]
