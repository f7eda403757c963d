"""Routed experts for many tokens (prefill) on the grouped Mosaic GPU kernel, in its tiled row layout.

``tiled_moe_mx`` computes what ``k3jax.functional.moe.moe_sorted`` does, but lays the (token, expert)
pairs out the way ``mosaic_gpu_grouped.tiled_mx_matmul`` reads them: each expert's pairs start at a
tile boundary, so no product needs a row mask and no copy sorts or scatters x. The pairs' slots come from
counting, not a sort (``pair_slots``):

1. one row gather builds the kernel's x operand from x [T, R] (``tiled_operand``): each pair's slot takes
   its token's row (padding slots a zero row), with the columns already permuted as the kernel's register
   decode wants (``x_operand``, applied to the T rows before the gather, not the T k after);
2. gate and up by the grouped kernel, h = act(gate, up) in the same layout, its columns permuted for
   the down kernel in the same XLA fusion;
3. down by the grouped kernel, then each token gathers its k output rows from their slots and sums
   them weighted, in float32, in one fixed order (no scatter-add).

The layout's static bound is ceil(T k / bm) + min(E, T k) tiles; tiles past the experts' are not computed and
never read. Pairs whose expert is outside [0, E) (under expert parallelism, those of another device's experts)
take no slot and add nothing. Measured on the H200 at ``mini``'s prefill chunk: benchmarks/HISTORY.md,
2026-12-02 and 2026-12-03 (MX runs 13 and 18).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from k3jax.mx import MXTensor
from k3jax.typing import Array
from pallas_kernels._mosaic_gpu import interpret_argument
from pallas_kernels.moe.operands import check_moe_operands
from pallas_kernels.mx_matmul.mosaic_gpu import MosaicBlocks, x_operand
from pallas_kernels.mx_matmul.mosaic_gpu_grouped import (
    DEFAULT_BLOCKS,
    DEFAULT_BM,
    group_tiles,
    tiled_mx_matmul,
    tiled_operand,
    tiled_row_count,
)


def pair_slots(experts: Array, n_experts: int, bm: int) -> tuple[Array, Array]:
    """experts int32 [T, k] -> (slot of pair t k + j in the tiled layout int32 [T k], tile_groups as
    ``group_tiles``): each expert's pairs in order of t, then j (the stable sort's order), counted rather
    than sorted: pair (t, j) of expert e is e's pairs in tokens before t plus those at j' < j of token t.
    Pairs whose expert is outside [0, n_experts) get the slot past the layout, ``tiled_row_count``."""
    T, k = experts.shape
    per_token = jnp.sum(experts[:, :, None] == jnp.arange(n_experts, dtype=experts.dtype), axis=1,
                        dtype=jnp.int32)  # [T, E]
    before = jnp.cumsum(per_token, axis=0) - per_token
    earlier = jnp.sum(jnp.tril(experts[:, :, None] == experts[:, None, :], -1), axis=2, dtype=jnp.int32)
    local = (experts >= 0) & (experts < n_experts)
    e = jnp.where(local, experts, 0)
    starts, tile_groups = group_tiles(jnp.sum(per_token, axis=0), T * k, bm)
    slot = starts[e] + jnp.take_along_axis(before, e, axis=1) + earlier
    return jnp.where(local, slot, tiled_row_count(T * k, n_experts, bm)).reshape(-1), tile_groups


def tiled_moe_mx(x: Array, w1: MXTensor, w3: MXTensor, w2: MXTensor, weights: Array, experts: Array, act, *,
                 bm: int = DEFAULT_BM, blocks: MosaicBlocks = DEFAULT_BLOCKS, interpret: bool = False) -> Array:
    """x bf16 [T, R] (the kernel's B operand is bf16), MXFP4 stacks w1, w3 [E, F, R] and w2 [E, R, F],
    weights float32 [T, k], experts int32 [T, k], act(gate, up) -> hidden. Returns sum over the k pairs of
    weight * expert(x), bf16 [T, R]; each expert's matmul outputs rounded to bf16 as ``moe_sorted``'s are.
    Pairs whose expert is outside [0, E) add nothing (``moe_sorted``'s contract; ``k3jax.sharding``).
    bm: pairs per row tile; ``interpret``: run the kernels in Pallas' Mosaic GPU interpreter (CPU)."""
    check_moe_operands(x, w1, w3, w2, weights, experts)
    if x.dtype != jnp.bfloat16:
        raise ValueError(f"x must be bf16 (the grouped Mosaic GPU kernel's operand), got {x.dtype}")
    T, k = experts.shape
    E, F, R = w1.shape
    pairs = T * k
    slot, tile_groups = pair_slots(experts, E, bm)
    rows = tiled_row_count(pairs, E, bm)
    xt = tiled_operand(x, slot, jnp.arange(pairs, dtype=jnp.int32) // k, rows, blocks.bk)
    params = interpret_argument(interpret)

    def products(operand, w: MXTensor, n: int) -> Array:
        out = tiled_mx_matmul(operand, w.codes, w.scales, tile_groups, bm=bm, blocks=blocks, out_dtype=x.dtype,
                              interpret=params)
        return out[:, :n]

    h = act(products(xt, w1, F), products(xt, w3, F))
    # a pair outside the experts has slot ``rows``, past the layout: the fill reads it as zeros
    y = products(x_operand(h, rows, blocks.bk), w2, R).at[slot].get(mode="fill", fill_value=0).reshape(T, k, R)
    out = jnp.einsum("tj,tjr->tr", weights.astype(jnp.float32), y.astype(jnp.float32),
                     precision=jax.lax.Precision.HIGHEST)
    return out.astype(x.dtype)


__all__ = ["pair_slots", "tiled_moe_mx"]
