"""Several matrix-vector products of one input in one kernel (decode-step projections).

``matvecs(x, weights)`` returns ``x @ W_i^T`` for each weight W_i [N_i, D] (PyTorch [out, in] layout)
and x [M, D] with few rows (decode: M <= ``MAX_ROWS``). XLA runs each small product as its own
kernel, at 1-1.5 TB/s for 0.5-4 MB of weights plus a launch each; here one ``pallas_call`` covers
them all. Its 1-D grid runs over the row blocks of all the weights in turn: the ranges of program
ids that belong to each weight are fixed at trace time (``_Part``), and one ``pl.when`` branch per
weight loads that weight's [bn, bk] tiles, steps over D in chunks of bk, and stores its [M, bn]
block of that weight's output. No weight is copied or concatenated: the kernel gets each whole
array and slices it itself.

Arithmetic: every product is float32(x) * float32(W), summed in float32 (per output, a float32
[bn] accumulator per row of x that adds one chunk's row sums a step), rounded once to the output
dtype: ``jnp.einsum`` at precision HIGHEST on float32 operands, up to summation order. The products
run on the CUDA cores, not the matrix units: at M <= 16 the kernel is bound by reading the weights.
``MatvecBlocks.dot`` (unmeasured) puts them on the matrix units instead: x's rows padded to 16 (masked
loads, no copy) times a [bn >= 16, bk] weight tile, bf16 operands where x and W are both bf16 (their
products are exact in float32), else float32 operands at precision HIGHEST; float32 accumulation.

Ragged shapes: a weight of fewer rows than bn gets a block of next_power_of_2(N_i) rows (Triton
blocks are powers of two); a last block that runs past N_i loads with a row mask (zeros) and stores
with the same mask; D need not be a multiple of bk (column mask on the last chunk). x and the
weights may be bf16 or float32, independently.

Tiles (``MatvecBlocks``, ``DEFAULT_BLOCKS``): bn weight rows per program, bk columns per step,
Triton's num_warps and num_stages. Defaults from two H200 sweeps at mini's shapes
(``benchmarks/matvec.py``, benchmarks/RESULTS.md, issue 4): at M = 1, bn 4, bk 2048, 4 warps took
6.59 us for the KDA group (9.0 MB; XLA's einsums 7.94 us; bn 8 bk 1024 7.62 us) and 7.03 us for the
MoE group (11.0 MB; XLA 10.20 us; bn 8 bk 1024 7.70 us). At M = 8 the kernel is 1.5-3x slower than
XLA, and so is the dot form on the MoE group (its float32 router): use it at M = 1. On GPU the kernel
lowers through Pallas' Triton backend (chosen by passing Triton compiler params); on CPU it runs in
interpret mode (``k3jax.implementation.pallas_interpret``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from k3jax.implementation import pallas_interpret
from k3jax.typing import Array

MAX_ROWS = 16
DOT_ROWS = 16  # x's rows as the matrix units' operand (MAX_ROWS padded; Triton's dot needs >= 16)
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


@dataclasses.dataclass(frozen=True)
class MatvecBlocks:
    """bn: weight rows per program (a power of two); bk: columns of D per loop step (a power of
    two); num_warps, num_stages: Triton launch and software-pipelining depth (ignored in interpret
    mode); dot: products on the matrix units (x's rows padded to DOT_ROWS, bn >= 16) instead of one
    row reduction per row of x (unmeasured)."""

    bn: int = 8
    bk: int = 1024
    num_warps: int = 4
    num_stages: int = 3
    dot: bool = False

    def __post_init__(self):
        for name in ("bn", "bk"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"MatvecBlocks.{name} = {value}: must be a power of two")
        if self.dot and min(self.bn, self.bk) < DOT_ROWS:
            raise ValueError(f"MatvecBlocks.dot needs bn and bk >= {DOT_ROWS}, got {self.bn} and {self.bk}")


DEFAULT_BLOCKS = MatvecBlocks(bn=4, bk=2048, num_warps=4, num_stages=3)


class _Part(NamedTuple):
    """The programs [first, first + blocks) compute one weight's output, bn rows each."""

    first: int
    blocks: int
    bn: int


def _parts(rows: Sequence[int], bn: int, min_bn: int) -> tuple[_Part, ...]:
    """Program ranges for weights of the given row counts, in order: blocks of bn rows, or of the
    next power of two above a smaller weight's rows (at least min_bn)."""
    parts, first = [], 0
    for n in rows:
        block = max(min(bn, pl.next_power_of_2(n)), min_bn)
        parts.append(_Part(first, pl.cdiv(n, block), block))
        first += parts[-1].blocks
    return tuple(parts)


def _tile_mask(row_mask: Array | None, col_mask: Array | None, shape: tuple[int, int]) -> Array | None:
    """[rows, cols] mask of the valid rows and columns, or None where all are valid."""
    if row_mask is None and col_mask is None:
        return None
    mask = jnp.ones(shape, bool)
    if row_mask is not None:
        mask &= row_mask[:, None]
    if col_mask is not None:
        mask &= col_mask[None, :]
    return mask


def _load(ref, mask: Array | None) -> Array:
    """ref's block, zeros where mask (if any) is False."""
    return pltriton.load(ref, mask=mask, other=None if mask is None else 0)


def _valid(start, size: int, bound: int) -> Array | None:
    """[size] mask of start + i < bound, or None where bound is a multiple of size."""
    return start + jax.lax.broadcasted_iota(jnp.int32, (size,), 0) < bound if bound % size else None


def _x_tiles(x_ref, norm_ref, eps: float | None, rows: int, bk: int, firsts) -> "callable":
    """x_at(row0, col0) -> x [rows, bk] at those rows and columns (zeros past x's ends), for row0 in
    ``firsts``. With norm_ref [1, D]: RMS-normed, float32 x * rsqrt(mean(x^2) + eps) * weight rounded
    to x's dtype (``k3jax.functional.norms.rms_norm``); each row's inverse RMS comes from a pass
    over x made here, before the caller's loop (x is small: M x D)."""
    m_rows, depth = x_ref.shape
    f32 = jnp.float32

    def raw(row0, col0):
        mask = _tile_mask(_valid(row0, rows, m_rows) if rows > 1 else None, _valid(col0, bk, depth), (rows, bk))
        return _load(x_ref.at[pl.ds(row0, rows), pl.ds(col0, bk)], mask)

    if norm_ref is None:
        return raw

    def inverse_rms(row0):
        def squares(s, total):
            x = raw(row0, pl.multiple_of(s * bk, bk)).astype(f32)
            return total + jnp.sum(x * x, axis=1, keepdims=True)

        total = jax.lax.fori_loop(0, pl.cdiv(depth, bk), squares, jnp.zeros((rows, 1), f32))
        return jax.lax.rsqrt(total / depth + eps)

    inverse = {row0: inverse_rms(row0) for row0 in firsts}

    def x_at(row0, col0):
        x = raw(row0, col0)
        weight = _load(norm_ref.at[:, pl.ds(col0, bk)], _tile_mask(None, _valid(col0, bk, depth), (1, bk)))
        return (x.astype(f32) * inverse[row0] * weight.astype(f32)).astype(x.dtype)

    return x_at


def _block_product(x_ref, norm_ref, w_ref, o_ref, row0, *, bn: int, bk: int, dot: bool, eps: float | None) -> None:
    """o[:, row0:row0 + bn] = x @ w[row0:row0 + bn]^T in float32, rows past w's end masked (x
    RMS-normed first with norm_ref, when given).

    Rows form: a float32 [bn] sum per row of x, each step adding the row sums of w * x_m. Dot form:
    a [DOT_ROWS, bn] float32 accumulator from x (rows past M loaded as zeros) . w^T on the matrix
    units, bf16 operands where both are bf16, else float32 at precision HIGHEST (exact products)."""
    m_rows, depth = x_ref.shape
    row_mask = _valid(row0, bn, w_ref.shape[0])
    x_at = _x_tiles(x_ref, norm_ref, eps, DOT_ROWS if dot else 1, bk, [0] if dot else range(m_rows))

    def step(s, acc):
        col0 = pl.multiple_of(s * bk, bk)
        col_mask = _valid(col0, bk, depth)
        w = _load(w_ref.at[pl.ds(row0, bn), pl.ds(col0, bk)], _tile_mask(row_mask, col_mask, (bn, bk)))
        if dot:
            x = x_at(0, col0)
            if not x.dtype == w.dtype == jnp.bfloat16:
                x, w = x.astype(jnp.float32), w.astype(jnp.float32)
            return acc + pltriton.dot(x, w, trans_b=True, precision=jax.lax.Precision.HIGHEST)
        w = w.astype(jnp.float32)
        return tuple(acc[m] + jnp.sum(w * x_at(m, col0).astype(jnp.float32), axis=1) for m in range(m_rows))

    init = jnp.zeros((DOT_ROWS, bn), jnp.float32) if dot else (jnp.zeros((bn,), jnp.float32),) * m_rows
    acc = jax.lax.fori_loop(0, pl.cdiv(depth, bk), step, init)
    out_mask = None if row_mask is None else row_mask[None, :]
    if dot:
        pltriton.store(o_ref.at[pl.ds(0, DOT_ROWS), pl.ds(row0, bn)], acc.astype(o_ref.dtype),
                       mask=_tile_mask(_valid(0, DOT_ROWS, m_rows), row_mask, (DOT_ROWS, bn)))
        return
    for m in range(m_rows):
        pltriton.store(o_ref.at[pl.ds(m, 1), pl.ds(row0, bn)], acc[m][None, :].astype(o_ref.dtype), mask=out_mask)


def _matvecs_kernel(x_ref, *refs, parts: tuple[_Part, ...], bk: int, dot: bool, eps: float | None):
    """Refs: x [M, D], the RMSNorm weight [1, D] (when eps is given), the weights [N_i, D], then the
    outputs [M, N_i] (whole arrays)."""
    norm_ref, refs = (refs[0], refs[1:]) if eps is not None else (None, refs)
    w_refs, o_refs = refs[:len(parts)], refs[len(parts):]
    program = pl.program_id(0)
    for w_ref, o_ref, part in zip(w_refs, o_refs, parts):
        @pl.when((program >= part.first) & (program < part.first + part.blocks))
        def _(w_ref=w_ref, o_ref=o_ref, part=part):
            row0 = pl.multiple_of((program - part.first) * part.bn, part.bn)
            _block_product(x_ref, norm_ref, w_ref, o_ref, row0, bn=part.bn, bk=bk, dot=dot, eps=eps)


@functools.partial(jax.jit, static_argnames=("out_dtypes", "eps", "blocks", "interpret"))
def _matvecs(x, norm_weight, weights, *, out_dtypes, eps, blocks: MatvecBlocks, interpret: bool):
    m_rows, depth = x.shape
    min_bn = DOT_ROWS if blocks.dot else 1
    parts = _parts([w.shape[0] for w in weights], blocks.bn, min_bn)
    bk = max(min(blocks.bk, pl.next_power_of_2(depth)), min_bn)
    params = None if interpret else pltriton.CompilerParams(num_warps=blocks.num_warps,
                                                             num_stages=blocks.num_stages)
    return pl.pallas_call(
        functools.partial(_matvecs_kernel, parts=parts, bk=bk, dot=blocks.dot, eps=eps),
        out_shape=tuple(jax.ShapeDtypeStruct((m_rows, w.shape[0]), d) for w, d in zip(weights, out_dtypes)),
        grid=(parts[-1].first + parts[-1].blocks,),
        compiler_params=params,
        interpret=interpret,
        name="matvecs",
    )(x, *([] if eps is None else [norm_weight.reshape(1, depth)]), *weights)


def matvecs(x: Array, weights: Sequence[Array], out_dtypes: Sequence | None = None, *,
            norm: tuple[Array, float] | None = None, blocks: MatvecBlocks | None = None,
            interpret: bool | None = None) -> tuple[Array, ...]:
    """x [M, D] (M <= MAX_ROWS), weights [N_i, D] -> (x @ W_i^T [M, N_i] in out_dtypes[i], ...).

    bf16 or float32 operands; float32 products and sums, one rounding to the output dtype (default
    x.dtype). One kernel for all the weights. ``norm`` = (weight [D], eps): x is RMS-normed first,
    inside the kernel, exactly as ``k3jax.functional.norms.rms_norm`` (float32, rounded to x.dtype).
    ``blocks`` default: ``DEFAULT_BLOCKS``, read at each call."""
    weights = tuple(weights)
    if x.ndim != 2 or not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"x must be [M, D] with 1 <= M <= {MAX_ROWS}, got shape {x.shape}")
    if not weights:
        raise ValueError("matvecs needs at least one weight")
    for i, w in enumerate(weights):
        if w.ndim != 2 or w.shape[1] != x.shape[1] or w.shape[0] < 1:
            raise ValueError(f"weight {i} must be [N, D] with D = {x.shape[1]} (x's), got shape {w.shape}")
    for operand in (x, *weights):
        if jnp.dtype(operand.dtype) not in DTYPES:
            raise ValueError(f"operands must be bfloat16 or float32, got {operand.dtype}")
    out_dtypes = (x.dtype,) * len(weights) if out_dtypes is None else tuple(out_dtypes)
    if len(out_dtypes) != len(weights):
        raise ValueError(f"{len(out_dtypes)} out_dtypes for {len(weights)} weights")
    norm_weight, eps = (None, None) if norm is None else (norm[0], float(norm[1]))
    if norm_weight is not None and (norm_weight.shape != (x.shape[1],) or jnp.dtype(norm_weight.dtype) not in DTYPES):
        raise ValueError(f"norm weight must be [D] = [{x.shape[1]}] bf16 or float32, got {norm_weight.shape} "
                         f"{norm_weight.dtype}")
    interpret = pallas_interpret() if interpret is None else interpret
    return _matvecs(x, norm_weight, weights, out_dtypes=tuple(jnp.dtype(d) for d in out_dtypes), eps=eps,
                    blocks=DEFAULT_BLOCKS if blocks is None else blocks, interpret=interpret)


__all__ = ["DEFAULT_BLOCKS", "MAX_ROWS", "MatvecBlocks", "matvecs"]
