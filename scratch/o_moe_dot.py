"""Issue 4 (helper o): fused decode MoE with the products on the tensor cores, experimental knobs.

Same contract as pallas_kernels/mx_matmul/moe.py::fused_moe_mx. Gate / up: each step's tile [bf/2 rows, bk/2] per plane is viewed as [bf/2 * S, bk/2/S] (S contracted segments
folded into the rows, so the dot's M is large enough for wgmma without replicating the decode across warps) times
x's plane as [bk/2/S, COLS] (column c = segment c % S); row r * S + s keeps column s. Down: w2 [br, bf/2] times h
broadcast over COLS columns, column 0 kept.
Knobs (static):
- loads_first: with one gate / up step (bk = R) and one down step (br = R), every tile of the program is
  loaded before any decode.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from k3jax.mx import BLOCK, MXTensor
from pallas_kernels.mx_matmul.kernel import MXBlocks, _gpu_compiler_params, decode_weight_planes
from pallas_kernels.mx_matmul.moe import _stack_views
from pallas_kernels.mx_matmul.ops import _largest_pow2_divisor

COLS = 16
MAX_SEGMENTS = 16


def _bf16_pieces(h):
    if h.dtype == jnp.bfloat16:
        return [h]
    hi = h.astype(jnp.bfloat16)
    r = h - hi.astype(jnp.float32)
    mid = r.astype(jnp.bfloat16)
    return [hi, mid, (r - mid.astype(jnp.float32)).astype(jnp.bfloat16)]


def _views(w, rows_in_pairs):
    codes, scales = _stack_views(w, rows_in_pairs)
    return codes, scales[..., 0]


def _segments(g: int) -> int:
    return min(MAX_SEGMENTS, g & -g)


def _kernel(experts_ref, weights_ref, x_ref, w1c_ref, w1s_ref, w3c_ref, w3s_ref, w2c_ref, w2s_ref, y_init_ref,
            y_ref, *, k, bf, bk, br, act, h_dtype, method, interpret, loads_first, one_loop):
    pair, block = pl.program_id(0), pl.program_id(1)
    expert, token, weight = experts_ref[pair], pair // k, weights_ref[pair]
    R = x_ref.shape[1]
    nr = bf // 2
    rows = pl.ds(pl.multiple_of(block * nr, nr), nr)
    g = bk // BLOCK
    half = bk // 2
    S = _segments(g)
    n_steps, n_down = R // bk, R // br
    f_blocks = pl.ds(pl.multiple_of(block * (bf // BLOCK), bf // BLOCK), bf // BLOCK)
    dims = (((1,), (1,)), ((), ()))

    def at(i, size):
        return pl.ds(pl.multiple_of(i * size, size), size) if not isinstance(i, int) else pl.ds(i * size, size)

    def gate_up_tile(ref, parity, i):  # [nr * S, g / S, 16 or 1]: row r, segment s of the step at r * S + s
        if ref.ndim == 4:  # scales [E, F/2, 2, R/32]: loaded as [nr, g] (g contiguous bytes), then a size-1 axis
            return ref[expert, rows, parity, at(i, g)].reshape(nr * S, g // S, 1)
        return ref[expert, rows, parity, at(i, g), :].reshape(nr * S, g // S, ref.shape[-1])

    def down_tile(ref, j):
        if ref.ndim == 3:  # scales [E, R, F/32]
            return ref[expert, at(j, br), f_blocks].reshape(br, bf // BLOCK, 1)
        return ref[expert, at(j, br), f_blocks, :]

    def x_planes(i):  # [COLS, half / S]: column c of the dot holds segment c % S of the plane
        first = i * bk
        out = []
        for p in (0, 1):
            v = x_ref[token, pl.ds(first + p, half, stride=2)].reshape(S, half // S)
            out.append(jnp.broadcast_to(v[None], (COLS // S, S, half // S)).reshape(COLS, half // S))
        return out

    def products(codes, scales, xs, acc):
        for w, x in zip(decode_weight_planes(codes, scales, method, interpret), xs):
            acc = acc + jax.lax.dot_general(w, x, dims, preferred_element_type=jnp.float32)
        return acc

    def row_sums(acc):  # [nr * S, COLS] -> [nr]: row r's segments s from column s
        r = jax.lax.broadcasted_iota(jnp.int32, acc.shape, 0)
        c = jax.lax.broadcasted_iota(jnp.int32, acc.shape, 1)
        return jnp.sum(jnp.sum(jnp.where(c == r % S, acc, 0.0), axis=1).reshape(nr, S), axis=1)

    def down_sum(codes, scales, hs):
        y = None
        for w, h in zip(decode_weight_planes(codes, scales, method, interpret), hs):
            for piece in _bf16_pieces(h):
                d = jnp.dot(w, jnp.broadcast_to(piece[:, None], (nr, COLS)), preferred_element_type=jnp.float32)
                y = d if y is None else y + d
        first = jax.lax.broadcasted_iota(jnp.int32, y.shape, 1) == 0
        return jnp.sum(jnp.where(first, y, 0.0), axis=1)

    def hidden(gate, up):
        return act(row_sums(gate).astype(h_dtype), row_sums(up).astype(h_dtype))

    zero = jnp.zeros((nr * S, COLS), jnp.float32)
    if loads_first:
        tiles = [(gate_up_tile(c, p, 0), gate_up_tile(s, p, 0))
                 for c, s in ((w1c_ref, w1s_ref), (w3c_ref, w3s_ref)) for p in (0, 1)]
        w2 = (down_tile(w2c_ref, 0), down_tile(w2s_ref, 0))
        xs = x_planes(0)
        g0, g1, u0, u1 = (products(c, s, xs, zero) for c, s in tiles)
        h = (hidden(g0, u0), hidden(g1, u1))
        pltriton.atomic_add(y_ref, (token, pl.ds(0, br)), weight * down_sum(*w2, h))
        return

    def project(codes_ref, scales_ref, parity):
        step = lambda i, acc: products(gate_up_tile(codes_ref, parity, i), gate_up_tile(scales_ref, parity, i),
                                       x_planes(i), acc)
        return jax.lax.fori_loop(0, n_steps, step, zero)

    if one_loop:  # one loop over the contracted steps, the four gate / up tiles of a step together
        tile_refs = [(c, sr, p) for c, sr in ((w1c_ref, w1s_ref), (w3c_ref, w3s_ref)) for p in (0, 1)]

        def step4(i, accs):
            xs = x_planes(i)
            return tuple(products(gate_up_tile(c, p, i), gate_up_tile(sr, p, i), xs, acc)
                         for (c, sr, p), acc in zip(tile_refs, accs))

        g0, g1, u0, u1 = jax.lax.fori_loop(0, n_steps, step4, (zero,) * 4)
        h = (hidden(g0, u0), hidden(g1, u1))
    else:
        h = tuple(hidden(project(w1c_ref, w1s_ref, p), project(w3c_ref, w3s_ref, p)) for p in (0, 1))

    def down(j, carry):
        y = down_sum(down_tile(w2c_ref, j), down_tile(w2s_ref, j), h)
        pltriton.atomic_add(y_ref, (token, at(j, br)), weight * y)
        return carry

    jax.lax.fori_loop(0, n_down, down, 0)


@functools.partial(jax.jit, static_argnames=("act", "blocks", "bf", "bk", "br", "out_dtype", "interpret", "one_loop",
                                             "loads_first", "debug"))
def _fused(x, w1, w3, w2, weights, experts, *, act, blocks, bf, bk, br, out_dtype, interpret, loads_first,
           one_loop=False, debug=False):
    T, R = x.shape
    k = experts.shape[1]
    F = w1.shape[1]
    kernel = functools.partial(_kernel, k=k, bf=bf, bk=bk, br=br, act=act, h_dtype=x.dtype, method=blocks.decode,
                               interpret=interpret, loads_first=loads_first, one_loop=one_loop)
    y = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((T, R), jnp.float32),
        grid=(T * k, F // bf),
        input_output_aliases={9: 0},
        compiler_params=_gpu_compiler_params(blocks, interpret),
        interpret=interpret,
        debug=debug,
        name="fused_moe_mx_dot",
    )(experts.reshape(-1).astype(jnp.int32), weights.reshape(-1).astype(jnp.float32), x.astype(jnp.bfloat16),
      *_views(w1, True), *_views(w3, True), *_views(w2, False), jnp.zeros((T, R), jnp.float32))
    return y.astype(out_dtype)


def fused_moe_dot(x, w1: MXTensor, w3, w2, weights, experts, act, *, bf=32, bk=1024, br=1024, num_warps=8,
                  num_stages=2, loads_first=False, one_loop=False, out_dtype=None, interpret=None, debug=False):
    E, F, R = w1.shape
    bf = BLOCK * _largest_pow2_divisor(F // BLOCK, max(bf // BLOCK, 1))
    bk = BLOCK * _largest_pow2_divisor(R // BLOCK, max(bk // BLOCK, 1))
    br = BLOCK * _largest_pow2_divisor(R // BLOCK, max(br // BLOCK, 1))
    if loads_first and (bk != R or br != R):
        raise ValueError("loads_first needs bk = br = R")
    from k3jax.implementation import pallas_interpret
    interpret = pallas_interpret() if interpret is None else interpret
    blocks = MXBlocks(bm=1, bn=bf, bk=bk, num_warps=num_warps, num_stages=num_stages, gemv=True)
    return _fused(x, w1, w3, w2, weights, experts, act=act, blocks=blocks, bf=bf, bk=bk, br=br,
                  out_dtype=jnp.dtype(x.dtype if out_dtype is None else out_dtype), interpret=interpret,
                  loads_first=loads_first, one_loop=one_loop, debug=debug)
