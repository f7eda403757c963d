"""Public entry points of the MX matmuls (forward only, no gradients offered).

``mx_matmul(x, w)``: x [M, K] times an MXFP4 weight [N, K] (PyTorch [out, in] layout) -> [M, N].
``grouped_mx_matmul(x, w, group_sizes)``: rows of x sorted by group, w MXFP4 [G, N, K]; rows of
group g multiply w[g]; groups may be empty; rows past sum(group_sizes) give zeros.

x is either a float array (W4A16: rounded to bf16 for the matrix units) or an MXFP8 ``MXTensor``
(W4A8). Interpret mode is chosen by ``pallas_kernels._platform.interpret()`` (True on CPU)
unless ``interpret=`` is given.

Dispatch by M (``default_blocks``): up to ``KernelPolicy.mx_decode_then_dot_min_rows`` rows the fused kernel
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

import functools

import jax
import jax.numpy as jnp

from k3jax.implementation import current
from k3jax.mx import MXTensor
from k3jax.typing import Array
from pallas_kernels import _platform
from pallas_kernels._mosaic_gpu import interpret_argument
from pallas_kernels._triton import check_offsets, offsets_wrap
from pallas_kernels.mx_matmul import mosaic_gpu, mosaic_gpu_grouped, tpu
from pallas_kernels.mx_matmul.layout import (MIN_TILE, as_bf16, check_grouped, check_operands, fit_blocks,
                                             kernel_weight_layout, named_operands, prepare_operands, resolve_dtype,
                                             work_items)
from pallas_kernels.mx_matmul.triton import MXBlocks, decode_mxfp4_pallas, grouped_mx_matmul_pallas, mx_matmul_pallas

LOWERINGS = ("auto", "triton", "mosaic_tpu")


def default_blocks(m: int, grouped: bool = False) -> MXBlocks:
    """Tile sizes and method by the number of rows M, the best of the H200 sweeps (benchmarks/HISTORY.md,
    2026-11-30 and 2026-12-01) at dense M = 1, 16, 512, 4096 and grouped decode / prefill; the rows between (dense
    17..511) are unmeasured. The Mosaic GPU kernel and decode-then-dot by ``KernelPolicy``."""
    policy = current().policy
    if m <= policy.mx_mosaic_gpu_max_rows and not grouped and _platform.mosaic_gpu_runs():
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
    if m < policy.mx_decode_then_dot_min_rows:
        return MXBlocks(bm=128, bn=128, bk=64, num_warps=4, num_stages=4)
    return MXBlocks(bn=32, bk=512, num_warps=4, decode_then_dot=True)


def _mosaic_tpu(lowering: str) -> bool:
    """Whether ``lowering`` picks the Mosaic TPU kernels ("auto": on a TPU)."""
    if lowering not in LOWERINGS:
        raise ValueError(f"lowering {lowering!r}; expected one of {LOWERINGS}")
    return lowering == "mosaic_tpu" or (lowering == "auto" and jax.default_backend() == "tpu")


def _decode_then_dot(x, w: MXTensor, blocks: MXBlocks, n_pad: int, out_dtype, interpret: bool) -> Array:
    """Decode w once to bf16 [N, K] (even columns, then odd) with the Pallas decode kernel, and
    multiply x with its columns in the same order by XLA's bf16 dot (float32 accumulation)."""
    n, k = w.shape
    w_planar = decode_mxfp4_pallas(*kernel_weight_layout(w, n_pad), blocks=blocks, interpret=interpret)
    xv = as_bf16(x)
    x_planar = jnp.concatenate([xv[:, 0::2], xv[:, 1::2]], axis=1)
    out = jnp.dot(x_planar, w_planar.reshape(n_pad, k).T, preferred_element_type=jnp.float32)
    return out[:, :n].astype(out_dtype)


def _mosaic_gpu(x, w: MXTensor, blocks: MXBlocks, out_dtype, interpret: bool) -> Array:
    """The Mosaic GPU kernel (``mosaic_gpu.py``) on x decoded to bf16 (exact for MXFP8 x); one row of x
    takes ``out_mn`` (the kernel writes [1, N], measured faster there only)."""
    xv = as_bf16(x)
    mosaic_blocks = mosaic_gpu.MosaicBlocks(blocks.bk, blocks.num_stages, out_mn=xv.shape[0] == 1)
    return mosaic_gpu.mx_matmul_mosaic(xv, w.codes, w.scales, blocks=mosaic_blocks, out_dtype=out_dtype,
                                       interpret=interpret_argument(interpret))


@functools.partial(jax.jit, static_argnames=("blocks", "out_dtype", "interpret"))
def _mx_matmul(x, w, *, blocks, out_dtype, interpret):
    m, n, k = check_operands(x, w, 2)
    if blocks.mosaic_gpu:
        return _mosaic_gpu(x, w, blocks, out_dtype, interpret)
    n_pad = -(-n // MIN_TILE) * MIN_TILE
    b = fit_blocks(blocks, m, n_pad, k)
    if b.decode_then_dot:
        return _decode_then_dot(x, w, b, n_pad, out_dtype, interpret)
    m_pad = -(-m // b.bm) * b.bm
    x_even, x_odd, xs, codes, scales = prepare_operands(x, w, m_pad, n_pad)
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
        return tpu.mx_matmul(x, w, blocks=blocks, out_dtype=out_dtype, interpret=interpret)
    out_dtype, interpret = resolve_dtype(x, out_dtype, interpret)
    blocks = blocks or default_blocks(x.shape[0])
    if not (blocks.mosaic_gpu or interpret):
        check_offsets("the Mosaic GPU kernel (MXBlocks(mosaic_gpu=True), up to 64 rows of x) takes them, or "
                      "products over slices of the rows", **named_operands(x, w))
    return _mx_matmul(x, w, blocks=blocks, out_dtype=out_dtype, interpret=interpret)


def _mosaic_grouped_blocks(m: int, groups: int) -> MXBlocks:
    """The grouped Mosaic GPU kernel's tiles for m rows over ``groups`` groups (``default_bm``, as the tiled
    MoE's)."""
    default = mosaic_gpu_grouped.DEFAULT_BLOCKS
    return MXBlocks(bm=mosaic_gpu_grouped.default_bm(m, groups), bk=default.bk, num_stages=default.stages,
                    mosaic_gpu=True)


def _grouped_mosaic_gpu(x, w: MXTensor, group_sizes, blocks: MXBlocks, out_dtype, interpret: bool) -> Array:
    """The grouped Mosaic GPU kernel (``mosaic_gpu_grouped.py``, blocks.bm x rows per tile) on x decoded to
    bf16 (exact for MXFP8 x)."""
    xv = as_bf16(x)
    return mosaic_gpu_grouped.grouped_mx_matmul_mosaic(
        xv, w.codes, w.scales, group_sizes, bm=blocks.bm, blocks=mosaic_gpu.MosaicBlocks(blocks.bk, blocks.num_stages),
        out_dtype=out_dtype, interpret=interpret_argument(interpret))


@functools.partial(jax.jit, static_argnames=("blocks", "out_dtype", "interpret"))
def _grouped_mx_matmul(x, w, group_sizes, *, blocks, out_dtype, interpret):
    m, n, k, g = check_grouped(x, w, group_sizes)
    if blocks.decode_then_dot:
        raise ValueError("decode_then_dot is dense only; grouped_mx_matmul always runs the fused kernel")
    if blocks.mosaic_gpu:
        return _grouped_mosaic_gpu(x, w, group_sizes, blocks, out_dtype, interpret)
    n_pad = -(-n // MIN_TILE) * MIN_TILE
    b = fit_blocks(blocks, m, n_pad, k)
    m_pad = -(-m // b.bm) * b.bm
    # Each extra non-empty group adds at most one item (a row tile it shares); one-row tiles
    # are never shared.
    n_items = m_pad // b.bm + (min(g, m) - 1 if b.bm > 1 else 0)
    items = work_items(group_sizes, m, b.bm, n_items)
    x_even, x_odd, xs, codes, scales = prepare_operands(x, w, m_pad, n_pad)
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
        return tpu.grouped_mx_matmul(x, w, group_sizes, blocks=blocks, out_dtype=out_dtype, interpret=interpret)
    out_dtype, interpret = resolve_dtype(x, out_dtype, interpret)
    blocks = blocks or default_blocks(x.shape[0], grouped=True)
    operands = named_operands(x, w)
    if not (blocks.mosaic_gpu or interpret) and offsets_wrap(*operands.values()):
        if not _platform.mosaic_gpu_runs():
            check_offsets("the grouped Mosaic GPU kernel, which takes them, does not run here", **operands)
        blocks = _mosaic_grouped_blocks(x.shape[0], w.shape[0])
    return _grouped_mx_matmul(x, w, group_sizes, blocks=blocks, out_dtype=out_dtype, interpret=interpret)


__all__ = ["LOWERINGS", "MXBlocks", "default_blocks", "grouped_mx_matmul", "mx_matmul"]
