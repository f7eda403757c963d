"""Fused routed-expert MoE for a few tokens as two kernels: no sort, no scatter and no atomics.

``fused_moe_mx_split(x, w1, w3, w2, weights, experts, act)`` computes, for x [T, R] and each of its k
(token, expert) pairs, ``y[t] += weight * act(x[t] w1[e]^T, x[t] w3[e]^T) w2[e]^T`` with MXFP4 expert
stacks w1, w3 [E, F, R] and w2 [E, R, F] (the released layout). The sorted dispatch needs an argsort, a
bincount, a gather, three grouped matmuls and a scatter per layer; at decode sizes those small kernels
cost more than the weights take to stream. Two kernels:

1. the hidden kernel, one program per (pair, block of bf hidden units): gate and up for its bf rows
   of w1 and w3 by one-row products (decoded codes times the matching even / odd columns of x on
   the CUDA cores), then h = act(gate, up), rounded to x's dtype as the reference's matmul outputs
   are, into a float32 buffer h [T*k, F] (or planar: ``KernelPolicy.split_moe_planar_h_max_tokens``);
2. the down kernel, one program per (token, block of br output rows): for each of the token's k
   pairs and each tile of bfb hidden units, w2[e]'s br rows times the pair's h scaled by its
   routing weight; each output row is written once.

Each program's tiles are straight-line code that loads every tile first and accumulates
elementwise, float32 [rows, tile width / 2], reducing across threads once at the end: a
cross-thread reduction puts a barrier in the program, and no load is issued ahead of a barrier, so
a reduction per tile would make every tile a DRAM round trip of its own. Every routed weight byte is
read once per pair, and each output sum is made in one order (the step repeats bitwise). Measured
on the H200 (benchmarks/HISTORY.md, 2026-12-01): the `mini` decode step 6-8% faster than with a
one-kernel form (since removed) at 2, 4 and 8 tokens, where its atomic adds from k * F / bf programs
met on each token's output rows; at one token, with one output row per down program, 15.2 against
17.2 us a MoE layer with the weights coming from DRAM.

``routed_moe_mx_split`` takes the router's logits instead of the chosen pairs: every hidden program
picks its own pair's expert and weight (``pallas_kernels.moe.triton_select.expert_ranks``) and block 0 of each
pair writes them for the down kernel, so the separate selection kernel (one launch a layer, most of
its 3.5 us at batch 1) does not run.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from k3jax.implementation import current
from pallas_kernels import _platform
from k3jax.mx import BLOCK, MXTensor
from k3jax.typing import Array
from pallas_kernels._triton import triton_params
from pallas_kernels.mx_matmul.triton import MXBlocks, decode_weight_planes
from pallas_kernels.moe.operands import check_moe_operands, check_stack_offsets, stack_views
from pallas_kernels.mx_matmul.layout import largest_pow2_divisor
from pallas_kernels.moe.triton_select import check_router_inputs, expert_ranks, padded_router_inputs, slot_expert, slot_weight


def _accumulate(acc: Array, tile: tuple[Array, Array], vectors: tuple[Array, Array], method: str,
                interpret: bool) -> Array:
    """acc float32 [rows, n/2] + the decoded tile (codes uint8 [rows, n/32, 16], scales [..., 1];
    its even, odd planes [rows, n/2]) times the float32 vectors [n/2] of the matching even / odd
    columns, elementwise (no reduction, so no barrier). With vectors [n/32, 16] (a planar h), acc and
    the planes keep the tile's blocks: [rows, n/32, 16]."""
    blocked = vectors[0].ndim == 2
    for w, v in zip(decode_weight_planes(*tile, method, interpret, blocked=blocked), vectors):
        acc = acc + w.astype(jnp.float32) * v[None]
    return acc


def _row_groups(first, bf: int, planar: bool) -> list:
    """A hidden program's rows of w1 and w3: its bf rows from ``first``, or (planar h) its even rows, then
    its odd ones."""
    if not planar:
        return [pl.ds(pl.multiple_of(first, bf), bf)]
    return [pl.ds(first + parity, bf // 2, stride=2) for parity in (0, 1)]


def _store_h(h_ref, pair, first, rows: int, h: Array, planar: bool, parity: int) -> None:
    """Store a hidden program's h for its ``rows`` units from ``first`` (planar: the units of one parity,
    into h [T*k, F/32, 2, 16], whose block b holds units 32 b, 32 b + 2, ..., then 32 b + 1, ...)."""
    if not planar:
        h_ref[pair, pl.ds(pl.multiple_of(first, rows), rows)] = h
    elif rows <= 16:  # within one block of 32 units
        h_ref[pair, first // BLOCK, jnp.int32(parity), pl.ds((first % BLOCK) // 2, rows)] = h
    else:
        h_ref[pair, pl.ds(first // BLOCK, rows // 16), jnp.int32(parity), :] = h.reshape(rows // 16, 16)


def _hidden_products(expert, token, x_ref, w1c_ref, w1s_ref, w3c_ref, w3s_ref, h_ref, *, bf: int, bk: int, act,
                     h_dtype, method: str, planar: bool, interpret: bool) -> None:
    """Refs: x [T, R] bf16; w1, w3 codes [E, F, R/32, 16] and scales [..., 1]; h [T*k, F] float32, or
    planar [T*k, F/32, 2, 16] (``_store_h``). Program (pair, block of bf hidden units) with the pair's
    expert and token: R / bk tiles of bk contracted elements (planar: for its even and its odd units)."""
    pair, block = pl.program_id(0), pl.program_id(1)
    R = x_ref.shape[1]
    first = block * bf
    g, half = bk // BLOCK, bk // 2
    steps = range(R // bk)
    groups = _row_groups(first, bf, planar)
    tiles = [[[(c[expert, rows, pl.ds(i * g, g), :], s[expert, rows, pl.ds(i * g, g), :]) for i in steps]
              for c, s in ((w1c_ref, w1s_ref), (w3c_ref, w3s_ref))] for rows in groups]
    x = [[x_ref[token, pl.ds(i * bk + parity, half, stride=2)].astype(jnp.float32) for parity in (0, 1)]
         for i in steps]
    units = bf // len(groups)
    for parity, group_tiles in enumerate(tiles):
        gate, up = [], []
        for sums, stack_tiles in zip((gate, up), group_tiles):
            acc = jnp.zeros((units, half), jnp.float32)
            for tile, vectors in zip(stack_tiles, x):
                acc = _accumulate(acc, tile, vectors, method, interpret)
            sums.append(jnp.sum(acc, axis=1).astype(h_dtype))
        h = act(gate[0], up[0]).astype(h_dtype).astype(jnp.float32)
        _store_h(h_ref, pair, first, units, h, planar, parity)


def _hidden_kernel(experts_ref, x_ref, w1c_ref, w1s_ref, w3c_ref, w3s_ref, h_ref, *, k: int, **products):
    """Refs: experts [T*k] int32, then as ``_hidden_products``."""
    pair = pl.program_id(0)
    _hidden_products(experts_ref[pair], pair // k, x_ref, w1c_ref, w1s_ref, w3c_ref, w3s_ref, h_ref, **products)


def _routed_hidden_kernel(logits_ref, bias_ref, x_ref, w1c_ref, w1s_ref, w3c_ref, w3s_ref, h_ref, experts_ref,
                          weights_ref, *, k: int, renormalize: bool, scaling: float, **products):
    """Refs: router logits [T, E'] float32 (padding lanes -inf), correction bias [1, E'], then as
    ``_hidden_products``; outputs experts [T*k] int32 and weights [T*k] float32 (block 0 of each pair
    writes its pair's). Every program picks its pair's expert itself (``pallas_kernels.moe.triton_select``'s ranks); the
    weight and the stores are traced after the products, so the weight loads wait only for the expert."""
    pair, block = pl.program_id(0), pl.program_id(1)
    token = pair // k
    scores, rank = expert_ranks(logits_ref[token, :], bias_ref[0, :])
    expert = slot_expert(rank, pair % k)
    _hidden_products(expert, token, x_ref, w1c_ref, w1s_ref, w3c_ref, w3s_ref, h_ref, **products)
    weight = slot_weight(scores, rank, pair % k, k, renormalize, scaling)

    @pl.when(block == 0)
    def _():
        experts_ref[pair] = expert
        weights_ref[pair] = weight


def _down_kernel(experts_ref, weights_ref, h_ref, w2c_ref, w2s_ref, y_ref, *, k: int, br: int, bfb: int,
                 method: str, interpret: bool):
    """Refs: experts, weights [T*k]; h [T*k, F] float32, or planar [T*k, F/32, 2, 16]; w2 codes [E, R,
    F/32, 16] and scales [..., 1]; y [T, R]. Program (token, block of br output rows): the token's k pairs,
    F / bfb tiles each; these rows are written by this program only. A planar h's planes load whole
    [bfb/32, 16] blocks, in the layout of the decoded tile they multiply."""
    token, block = pl.program_id(0), pl.program_id(1)
    rows = pl.ds(pl.multiple_of(block * br, br), br)
    planar = h_ref.ndim == 4
    F = w2c_ref.shape[2] * BLOCK
    g, half = bfb // BLOCK, bfb // 2
    pairs = [token * k + j for j in range(k)]
    chunks = range(F // bfb)
    experts = [experts_ref[p] for p in pairs]
    tiles = [[(w2c_ref[e, rows, pl.ds(c * g, g), :], w2s_ref[e, rows, pl.ds(c * g, g), :]) for c in chunks]
             for e in experts]

    def plane(pair, c, parity):
        if planar:
            return h_ref[pair, pl.ds(c * g, g), jnp.int32(parity), :]
        return h_ref[pair, pl.ds(c * bfb + parity, half, stride=2)]

    acc = jnp.zeros((br, g, 16) if planar else (br, half), jnp.float32)
    for pair, pair_tiles in zip(pairs, tiles):
        weight = weights_ref[pair]
        for c, tile in zip(chunks, pair_tiles):
            acc = _accumulate(acc, tile, [weight * plane(pair, c, parity) for parity in (0, 1)], method, interpret)
    y_ref[token, rows] = jnp.sum(acc.reshape(br, half), axis=1).astype(y_ref.dtype)


def _hidden_call(kernel, T: int, k: int, F: int, blocks: MXBlocks, outputs: tuple, planar: bool, interpret: bool):
    """The hidden kernel's pallas_call: grid (pairs, F / bn), h float32 first among its outputs ([T*k, F],
    or planar [T*k, F/32, 2, 16])."""
    h_shape = (T * k, F // BLOCK, 2, BLOCK // 2) if planar else (T * k, F)
    return pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct(h_shape, jnp.float32), *outputs),
        grid=(T * k, F // blocks.bn),
        compiler_params=triton_params(blocks.num_warps, blocks.num_stages, interpret),
        interpret=interpret,
        name="fused_moe_hidden",
    )


def _down_call(experts, weights, h, w2: MXTensor, T: int, R: int, down_blocks: MXBlocks, out_dtype, method: str,
               interpret: bool) -> Array:
    return pl.pallas_call(
        functools.partial(_down_kernel, k=experts.shape[0] // T, br=down_blocks.bn, bfb=down_blocks.bk,
                          method=method, interpret=interpret),
        out_shape=jax.ShapeDtypeStruct((T, R), out_dtype),
        grid=(T, R // down_blocks.bn),
        compiler_params=triton_params(down_blocks.num_warps, down_blocks.num_stages, interpret),
        interpret=interpret,
        name="fused_moe_down",
    )(experts, weights, h, *stack_views(w2, False))


def _products(x, blocks: MXBlocks, act, planar: bool, interpret: bool) -> dict:
    return dict(bf=blocks.bn, bk=blocks.bk, act=act, h_dtype=x.dtype, method=blocks.decode, planar=planar,
                interpret=interpret)


@functools.partial(jax.jit, static_argnames=("act", "blocks", "down_blocks", "out_dtype", "planar", "interpret"))
def _fused_moe_mx_split(x, w1, w3, w2, weights, experts, *, act, blocks: MXBlocks, down_blocks: MXBlocks,
                        out_dtype, planar: bool, interpret: bool):
    T, R = x.shape
    k = experts.shape[1]
    experts, weights = experts.reshape(-1).astype(jnp.int32), weights.reshape(-1).astype(jnp.float32)
    kernel = functools.partial(_hidden_kernel, k=k, **_products(x, blocks, act, planar, interpret))
    h = _hidden_call(kernel, T, k, w1.shape[1], blocks, (), planar, interpret)(
        experts, x.astype(jnp.bfloat16), *stack_views(w1, False), *stack_views(w3, False))[0]
    return _down_call(experts, weights, h, w2, T, R, down_blocks, out_dtype, blocks.decode, interpret)


@functools.partial(jax.jit, static_argnames=("act", "k", "renormalize", "scaling", "blocks", "down_blocks",
                                             "out_dtype", "planar", "interpret"))
def _routed_moe_mx_split(x, w1, w3, w2, logits, correction_bias, *, act, k: int, renormalize: bool, scaling: float,
                         blocks: MXBlocks, down_blocks: MXBlocks, out_dtype, planar: bool, interpret: bool):
    T, R = x.shape
    logits, bias = padded_router_inputs(logits, correction_bias)
    kernel = functools.partial(_routed_hidden_kernel, k=k, renormalize=renormalize, scaling=scaling,
                               **_products(x, blocks, act, planar, interpret))
    pairs = (jax.ShapeDtypeStruct((T * k,), jnp.int32), jax.ShapeDtypeStruct((T * k,), jnp.float32))
    h, experts, weights = _hidden_call(kernel, T, k, w1.shape[1], blocks, pairs, planar, interpret)(
        logits, bias, x.astype(jnp.bfloat16), *stack_views(w1, False), *stack_views(w3, False))
    return _down_call(experts, weights, h, w2, T, R, down_blocks, out_dtype, blocks.decode, interpret)


# Hidden kernel: bn hidden units per program, bk contracted elements per tile (the accumulator's width is
# bk / 2); down kernel: bn output rows per program, bk hidden units per tile. No loops, so no stages. From
# a sweep at `mini`'s shape (H200, benchmarks/HISTORY.md, 2026-12-01).
SPLIT_MOE_BLOCKS = MXBlocks(bm=1, bn=16, bk=512, num_warps=8, num_stages=1, gemv=True)
SPLIT_MOE_DOWN_BLOCKS = MXBlocks(bm=1, bn=8, bk=256, num_warps=4, num_stages=1, gemv=True)
# One token: one output row per down program (1024 programs at `mini`), from a sweep with the weights from DRAM
# (15.2 us a layer against 16.0 with the tiles above; at 8 tokens 79.9 against 63.5; benchmarks/HISTORY.md, 2026-12-01).
SPLIT_MOE_DOWN_BLOCKS_ONE_TOKEN = MXBlocks(bm=1, bn=1, bk=256, num_warps=2, num_stages=1, gemv=True)
# h between the two kernels, planar: [T*k, F/32, 2, 16], each block of 32 hidden units stored as its 16 even
# units, then its 16 odd ones, so the down kernel loads each plane of h whole, in the layout of the decoded
# w2 tile it multiplies. Interleaved ([T*k, F]), the down kernel reads each plane with stride 2, in a layout
# Triton converts to the tile's through shared memory (two conversions per tile). Planar up to
# ``KernelPolicy.split_moe_planar_h_max_tokens`` tokens.


def _fit(w1: MXTensor, tokens: int, blocks: MXBlocks | None, down_blocks: MXBlocks | None
         ) -> tuple[MXBlocks, MXBlocks, bool]:
    """The tiles shrunk to fit w1's F and R (see ``fused_moe_mx_split``); where not given, the module's
    defaults as they are at the call (so a benchmark can switch them), the down tiles by the token count;
    and whether h is planar at this token count (``KernelPolicy.split_moe_planar_h_max_tokens``). A planar h
    needs an even and an odd unit in each hidden program."""
    planar = tokens <= current().policy.split_moe_planar_h_max_tokens
    _, F, R = w1.shape
    blocks = SPLIT_MOE_BLOCKS if blocks is None else blocks
    if down_blocks is None:
        down_blocks = SPLIT_MOE_DOWN_BLOCKS_ONE_TOKEN if tokens == 1 else SPLIT_MOE_DOWN_BLOCKS
    scale_blocks = lambda n, cap: BLOCK * largest_pow2_divisor(n // BLOCK, max(cap // BLOCK, 1))
    bn = largest_pow2_divisor(F, max(blocks.bn, 2 if planar else 1))
    blocks = dataclasses.replace(blocks, bn=bn, bk=scale_blocks(R, blocks.bk))
    down_blocks = dataclasses.replace(down_blocks, bn=largest_pow2_divisor(R, down_blocks.bn),
                                      bk=scale_blocks(F, down_blocks.bk))
    return blocks, down_blocks, planar


def fused_moe_mx_split(x: Array, w1: MXTensor, w3: MXTensor, w2: MXTensor, weights: Array, experts: Array, act, *,
                       blocks: MXBlocks | None = None, down_blocks: MXBlocks | None = None,
                       out_dtype=None, interpret: bool | None = None) -> Array:
    """Routed experts for a few tokens: x [T, R] (bf16/f32; rounded to bf16 in the kernel), MXFP4 stacks
    w1, w3 [E, F, R] and w2 [E, R, F], weights float32 [T, k], experts int32 [T, k], act(gate, up) ->
    hidden. Returns the sum over the k pairs of weight * expert(x), [T, R] in ``out_dtype`` (default x's
    dtype; float32 accumulation, so float32 is the sums unrounded).
    Tiles (shrunk to fit; by default ``SPLIT_MOE_BLOCKS``): ``blocks.bn`` hidden units per program (a
    power of two dividing F), ``blocks.bk`` contracted elements per tile (32 times a power of two, dividing R);
    ``down_blocks.bn`` output rows per program (a power of two dividing R), ``down_blocks.bk``
    hidden units per tile (32 times a power of two, dividing F); by default
    ``SPLIT_MOE_DOWN_BLOCKS_ONE_TOKEN`` for one token, else ``SPLIT_MOE_DOWN_BLOCKS``. Each program
    unrolls its tiles, so R / blocks.bk and k * F / down_blocks.bk set the kernels' code size."""
    check_moe_operands(x, w1, w3, w2, weights, experts)
    blocks, down_blocks, planar = _fit(w1, x.shape[0], blocks, down_blocks)
    interpret = _platform.interpret() if interpret is None else interpret
    check_stack_offsets(w1, w3, w2, interpret)
    return _fused_moe_mx_split(x, w1, w3, w2, weights, experts, act=act, blocks=blocks, down_blocks=down_blocks,
                               out_dtype=jnp.dtype(x.dtype if out_dtype is None else out_dtype), planar=planar,
                               interpret=interpret)


def routed_moe_mx_split(x: Array, w1: MXTensor, w3: MXTensor, w2: MXTensor, logits: Array, correction_bias: Array,
                        act, *, k: int, renormalize: bool, scaling_factor: float, blocks: MXBlocks | None = None,
                        down_blocks: MXBlocks | None = None, out_dtype=None,
                        interpret: bool | None = None) -> Array:
    """The router's selection and ``fused_moe_mx_split`` in the same two kernels: from the router logits
    [T, E] (float32) and correction bias [E], each hidden program picks its pair's expert and weight
    (``pallas_kernels.moe.triton_select.expert_ranks``: ``select_experts``' k, renormalize and scaling factor), so
    no selection kernel runs before them; the down kernel reads the pairs the hidden kernel wrote.
    Other arguments as ``fused_moe_mx_split``."""
    check_router_inputs(logits, correction_bias, k)
    T, E = logits.shape
    if x.ndim != 2 or T != x.shape[0] or E != w1.shape[0]:
        raise ValueError(f"x [T, R] = {x.shape}, logits [T, E] = {logits.shape} and w1 [E, F, R] = {w1.shape} disagree")
    pairs = jax.ShapeDtypeStruct((T, k), jnp.int32)
    check_moe_operands(x, w1, w3, w2, pairs, pairs)
    blocks, down_blocks, planar = _fit(w1, T, blocks, down_blocks)
    interpret = _platform.interpret() if interpret is None else interpret
    check_stack_offsets(w1, w3, w2, interpret)
    return _routed_moe_mx_split(x, w1, w3, w2, logits, correction_bias, act=act, k=k, renormalize=renormalize,
                                scaling=float(scaling_factor), blocks=blocks, down_blocks=down_blocks,
                                out_dtype=jnp.dtype(x.dtype if out_dtype is None else out_dtype), planar=planar,
                                interpret=interpret)


__all__ = ["SPLIT_MOE_BLOCKS", "SPLIT_MOE_DOWN_BLOCKS",
           "SPLIT_MOE_DOWN_BLOCKS_ONE_TOKEN", "fused_moe_mx_split", "routed_moe_mx_split"]
