"""Fused routed-expert MoE for a few tokens (decode): one kernel, no sort and no scatter.

``fused_moe_mx(x, w1, w3, w2, weights, experts, act)`` computes, for x [T, R] and each of its k
(token, expert) pairs, ``y[t] += weight * act(x[t] w1[e]^T, x[t] w3[e]^T) w2[e]^T`` with MXFP4
expert stacks w1, w3 [E, F, R] and w2 [E, R, F] (the released layout). The sorted dispatch needs
an argsort, a bincount, a gather, three grouped matmuls and a scatter per layer; at decode sizes
those small kernels cost more than the weights take to stream. Here one program owns a pair and
a block of bf hidden units:

1. gate and up for its bf rows of w1 and w3, by the one-row products of the MX kernels (decoded
   codes times the matching even / odd columns of x on the CUDA cores, float32 sums). The rows are
   read as their even and odd halves (a free view of the stack, [E, F/2, 2, ...]), so the hidden
   values come out split the way step 2 needs them;
2. h = act(gate, up), rounded to x's dtype as the reference's matmul outputs are;
3. its bf columns of w2 (one or more 32-element scale blocks along F) times h, added into the
   float32 output rows of its token with atomic adds, scaled by the routing weight.

The grid is (pairs, F / bf); programs of one pair read disjoint weights, so every routed weight
byte is read once per pair. Interpret mode on CPU runs the same body (the decode emulated). The MoE
layer takes ``moe_split.py``'s two kernels instead (no atomics, faster at every token count measured
on the H200); this one stays as their comparison (``SPLIT_MIN_TOKENS``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from k3jax.implementation import pallas_interpret
from k3jax.mx import BLOCK, MXTensor
from k3jax.typing import Array
from pallas_kernels._triton import check_offsets, triton_params
from pallas_kernels.mx_matmul.kernel import SCALE_BLOCK_BYTES, MXBlocks, decode_weight_planes
from pallas_kernels.mx_matmul.ops import _largest_pow2_divisor


def _one_row_products(codes_at, scales_at, x_ref, token, n_steps: int, bk: int, method: str, interpret: bool):
    """float32 [rows] = sum over loop steps i of decoded w tiles [rows, bk/2] (even, odd planes) times
    the matching even / odd columns of x's row ``token`` (strided loads); codes_at(i), scales_at(i) load
    step i's tiles."""
    half = bk // 2

    def step(i, acc):
        first = pl.multiple_of(i * bk, bk)
        planes = decode_weight_planes(codes_at(i), scales_at(i), method, interpret)
        for parity, w in enumerate(planes):
            x = x_ref[token, pl.ds(first + parity, half, stride=2)]
            acc = acc + w.astype(jnp.float32) * x.astype(jnp.float32)[None, :]
        return acc

    rows = codes_at(0).shape[0]
    return jnp.sum(jax.lax.fori_loop(0, n_steps, step, jnp.zeros((rows, half), jnp.float32)), axis=1)


def _fused_moe_kernel(experts_ref, weights_ref, x_ref, w1c_ref, w1s_ref, w3c_ref, w3s_ref,
                      w2c_ref, w2s_ref, y_init_ref, y_ref, *, k: int, bf: int, bk: int, br: int, act,
                      h_dtype, method: str, interpret: bool):
    """Refs: experts, weights [T*k]; x [T, R] bf16; w1, w3 codes [E, F/2, 2, R/32, 16] and scales
    [..., 1]; w2 codes [E, R, F/32, 16] and scales [..., 1]; y [T, R] float32 (aliased to y_init,
    zeros). Program (pair, block of bf hidden units)."""
    pair, block = pl.program_id(0), pl.program_id(1)
    expert, token, weight = experts_ref[pair], pair // k, weights_ref[pair]
    R = x_ref.shape[1]
    rows = pl.ds(pl.multiple_of(block * (bf // 2), bf // 2), bf // 2)
    g = bk // BLOCK

    def project(codes_ref, scales_ref, parity):
        at = lambda ref: lambda i: ref[expert, rows, parity, pl.ds(pl.multiple_of(i * g, g), g), :]
        return _one_row_products(at(codes_ref), at(scales_ref), x_ref, token, R // bk, bk, method, interpret)

    def hidden(parity):
        gate = project(w1c_ref, w1s_ref, parity).astype(h_dtype)
        up = project(w3c_ref, w3s_ref, parity).astype(h_dtype)
        return act(gate, up).astype(jnp.float32)

    h = (hidden(0), hidden(1))  # hidden units 2i and 2i + 1 of the block: w2's even / odd columns
    f_blocks = pl.ds(pl.multiple_of(block * (bf // BLOCK), bf // BLOCK), bf // BLOCK)

    def down(j, carry):
        out_rows = pl.ds(pl.multiple_of(j * br, br), br)
        planes = decode_weight_planes(w2c_ref[expert, out_rows, f_blocks, :], w2s_ref[expert, out_rows, f_blocks, :],
                                      method, interpret)
        y = sum(jnp.sum(w.astype(jnp.float32) * h_p[None, :], axis=1) for w, h_p in zip(planes, h))
        pltriton.atomic_add(y_ref, (token, out_rows), weight * y)  # runs in interpret mode too
        return carry

    jax.lax.fori_loop(0, R // br, down, 0)


def _stack_views(w: MXTensor, rows_in_pairs: bool) -> tuple[Array, Array]:
    """Free views of a stack's codes [E, N, K/2] and scales [E, N, K/32]: [E, N, K/32, 16] and
    [E, N, K/32, 1], or with rows_in_pairs [E, N/2, 2, K/32, 16] and [E, N/2, 2, K/32, 1]."""
    E, N, half = w.codes.shape
    lead = (E, N // 2, 2) if rows_in_pairs else (E, N)
    return (w.codes.reshape(*lead, half // SCALE_BLOCK_BYTES, SCALE_BLOCK_BYTES),
            w.scales.reshape(*lead, w.scales.shape[-1], 1))


@functools.partial(jax.jit, static_argnames=("act", "blocks", "bf", "br", "out_dtype", "interpret"))
def _fused_moe_mx(x, w1, w3, w2, weights, experts, *, act, blocks, bf, br, out_dtype, interpret):
    T, R = x.shape
    k = experts.shape[1]
    F = w1.shape[1]
    xb = x.astype(jnp.bfloat16)
    kernel = functools.partial(_fused_moe_kernel, k=k, bf=bf, bk=blocks.bk, br=br, act=act, h_dtype=x.dtype,
                               method=blocks.decode, interpret=interpret)
    y = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((T, R), jnp.float32),
        grid=(T * k, F // bf),
        input_output_aliases={9: 0},
        compiler_params=triton_params(blocks.num_warps, blocks.num_stages, interpret),
        interpret=interpret,
        name="fused_moe_mx",
    )(experts.reshape(-1).astype(jnp.int32), weights.reshape(-1).astype(jnp.float32), xb,
      *_stack_views(w1, True), *_stack_views(w3, True), *_stack_views(w2, False), jnp.zeros((T, R), jnp.float32))
    return y.astype(out_dtype)


# Tiles from the one-token sweep at `mini`'s shape (H200, benchmarks/RESULTS.md, fifth session): 32 hidden
# units and up to 1024 contracted elements per program, the whole output row per atomic add, 8 warps:
# 16.2 us against 23.7 us for 256 / 128 / 4 warps. Larger bk and down rows shorten each program's chain
# of dependent steps, which is what a decode-sized MoE waits on.
FUSED_MOE_BLOCKS = MXBlocks(bm=1, bn=32, bk=1024, num_warps=8, num_stages=2, gemv=True)
FUSED_MOE_DOWN_ROWS = 1024
FUSED_MOE_MAX_PAIRS = 64  # (token, expert) pairs up to which the MoE layer may use this kernel
FUSED_MOE_MAX_ADDERS = 256  # programs adding into one output row (k * F / bf) beyond which atomics contend


def fused_moe_pays(pairs: int, experts_per_token: int, hidden: int, blocks: MXBlocks = FUSED_MOE_BLOCKS) -> bool:
    """Whether the MoE layer should take this kernel: few pairs, and few programs adding into each
    output row. Measured on the H200 (benchmarks/RESULTS.md): at the `mini` preset's 8 x 24 = 192 adders
    the fused kernel took the batch-1 decode step from 1.50 to 1.40 ms; at K3's 16 x 96 = 1536 it
    was 1.13x slower than the sorted dispatch at 1 token and 1.9x at 8 (atomics on the same rows)."""
    return pairs <= FUSED_MOE_MAX_PAIRS and experts_per_token * hidden // blocks.bn <= FUSED_MOE_MAX_ADDERS


def _check_moe_operands(x: Array, w1: MXTensor, w3: MXTensor, w2: MXTensor, weights: Array, experts: Array) -> None:
    """The fused MoE kernels' operands: MXFP4 stacks w1, w3 [E, F, R] and w2 [E, R, F], x [T, R],
    weights and experts [T, k]; F and R whole scale blocks."""
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


def _check_stack_offsets(w1: MXTensor, w3: MXTensor, w2: MXTensor, interpret: bool) -> None:
    """The fused MoE kernels index the whole stacks in Triton: a ValueError where those offsets wrap
    (``offsets_wrap``; the interpreter computes them right)."""
    if not interpret:
        stacks = {f"{name}.{part}": getattr(w, part) for name, w in (("w1", w1), ("w3", w3), ("w2", w2))
                  for part in ("codes", "scales")}
        check_offsets("tiled_moe_mx and the sorted dispatch (grouped_mx_matmul) take such stacks", **stacks)


def fused_moe_mx(x: Array, w1: MXTensor, w3: MXTensor, w2: MXTensor, weights: Array, experts: Array, act, *,
                 blocks: MXBlocks = FUSED_MOE_BLOCKS, down_rows: int = FUSED_MOE_DOWN_ROWS, out_dtype=None,
                 interpret: bool | None = None) -> Array:
    """Routed experts for a few tokens in one kernel: x [T, R] (bf16/f32), MXFP4 stacks w1, w3
    [E, F, R] and w2 [E, R, F], weights float32 [T, k], experts int32 [T, k], act(gate, up) ->
    hidden. Returns sum over the k pairs of weight * expert(x), [T, R] in ``out_dtype`` (default x's
    dtype; float32 accumulation, so float32 is the sums unrounded). ``blocks.bn`` (hidden units per
    program, a multiple of 32 dividing F), ``blocks.bk`` (a power of two dividing R) and ``down_rows``
    (output rows per atomic add of the down projection) are shrunk to fit."""
    _check_moe_operands(x, w1, w3, w2, weights, experts)
    _, F, R = w1.shape
    bf = BLOCK * _largest_pow2_divisor(F // BLOCK, max(blocks.bn // BLOCK, 1))
    bk = BLOCK * _largest_pow2_divisor(R // BLOCK, max(blocks.bk // BLOCK, 1))
    br = BLOCK * _largest_pow2_divisor(R // BLOCK, max(down_rows // BLOCK, 1))
    interpret = pallas_interpret() if interpret is None else interpret
    _check_stack_offsets(w1, w3, w2, interpret)
    return _fused_moe_mx(x, w1, w3, w2, weights, experts, act=act, blocks=dataclasses.replace(blocks, bk=bk),
                         bf=bf, br=br, out_dtype=jnp.dtype(x.dtype if out_dtype is None else out_dtype),
                         interpret=interpret)


__all__ = ["FUSED_MOE_BLOCKS", "FUSED_MOE_DOWN_ROWS", "FUSED_MOE_MAX_ADDERS", "FUSED_MOE_MAX_PAIRS", "fused_moe_mx",
           "fused_moe_pays"]
