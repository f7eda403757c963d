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

Ragged shapes: a weight of fewer rows than bn gets a block of next_power_of_2(N_i) rows (Triton
blocks are powers of two); a last block that runs past N_i loads with a row mask (zeros) and stores
with the same mask; D need not be a multiple of bk (column mask on the last chunk). x and the
weights may be bf16 or float32, independently.

Tiles (``MatvecBlocks``): bn weight rows per program, bk columns per step, Triton's num_warps and
num_stages. Defaults from one H200 sweep at mini's shapes (benchmarks/RESULTS.md, issue 4): at
M = 1, bn 8, bk 1024, 4 warps took 7.35 us for the KDA group (9.0 MB; XLA's einsums 7.98 us) and
10.3 us for the MoE group (11.0 MB; XLA 9.03 us, bn 4 with 2 warps 9.17 us); bk 256 -> 1024 and
bn 16 -> 4 each helped. At M = 8 the kernel is 1.5-2x slower than XLA (one row reduction per row of
x a step): use it at M = 1 until a tensor-core path for M > 1 is measured. On GPU the kernel
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
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


@dataclasses.dataclass(frozen=True)
class MatvecBlocks:
    """bn: weight rows per program (a power of two); bk: columns of D per loop step (a power of
    two); num_warps, num_stages: Triton launch and software-pipelining depth (ignored in interpret
    mode)."""

    bn: int = 8
    bk: int = 1024
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        for name in ("bn", "bk"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"MatvecBlocks.{name} = {value}: must be a power of two")


class _Part(NamedTuple):
    """The programs [first, first + blocks) compute one weight's output, bn rows each."""

    first: int
    blocks: int
    bn: int


def _parts(rows: Sequence[int], bn: int) -> tuple[_Part, ...]:
    """Program ranges for weights of the given row counts, in order."""
    parts, first = [], 0
    for n in rows:
        block = min(bn, pl.next_power_of_2(n))
        parts.append(_Part(first, pl.cdiv(n, block), block))
        first += parts[-1].blocks
    return tuple(parts)


def _tile_mask(row_mask: Array | None, col_mask: Array | None, shape: tuple[int, int]) -> Array | None:
    """[bn, bk] mask of the valid rows and columns, or None where all are valid."""
    if row_mask is None and col_mask is None:
        return None
    mask = jnp.ones(shape, bool)
    if row_mask is not None:
        mask &= row_mask[:, None]
    if col_mask is not None:
        mask &= col_mask[None, :]
    return mask


def _block_product(x_ref, w_ref, o_ref, row0, *, bn: int, bk: int) -> None:
    """o[:, row0:row0 + bn] = x @ w[row0:row0 + bn]^T in float32, rows past w's end masked."""
    m_rows, depth = x_ref.shape
    n_rows = w_ref.shape[0]
    row_ids = row0 + jax.lax.broadcasted_iota(jnp.int32, (bn,), 0)
    row_mask = row_ids < n_rows if n_rows % bn else None

    def step(s, sums):
        col0 = pl.multiple_of(s * bk, bk)
        col_mask = col0 + jax.lax.broadcasted_iota(jnp.int32, (bk,), 0) < depth if depth % bk else None
        tile_mask = _tile_mask(row_mask, col_mask, (bn, bk))
        x_mask = None if col_mask is None else col_mask[None, :]
        w = pltriton.load(w_ref.at[pl.ds(row0, bn), pl.ds(col0, bk)], mask=tile_mask,
                          other=None if tile_mask is None else 0).astype(jnp.float32)
        new = []
        for m in range(m_rows):
            xm = pltriton.load(x_ref.at[pl.ds(m, 1), pl.ds(col0, bk)], mask=x_mask,
                               other=None if x_mask is None else 0).astype(jnp.float32)
            new.append(sums[m] + jnp.sum(w * xm, axis=1))
        return tuple(new)

    sums = jax.lax.fori_loop(0, pl.cdiv(depth, bk), step, (jnp.zeros((bn,), jnp.float32),) * m_rows)
    for m in range(m_rows):
        pltriton.store(o_ref.at[pl.ds(m, 1), pl.ds(row0, bn)], sums[m][None, :].astype(o_ref.dtype),
                       mask=None if row_mask is None else row_mask[None, :])


def _matvecs_kernel(x_ref, *refs, parts: tuple[_Part, ...], bk: int):
    """Refs: x [M, D], the weights [N_i, D], then the outputs [M, N_i] (whole arrays)."""
    w_refs, o_refs = refs[:len(parts)], refs[len(parts):]
    program = pl.program_id(0)
    for w_ref, o_ref, part in zip(w_refs, o_refs, parts):
        @pl.when((program >= part.first) & (program < part.first + part.blocks))
        def _(w_ref=w_ref, o_ref=o_ref, part=part):
            row0 = pl.multiple_of((program - part.first) * part.bn, part.bn)
            _block_product(x_ref, w_ref, o_ref, row0, bn=part.bn, bk=bk)


@functools.partial(jax.jit, static_argnames=("out_dtypes", "blocks", "interpret"))
def _matvecs(x, weights, *, out_dtypes, blocks: MatvecBlocks, interpret: bool):
    m_rows, depth = x.shape
    parts = _parts([w.shape[0] for w in weights], blocks.bn)
    bk = min(blocks.bk, pl.next_power_of_2(depth))
    params = None if interpret else pltriton.CompilerParams(num_warps=blocks.num_warps,
                                                             num_stages=blocks.num_stages)
    return pl.pallas_call(
        functools.partial(_matvecs_kernel, parts=parts, bk=bk),
        out_shape=tuple(jax.ShapeDtypeStruct((m_rows, w.shape[0]), d) for w, d in zip(weights, out_dtypes)),
        grid=(parts[-1].first + parts[-1].blocks,),
        compiler_params=params,
        interpret=interpret,
        name="matvecs",
    )(x, *weights)


def matvecs(x: Array, weights: Sequence[Array], out_dtypes: Sequence | None = None, *,
            blocks: MatvecBlocks = MatvecBlocks(), interpret: bool | None = None) -> tuple[Array, ...]:
    """x [M, D] (M <= MAX_ROWS), weights [N_i, D] -> (x @ W_i^T [M, N_i] in out_dtypes[i], ...).

    bf16 or float32 operands; float32 products and sums, one rounding to the output dtype (default
    x.dtype). One kernel for all the weights."""
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
    interpret = pallas_interpret() if interpret is None else interpret
    return _matvecs(x, weights, out_dtypes=tuple(jnp.dtype(d) for d in out_dtypes), blocks=blocks,
                    interpret=interpret)


__all__ = ["MAX_ROWS", "MatvecBlocks", "matvecs"]
