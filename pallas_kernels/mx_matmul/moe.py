"""Fused routed-expert MoE for a few tokens (decode): two kernels, no sort, scatter or atomics.

``fused_moe_mx(x, w1, w3, w2, weights, experts, act)`` computes, for x [T, R] and each of its k
(token, expert) pairs, ``y[t] += weight * act(x[t] w1[e]^T, x[t] w3[e]^T) w2[e]^T`` with MXFP4
expert stacks w1, w3 [E, F, R] and w2 [E, R, F] (the released layout). The sorted dispatch needs
an argsort, a bincount, a gather, three grouped matmuls and a scatter per layer; at decode sizes
those small kernels cost more than the weights take to stream. Here:

1. the hidden kernel, one program per (pair, block of bf hidden units): gate and up for its bf rows
   of w1 and w3 by one-row products (decoded codes times the matching even / odd columns of x on
   the CUDA cores), then h = act(gate, up), rounded to x's dtype as the reference's matmul outputs
   are, into a float32 buffer h [T*k, F];
2. the down kernel, one program per (token, block of br output rows): for each of the token's k
   pairs and each tile of bfb hidden units, w2[e]'s br rows times the pair's h scaled by its
   routing weight; each output row is written once, in x's dtype.

Each program's loop over its tiles is straight-line code that loads every tile first and
accumulates elementwise, float32 [rows, tile width / 2], reducing across threads once at the end:
a cross-thread reduction puts a barrier in the program, and no load is issued ahead of a barrier,
so a reduction per tile would make every tile a DRAM round trip of its own (measured on the H200:
the one-kernel MoE with one loop and one reduction per projection took 15.8 us at `mini`'s shape,
with five such round trips per program; benchmarks/RESULTS.md). Every routed weight byte is read
once per pair. Interpret mode on CPU runs the same bodies (the decode emulated).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from k3jax.implementation import pallas_interpret
from k3jax.mx import BLOCK, MXTensor
from k3jax.typing import Array
from pallas_kernels.mx_matmul.kernel import SCALE_BLOCK_BYTES, MXBlocks, _gpu_compiler_params, decode_weight_planes
from pallas_kernels.mx_matmul.ops import _largest_pow2_divisor


def _accumulate(acc: Array, tile: tuple[Array, Array], vectors: tuple[Array, Array], method: str,
                interpret: bool) -> Array:
    """acc float32 [rows, n/2] + the decoded tile (codes uint8 [rows, n/32, 16], scales [..., 1];
    its even, odd planes [rows, n/2]) times the float32 vectors [n/2] of the matching even / odd
    columns, elementwise (no reduction, so no barrier)."""
    for w, v in zip(decode_weight_planes(*tile, method, interpret), vectors):
        acc = acc + w.astype(jnp.float32) * v[None, :]
    return acc


def _hidden_kernel(experts_ref, x_ref, w1c_ref, w1s_ref, w3c_ref, w3s_ref, h_ref, *, k: int, bf: int, bk: int,
                   act, method: str, interpret: bool):
    """Refs: experts [T*k]; x [T, R]; w1, w3 codes [E, F, R/32, 16] and scales [..., 1]; h [T*k, F]
    float32. Program (pair, block of bf hidden units): R / bk steps of bk contracted elements."""
    pair, block = pl.program_id(0), pl.program_id(1)
    expert, token = experts_ref[pair], pair // k
    R = x_ref.shape[1]
    rows = pl.ds(pl.multiple_of(block * bf, bf), bf)
    g, half = bk // BLOCK, bk // 2
    steps = range(R // bk)
    tiles = [[(c[expert, rows, pl.ds(i * g, g), :], s[expert, rows, pl.ds(i * g, g), :]) for i in steps]
             for c, s in ((w1c_ref, w1s_ref), (w3c_ref, w3s_ref))]
    x = [[x_ref[token, pl.ds(i * bk + parity, half, stride=2)].astype(jnp.bfloat16).astype(jnp.float32)
          for parity in (0, 1)] for i in steps]
    gate, up = [], []
    for sums, stack_tiles in zip((gate, up), tiles):
        acc = jnp.zeros((bf, half), jnp.float32)
        for tile, vectors in zip(stack_tiles, x):
            acc = _accumulate(acc, tile, vectors, method, interpret)
        sums.append(jnp.sum(acc, axis=1))
    h = act(gate[0].astype(x_ref.dtype), up[0].astype(x_ref.dtype))
    h_ref[pair, rows] = h.astype(x_ref.dtype).astype(h_ref.dtype)


def _down_kernel(experts_ref, weights_ref, h_ref, w2c_ref, w2s_ref, y_ref, *, k: int, br: int, bfb: int,
                 method: str, interpret: bool):
    """Refs: experts, weights [T*k]; h [T*k, F] float32; w2 codes [E, R, F/32, 16] and scales
    [..., 1]; y [T, R]. Program (token, block of br output rows): the token's k pairs, F / bfb
    tiles each; these rows are written by this program only."""
    token, block = pl.program_id(0), pl.program_id(1)
    rows = pl.ds(pl.multiple_of(block * br, br), br)
    F = h_ref.shape[1]
    g, half = bfb // BLOCK, bfb // 2
    pairs = [token * k + j for j in range(k)]
    experts = [experts_ref[pair] for pair in pairs]
    weights = [weights_ref[pair] for pair in pairs]
    chunks = range(F // bfb)
    tiles = [[(w2c_ref[e, rows, pl.ds(c * g, g), :], w2s_ref[e, rows, pl.ds(c * g, g), :]) for c in chunks]
             for e in experts]
    acc = jnp.zeros((br, half), jnp.float32)
    for pair, weight, pair_tiles in zip(pairs, weights, tiles):
        for c, tile in zip(chunks, pair_tiles):
            h = [weight * h_ref[pair, pl.ds(c * bfb + parity, half, stride=2)] for parity in (0, 1)]
            acc = _accumulate(acc, tile, h, method, interpret)
    y_ref[token, rows] = jnp.sum(acc, axis=1).astype(y_ref.dtype)


def _stack_views(w: MXTensor) -> tuple[Array, Array]:
    """Free views of a stack's codes [E, N, K/2] and scales [E, N, K/32]: [E, N, K/32, 16] and
    [E, N, K/32, 1]."""
    E, N, half = w.codes.shape
    return (w.codes.reshape(E, N, half // SCALE_BLOCK_BYTES, SCALE_BLOCK_BYTES),
            w.scales.reshape(E, N, w.scales.shape[-1], 1))


@functools.partial(jax.jit, static_argnames=("act", "blocks", "down_blocks", "interpret"))
def _fused_moe_mx(x, w1, w3, w2, weights, experts, *, act, blocks: MXBlocks, down_blocks: MXBlocks, interpret: bool):
    T, R = x.shape
    k = experts.shape[1]
    F = w1.shape[1]
    experts, weights = experts.reshape(-1).astype(jnp.int32), weights.reshape(-1).astype(jnp.float32)
    common = dict(method=blocks.decode, interpret=interpret)
    h = pl.pallas_call(
        functools.partial(_hidden_kernel, k=k, bf=blocks.bn, bk=blocks.bk, act=act, **common),
        out_shape=jax.ShapeDtypeStruct((T * k, F), jnp.float32),
        grid=(T * k, F // blocks.bn),
        compiler_params=_gpu_compiler_params(blocks, interpret),
        interpret=interpret,
        name="fused_moe_hidden",
    )(experts, x, *_stack_views(w1), *_stack_views(w3))
    return pl.pallas_call(
        functools.partial(_down_kernel, k=k, br=down_blocks.bn, bfb=down_blocks.bk, **common),
        out_shape=jax.ShapeDtypeStruct((T, R), x.dtype),
        grid=(T, R // down_blocks.bn),
        compiler_params=_gpu_compiler_params(down_blocks, interpret),
        interpret=interpret,
        name="fused_moe_down",
    )(experts, weights, h, *_stack_views(w2))


# Hidden kernel: bn hidden units per program, bk contracted elements per tile (the accumulator's width is
# bk / 2); down kernel: bn output rows per program, bk hidden units per tile. No loops, so no stages.
FUSED_MOE_BLOCKS = MXBlocks(bm=1, bn=16, bk=512, num_warps=8, num_stages=1, gemv=True)
FUSED_MOE_DOWN_BLOCKS = MXBlocks(bm=1, bn=8, bk=256, num_warps=4, num_stages=1, gemv=True)
FUSED_MOE_MAX_PAIRS = 64  # (token, expert) pairs up to which the MoE layer may use these kernels
FUSED_MOE_MAX_HIDDEN = 8192  # hidden units per token (k * F) up to which the MoE layer may use them


def fused_moe_pays(pairs: int, experts_per_token: int, hidden: int) -> bool:
    """Whether the MoE layer should take these kernels: few (token, expert) pairs and few hidden units
    per token. Measured on the H200 (benchmarks/RESULTS.md): `mini` (8 x 768 = 6144 hidden units a
    token) is faster than the sorted dispatch up to 8 tokens; K3 (16 x 3072 = 49152) is not."""
    return pairs <= FUSED_MOE_MAX_PAIRS and experts_per_token * hidden <= FUSED_MOE_MAX_HIDDEN


def fused_moe_mx(x: Array, w1: MXTensor, w3: MXTensor, w2: MXTensor, weights: Array, experts: Array, act, *,
                 blocks: MXBlocks = FUSED_MOE_BLOCKS, down_blocks: MXBlocks = FUSED_MOE_DOWN_BLOCKS,
                 interpret: bool | None = None) -> Array:
    """Routed experts for a few tokens in two kernels: x [T, R] (bf16/f32, rounded to bf16 in the
    kernel), MXFP4 stacks w1, w3 [E, F, R] and w2 [E, R, F], weights float32 [T, k], experts int32
    [T, k], act(gate, up) -> hidden. Returns sum over the k pairs of weight * expert(x), [T, R] in
    x's dtype (float32 accumulation). Tiles (shrunk to fit): ``blocks.bn`` hidden units per program
    (a power of two dividing F), ``blocks.bk`` contracted elements per tile (a power of two >= 32
    dividing R); ``down_blocks.bn`` output rows per program (a power of two dividing R),
    ``down_blocks.bk`` hidden units per tile (a power of two >= 32 dividing F)."""
    for name, w, shape in (("w1", w1, None), ("w3", w3, w1.shape), ("w2", w2, None)):
        if not isinstance(w, MXTensor) or w.format != "mxfp4" or w.ndim != 3:
            raise ValueError(f"{name} must be an MXFP4 MXTensor [E, N, K], got {w!r:.200}")
        if shape is not None and w.shape != shape:
            raise ValueError(f"{name} shape {w.shape} differs from w1's {shape}")
    E, F, R = w1.shape
    if x.ndim != 2 or x.shape[1] != R or w2.shape != (E, R, F):
        raise ValueError(f"x [T, R] = {x.shape}, w1 [E, F, R] = {w1.shape}, w2 [E, R, F] = {w2.shape} disagree")
    if weights.shape != experts.shape or weights.shape[0] != x.shape[0]:
        raise ValueError(f"weights {weights.shape} and experts {experts.shape} must both be [T, k], T = {x.shape[0]}")
    if F % BLOCK or R % BLOCK:
        raise ValueError(f"F = {F} and R = {R} must be multiples of {BLOCK}")
    scale_blocks = lambda n, cap: BLOCK * _largest_pow2_divisor(n // BLOCK, max(cap // BLOCK, 1))
    blocks = dataclasses.replace(blocks, bn=_largest_pow2_divisor(F, blocks.bn), bk=scale_blocks(R, blocks.bk))
    down_blocks = dataclasses.replace(down_blocks, bn=_largest_pow2_divisor(R, down_blocks.bn),
                                      bk=scale_blocks(F, down_blocks.bk))
    interpret = pallas_interpret() if interpret is None else interpret
    return _fused_moe_mx(x, w1, w3, w2, weights, experts, act=act, blocks=blocks, down_blocks=down_blocks,
                         interpret=interpret)


__all__ = ["FUSED_MOE_BLOCKS", "FUSED_MOE_DOWN_BLOCKS", "FUSED_MOE_MAX_HIDDEN", "FUSED_MOE_MAX_PAIRS", "fused_moe_mx",
           "fused_moe_pays"]
