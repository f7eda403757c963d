"""Fused routed-expert MoE for a few tokens (decode): two kernels, no sort, scatter or atomics.

``fused_moe_mx(x, w1, w3, w2, weights, experts, act)`` computes, for x [T, R] and each of its k
(token, expert) pairs, ``y[t] += weight * act(x[t] w1[e]^T, x[t] w3[e]^T) w2[e]^T`` with MXFP4
expert stacks w1, w3 [E, F, R] and w2 [E, R, F] (the released layout). The sorted dispatch needs
an argsort, a bincount, a gather, three grouped matmuls and a scatter per layer; at decode sizes
those small kernels cost more than the weights take to stream. Here:

1. ``moe_hidden_mx``, one program per (pair, block of bf hidden units): gate and up for its bf rows
   of w1 and w3 by the one-row products of the MX kernels (decoded codes times the matching even /
   odd columns of x on the CUDA cores, float32 sums), then h = act(gate, up), rounded to x's dtype
   as the reference's matmul outputs are. The rows are read as their even and odd halves (a free
   view of the stack, [E, F/2, 2, ...]), so h comes out as the even / odd planes step 2 needs.
2. ``moe_down_mx``, one program per (token, block of br output rows): for each of the token's k
   pairs, w2[e]'s br rows times h, scaled by the routing weight and summed in float32; each output
   row is written by one program only. (The first version was one kernel adding the down
   projection into the output with atomics: at K3's shape, 16 x 96 programs adding into each row,
   it took 2685 us for 8 tokens against 1389-1446 us for these two kernels; benchmarks/RESULTS.md.)

Every routed weight byte is read once per pair. Interpret mode on CPU runs the same bodies (the
decode emulated).
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


def _one_row_products(codes_at, scales_at, x_refs, token, n_steps: int, bk: int, method: str, interpret: bool):
    """float32 [rows] = sum over loop steps i of decoded w tiles [rows, bk/2] (even, odd planes) times
    the matching x planes of ``token``; codes_at(i), scales_at(i) load step i's tiles."""
    half = bk // 2

    def step(i, acc):
        cols = pl.ds(pl.multiple_of(i * half, half), half)
        planes = decode_weight_planes(codes_at(i), scales_at(i), method, interpret)
        for x_ref, w in zip(x_refs, planes):
            acc = acc + w.astype(jnp.float32) * x_ref[token, cols].astype(jnp.float32)[None, :]
        return acc

    rows = codes_at(0).shape[0]
    return jnp.sum(jax.lax.fori_loop(0, n_steps, step, jnp.zeros((rows, half), jnp.float32)), axis=1)


def _hidden_kernel(experts_ref, x_even_ref, x_odd_ref, w1c_ref, w1s_ref, w3c_ref, w3s_ref, h_even_ref, h_odd_ref,
                   *, k: int, bf: int, bk: int, act, method: str, interpret: bool):
    """Refs: experts [T*k]; x_even, x_odd [T, R/2]; w1, w3 codes [E, F/2, 2, R/32, 16] and scales
    [..., 1]; h_even, h_odd [T*k, F/2] (x's dtype). Program (pair, block of bf hidden units): the
    block's gate and up sums, then h = act(gate, up) into the pair's row, split even / odd."""
    pair, block = pl.program_id(0), pl.program_id(1)
    expert, token = experts_ref[pair], pair // k
    x_refs = (x_even_ref, x_odd_ref)
    R = 2 * x_even_ref.shape[1]
    rows = pl.ds(pl.multiple_of(block * (bf // 2), bf // 2), bf // 2)
    g = bk // BLOCK

    def project(codes_ref, scales_ref, parity):
        at = lambda ref: lambda i: ref[expert, rows, parity, pl.ds(pl.multiple_of(i * g, g), g), :]
        return _one_row_products(at(codes_ref), at(scales_ref), x_refs, token, R // bk, bk, method, interpret)

    for parity, h_ref in enumerate((h_even_ref, h_odd_ref)):  # hidden units 2i, 2i + 1: w2's even / odd columns
        gate = project(w1c_ref, w1s_ref, parity).astype(h_ref.dtype)
        up = project(w3c_ref, w3s_ref, parity).astype(h_ref.dtype)
        h_ref[pair, rows] = act(gate, up).astype(h_ref.dtype)


def _down_kernel(experts_ref, weights_ref, h_even_ref, h_odd_ref, w2c_ref, w2s_ref, y_ref, *, k: int, br: int,
                 bk: int, method: str, interpret: bool):
    """Refs: experts, weights [T*k]; h_even, h_odd [T*k, F/2]; w2 codes [E, R, F/32, 16] and scales
    [..., 1]; y [T, R] float32. Program (token, block of br output rows): the weighted sum over the
    token's k pairs of w2[e] rows times h, written once (no other program touches these rows)."""
    token, block = pl.program_id(0), pl.program_id(1)
    rows = pl.ds(pl.multiple_of(block * br, br), br)
    F = 2 * h_even_ref.shape[1]
    g = bk // BLOCK

    def add_pair(j, acc):
        pair = token * k + j
        expert = experts_ref[pair]
        at = lambda ref: lambda i: ref[expert, rows, pl.ds(pl.multiple_of(i * g, g), g), :]
        y = _one_row_products(at(w2c_ref), at(w2s_ref), (h_even_ref, h_odd_ref), pair, F // bk, bk, method,
                              interpret)
        return acc + weights_ref[pair] * y

    y_ref[token, rows] = jax.lax.fori_loop(0, k, add_pair, jnp.zeros((br,), jnp.float32))


def _stack_views(w: MXTensor, rows_in_pairs: bool) -> tuple[Array, Array]:
    """Free views of a stack's codes [E, N, K/2] and scales [E, N, K/32]: [E, N, K/32, 16] and
    [E, N, K/32, 1], or with rows_in_pairs [E, N/2, 2, K/32, 16] and [E, N/2, 2, K/32, 1]."""
    E, N, half = w.codes.shape
    lead = (E, N // 2, 2) if rows_in_pairs else (E, N)
    return (w.codes.reshape(*lead, half // SCALE_BLOCK_BYTES, SCALE_BLOCK_BYTES),
            w.scales.reshape(*lead, w.scales.shape[-1], 1))


@functools.partial(jax.jit, static_argnames=("act", "blocks", "bf", "br", "bk_down", "interpret"))
def _fused_moe_mx(x, w1, w3, w2, weights, experts, *, act, blocks, bf, br, bk_down, interpret):
    T, R = x.shape
    k = experts.shape[1]
    F = w1.shape[1]
    xb = x.astype(jnp.bfloat16)
    experts, weights = experts.reshape(-1).astype(jnp.int32), weights.reshape(-1).astype(jnp.float32)
    params = _gpu_compiler_params(blocks, interpret)
    common = dict(method=blocks.decode, interpret=interpret)
    plane = jax.ShapeDtypeStruct((T * k, F // 2), x.dtype)
    h_even, h_odd = pl.pallas_call(
        functools.partial(_hidden_kernel, k=k, bf=bf, bk=blocks.bk, act=act, **common),
        out_shape=(plane, plane), grid=(T * k, F // bf), compiler_params=params, interpret=interpret,
        name="moe_hidden_mx",
    )(experts, xb[:, 0::2], xb[:, 1::2], *_stack_views(w1, True), *_stack_views(w3, True))
    y = pl.pallas_call(
        functools.partial(_down_kernel, k=k, br=br, bk=bk_down, **common),
        out_shape=jax.ShapeDtypeStruct((T, R), jnp.float32), grid=(T, R // br), compiler_params=params,
        interpret=interpret, name="moe_down_mx",
    )(experts, weights, h_even, h_odd, *_stack_views(w2, False))
    return y.astype(x.dtype)


FUSED_MOE_BLOCKS = MXBlocks(bm=1, bn=32, bk=512, num_warps=4, num_stages=2, gemv=True)
FUSED_MOE_DOWN_ROWS = 8  # output rows per program of the down-projection kernel
FUSED_MOE_MAX_PAIRS = 64  # (token, expert) pairs up to which the MoE layer may use these kernels


def fused_moe_pays(pairs: int) -> bool:
    """Whether the MoE layer should take the two-kernel MoE: few (token, expert) pairs (decode)."""
    return pairs <= FUSED_MOE_MAX_PAIRS


def fused_moe_mx(x: Array, w1: MXTensor, w3: MXTensor, w2: MXTensor, weights: Array, experts: Array, act, *,
                 blocks: MXBlocks = FUSED_MOE_BLOCKS, down_rows: int = FUSED_MOE_DOWN_ROWS,
                 interpret: bool | None = None) -> Array:
    """Routed experts for a few tokens in two kernels: x [T, R] (bf16/f32), MXFP4 stacks w1, w3
    [E, F, R] and w2 [E, R, F], weights float32 [T, k], experts int32 [T, k], act(gate, up) ->
    hidden. Returns sum over the k pairs of weight * expert(x), [T, R] in x's dtype (float32
    accumulation). ``blocks.bn`` (hidden units per program, a multiple of 32 dividing F),
    ``blocks.bk`` (contracted elements per step) and ``down_rows`` are shrunk to fit."""
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
    fit = lambda n, cap: BLOCK * _largest_pow2_divisor(n // BLOCK, max(cap // BLOCK, 1))
    interpret = pallas_interpret() if interpret is None else interpret
    return _fused_moe_mx(x, w1, w3, w2, weights, experts, act=act,
                         blocks=dataclasses.replace(blocks, bk=fit(R, blocks.bk)), bf=fit(F, blocks.bn),
                         br=_largest_pow2_divisor(R, down_rows), bk_down=fit(F, blocks.bk), interpret=interpret)


__all__ = ["FUSED_MOE_BLOCKS", "FUSED_MOE_DOWN_ROWS", "FUSED_MOE_MAX_PAIRS", "fused_moe_mx", "fused_moe_pays"]
