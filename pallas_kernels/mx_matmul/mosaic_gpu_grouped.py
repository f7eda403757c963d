"""Grouped (ragged) MXFP4 matmul for prefill-sized groups, lowered through Mosaic GPU.

Each program is the dense decode kernel's program (``mosaic_gpu._program``: 64 weight rows decoded in
registers straight into wgmma's A operand, a tile of x rows as the B operand, TMA pipelines for both)
with the x tile widened to ``bm`` rows (wgmma's N up to 256), so one decoded weight tile serves bm
tokens: the decode that bounds the decode shapes is spread over many rows here.

Rows are taken in a *tiled layout*: row tile t (rows [t bm, (t + 1) bm)) holds rows of group
``tile_groups[t]`` only (each group's rows start at a tile boundary; a tile's unused tail is padding),
or of none (``tile_groups[t]`` = G: its programs do nothing). So every program reads one group's
weights and writes whole output tiles, with no row masks. ``tiled_rows`` makes the layout from
``group_sizes``; ``grouped_mx_matmul_mosaic`` takes x [M, K] with rows sorted by group (the grouped
kernels' contract), scatters them into it and gathers the output rows back.

Program (64 weight rows n, row tile t): one TMA brings the 32 tile groups around t into shared memory,
then with g = tile_groups[t] it multiplies rows [g N + 64 n, + 64) of the stack viewed as [G N, K] by
x's row tile t and writes its [bm, 64] output tile (transposed from the [64, bm] accumulator). The
grid runs the weight tiles of one row tile together, so they share its x tile in L2.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from k3jax.mx import BLOCK
from k3jax.typing import Array
from pallas_kernels.mx_matmul.mosaic_gpu import (
    _TMA_MAX_BOX,
    ROWS,
    MosaicBlocks,
    _program,
    _program_scratch,
    _round_up,
    weight_operands,
    x_operand,
)

_GROUPS_PER_COPY = 32  # tile groups (int32) per copy: 128 bytes, a multiple of the warpgroup size as Mosaic GPU asks
# x rows per tile (wgmma's N) and steps: the fastest kernel of bm 64 / 128 and (bk, stages) (128, 3) / (256, 2)
# at `mini`'s prefill chunk (benchmarks/HISTORY.md, 2026-12-02, MX run 13)
DEFAULT_BM = 64
DEFAULT_BLOCKS = MosaicBlocks(bk=256, stages=2)
# Tiles of x rows by the rows a group holds on average: half that average, rounded down to a power of two, from
# SPARSE_BM (wgmma's smallest N) to DEFAULT_BM. On the H200 (benchmarks/HISTORY.md, MX runs 13, 15, 19): at 1-64
# K3 tokens (1-9 rows a group) 8-row tiles were fastest; at a K3 2048-token chunk (37 rows a group) 16-row ones
# (17.2 ms against 24.6 for 8, 17.6 for 32, 19.5 for 64); at `mini`'s 2048-token chunk (256) 64-row ones (against 128).
SPARSE_BM = 8


def default_bm(rows: int, groups: int) -> int:
    """x rows per tile for ``rows`` rows over ``groups`` groups: half the rows a group holds on average,
    rounded down to a power of two, from ``SPARSE_BM`` to ``DEFAULT_BM``."""
    bm = SPARSE_BM
    while bm < DEFAULT_BM and 4 * bm * groups <= rows:  # 2 bm <= rows / groups / 2
        bm *= 2
    return bm


def group_tiles(group_sizes: Array, m: int, bm: int) -> tuple[Array, Array]:
    """group_sizes int32 [G] of M rows -> (each group's first row in the tiled layout int32 [G], tile_groups
    int32 [T']): T' = T rounded up to 32, T = ceil(M / bm) + min(G, M) the tiles' static bound
    (``tiled_row_count``); tiles past the groups' get G."""
    sizes = group_sizes.astype(jnp.int32)
    n_tiles = tiled_row_count(m, sizes.shape[0], bm) // bm
    tiles = (sizes + bm - 1) // bm
    tile_ends = jnp.cumsum(tiles)
    tile_ids = jnp.arange(_round_up(n_tiles, _GROUPS_PER_COPY), dtype=jnp.int32)
    # G for every tile past the groups' last (tile_ends[-1] <= T): searchsorted finds no end above it
    return (tile_ends - tiles) * bm, jnp.searchsorted(tile_ends, tile_ids, side="right",
                                                      method="compare_all").astype(jnp.int32)


def tiled_rows(group_sizes: Array, m: int, bm: int) -> tuple[Array, Array]:
    """group_sizes int32 [G] of M rows sorted by group -> (row of each sorted row in the tiled layout
    int32 [M] (T bm for rows past the groups), tile_groups as ``group_tiles``)."""
    sizes = group_sizes.astype(jnp.int32)
    n_groups = sizes.shape[0]
    starts, tile_groups = group_tiles(sizes, m, bm)
    row_ends = jnp.cumsum(sizes)
    rows = jnp.arange(m, dtype=jnp.int32)
    # compare_all: one fusion; the default scan is a loop of small kernels (about 50 us at 16384 rows, HISTORY.md)
    group = jnp.searchsorted(row_ends, rows, side="right", method="compare_all").astype(jnp.int32)
    g = jnp.minimum(group, n_groups - 1)
    dest = starts[g] + rows - (row_ends[g] - sizes[g])
    return jnp.where(group < n_groups, dest, tiled_row_count(m, n_groups, bm)), tile_groups


def _kernel(groups_g, codes_g, scales_g, x_g, out_g, groups_s, codes_s, scales_s, x_s, out_s, bars, scale_bar,
            group_bar, *, n_rows: int, n_groups: int, n_steps: int, bm: int, blocks: MosaicBlocks, interpret: bool):
    """Program (weight tile "rows", row tile "tiles"): one warpgroup."""
    col0 = jax.lax.axis_index("rows") * ROWS
    tile = jax.lax.axis_index("tiles")
    first = pl.multiple_of(tile // _GROUPS_PER_COPY * _GROUPS_PER_COPY, _GROUPS_PER_COPY)
    plgpu.copy_gmem_to_smem(groups_g.at[pl.ds(first, _GROUPS_PER_COPY)], groups_s, group_bar.at[0])
    plgpu.barrier_wait(group_bar.at[0])
    group = groups_s[tile - first]

    @pl.when(group < n_groups)
    def _():
        row0 = pl.multiple_of(tile * bm, bm)
        _program(codes_g, scales_g, x_g, pl.ds(group * n_rows + col0, ROWS), pl.ds(row0, bm), out_s,
                 out_g.at[pl.ds(row0, bm), pl.ds(col0, ROWS)], codes_s, scales_s, x_s, out_s, bars, scale_bar,
                 n_steps=n_steps, blocks=blocks, transposed_out=True, interpret=interpret)


def grouped_mx_matmul_mosaic(x: Array, codes: Array, scales: Array, group_sizes: Array, *, bm: int = DEFAULT_BM,
                             blocks: MosaicBlocks = DEFAULT_BLOCKS, out_dtype=jnp.float32, interpret=False) -> Array:
    """x bf16 [M, K] rows sorted by group, MXFP4 codes uint8 [G, N, K/2] and scales uint8 [G, N, K/32],
    group_sizes int32 [G] -> out_dtype [M, N]: rows of group g times w[g]^T (float32 accumulation,
    rounded once); rows past sum(group_sizes) are zero.

    bm: x rows per tile, a multiple of 8 up to 256. Gathers x's rows into the tiled layout
    (``tiled_rows``, ``tiled_operand``) and the output's back around ``tiled_mx_matmul``: a caller that
    builds the layout from its own rows (``pallas_kernels.moe.mosaic_gpu_tiled``) saves a copy of x's sorted
    rows. ``interpret``: False on the GPU, or ``interpret_params()`` on a CPU.
    """
    m, k = x.shape
    n_groups, n, _ = codes.shape
    if group_sizes.shape != (n_groups,) or scales.shape != (n_groups, n, k // BLOCK) or codes.shape[2] * 2 != k:
        raise ValueError(f"x [M, K] = {x.shape}, codes [G, N, K/2] = {codes.shape}, scales [G, N, K/32] = "
                         f"{scales.shape} and group_sizes [G] = {group_sizes.shape} disagree")
    _check_bm(bm)
    dest, tile_groups = tiled_rows(group_sizes, m, bm)
    x_tiled = tiled_operand(x, dest, jnp.arange(m, dtype=jnp.int32), tiled_row_count(m, n_groups, bm), blocks.bk)
    out = tiled_mx_matmul(x_tiled, codes, scales, tile_groups, bm=bm, blocks=blocks, out_dtype=out_dtype,
                          interpret=interpret)
    return out.at[dest, :n].get(mode="fill", fill_value=0)


def tiled_operand(x: Array, slots: Array, sources: Array, rows: int, bk: int) -> Array:
    """The kernel's x operand in the tiled layout, bf16 [rows, K padded to bk]: slot slots[i] holds row
    sources[i] of x [M, K] (slots past the layout are dropped), every other slot zeros. x's columns are
    permuted on its M rows (``x_operand``, plus a zero row M), then whole rows gathered: the barrier keeps
    XLA from fusing the two into an element-by-element gather over the layout's rows (benchmarks/HISTORY.md,
    2026-12-02, MX run 13)."""
    m = x.shape[0]
    src = jnp.full((rows,), m, jnp.int32).at[slots].set(sources.astype(jnp.int32), mode="drop")
    return jax.lax.optimization_barrier(x_operand(x, m + 1, bk))[src]


def tiled_row_count(m: int, n_groups: int, bm: int) -> int:
    """Rows of the tiled layout of m rows in n_groups groups: its static bound of ceil(m / bm) + min(G, m)
    tiles. Group g takes ceil(size_g / bm) < size_g / bm + 1 tiles and at most min(G, m) groups have rows, so
    the tiles number less than m / bm + min(G, m). At decode (m pairs, far fewer than G experts) the
    bound is about 2 m tiles, not G: the empty tiles' programs still start and read their group."""
    return (-(-m // bm) + min(n_groups, m)) * bm


def _check_bm(bm: int) -> None:
    if bm % 8 or not 8 <= bm <= _TMA_MAX_BOX:
        raise ValueError(f"bm = {bm}: x rows per tile must be a multiple of 8 from 8 to {_TMA_MAX_BOX}")


def tiled_mx_matmul(x_tiled: Array, codes: Array, scales: Array, tile_groups: Array, *, bm: int = DEFAULT_BM,
                    blocks: MosaicBlocks = DEFAULT_BLOCKS, out_dtype=jnp.float32, interpret=False) -> Array:
    """x_tiled bf16 [T bm, Kp] in the tiled layout (``tiled_rows``) as ``x_operand`` makes it (K padded to
    bk, columns permuted), MXFP4 codes uint8 [G, N, K/2], scales uint8 [G, N, K/32], tile_groups int32
    [T rounded up to 32] -> out_dtype [T bm, N padded to 64]: row tile t times w[tile_groups[t]]^T.
    Tiles of group G are not computed: their output rows are left unwritten."""
    n_groups = codes.shape[0]
    rows, kp = x_tiled.shape
    _check_bm(bm)
    codes, scales, np_, kp_w, n_scale_cols = weight_operands(codes, scales, blocks.bk)
    if rows % bm or kp != kp_w or tile_groups.shape[0] < rows // bm:
        raise ValueError(f"x_tiled [T bm, Kp] = {x_tiled.shape} with bm = {bm}, K padded to bk = {kp_w} and "
                         f"tile_groups {tile_groups.shape} disagree")
    codes, scales = codes.reshape(n_groups * np_, kp // 2), scales.reshape(n_groups * np_, n_scale_cols)
    scratch = [plgpu.SMEM((_GROUPS_PER_COPY,), jnp.int32),
               *_program_scratch(blocks, n_scale_cols, bm, (bm, ROWS), out_dtype),
               plgpu.Barrier(num_arrivals=1, num_barriers=1)]
    kernel = functools.partial(_kernel, n_rows=np_, n_groups=n_groups, n_steps=kp // blocks.bk, bm=bm,
                               blocks=blocks, interpret=bool(interpret))
    return plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((rows, np_), out_dtype),
        scratch_types=scratch, grid=(np_ // ROWS, rows // bm), grid_names=("rows", "tiles"),
        compiler_params=plgpu.CompilerParams(unsafe_no_auto_barriers=True), interpret=interpret or None,
    )(tile_groups, codes, scales, x_tiled)


__all__ = ["DEFAULT_BLOCKS", "DEFAULT_BM", "SPARSE_BM", "default_bm", "group_tiles",
           "grouped_mx_matmul_mosaic", "tiled_mx_matmul", "tiled_operand", "tiled_row_count", "tiled_rows"]
