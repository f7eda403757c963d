"""KDA's short convolutions and SiLU: one decode step with the conv state updated in place, and a prefill chunk.

``conv_silu_step(xs, taps, state)`` is, for one new token per sequence, what the KDA layer computes as
``causal_conv(concatenate(xs), concatenate(taps), state)`` followed by ``jax.nn.silu``
(``k3jax.functional.conv``): per channel c of input i,

    y[b, c] = silu(state[b, 0, c'] w[c, 0] + ... + state[b, W-2, c'] w[c, W-2] + x[b, c] w[c, W-1])

in float32 with that summation order (c' = c + i F: the inputs' channels side by side in the state,
as the layer stores them), and the state moves up one token: rows 1.. become rows 0.., and x becomes
the last row. XLA does this at a decode step as two kernels (a copy of the state buffer, which the
update would otherwise overwrite while reading it, then one fusion), plus the concatenations; here
one program per (sequence, input, block of channels) reads its state columns, then writes them, so the
state is updated where it lies (the output aliases it).

``conv_silu_chunk(xs, taps, state)`` is the same convs and SiLU over a prefill chunk's tokens: one program per
(sequence, ``CHUNK_ROWS`` tokens, input and block of channels) takes the W-1 inputs before its first token (from x,
or from the state) and walks its tokens, summing in the decode step's order. The state after the chunk is left to
XLA (``k3jax.functional.conv.last_inputs``). On the H200 it took 44-45 us a `mini` KDA layer at a 2048-token chunk
against 48-77 for XLA's fusion (benchmarks/HISTORY.md, 2026-12-03). Interpret mode on CPU.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import _platform
from k3jax.typing import Array
from pallas_kernels._triton import triton_params

_F32 = jnp.float32
BLOCK_CHANNELS = 256  # channels per program (at most; a power of two dividing F)
CHUNK_ROWS = 64  # a prefill chunk's tokens per program (at most; a power of two dividing T)


def conv_silu_values(past: list, x: Array, taps: list) -> tuple[Array, list]:
    """One channel block's conv step in float32: silu(past[0] taps[0] + ... + x taps[W-1]) summed in that
    order, and the state's rows after it, past[1:] + [x] (the kernels' shared arithmetic, so that every form
    of the step gives the same bits)."""
    y = jnp.zeros_like(x)
    for value, tap in zip(past + [x], taps):
        y = y + value * tap
    return y / (1.0 + jnp.exp(-y)), past[1:] + [x]


def _conv_silu_kernel(*refs, n_inputs: int, block: int):
    """Refs: xs [B, F] (n_inputs), taps [F, W] (n_inputs), the state input [B, W-1, n F], then ys [B, F]
    float32 (n_inputs) and the state output, which is the state input's buffer (aliased): the state is
    read and written through that one ref, so its loads and stores keep their program order."""
    xs, taps = refs[:n_inputs], refs[n_inputs:2 * n_inputs]
    ys, state = refs[2 * n_inputs + 1:3 * n_inputs + 1], refs[-1]
    b, program = pl.program_id(0), pl.program_id(1)
    width = xs[0].shape[1]
    rows = state.shape[1]  # W - 1
    blocks_per_input = width // block
    for i in range(n_inputs):
        @pl.when(program // blocks_per_input == i)
        def _(i=i):
            first = pl.multiple_of((program % blocks_per_input) * block, block)
            channels = pl.ds(first, block)
            at = lambda r: (pl.ds(b, 1), pl.ds(r, 1), pl.ds(i * width + first, block))
            x = xs[i][pl.ds(b, 1), channels].astype(_F32).reshape(block)
            past = [state[at(r)].reshape(block) for r in range(rows)]
            tap = [pltriton.load(taps[i].at[channels, pl.ds(j, 1)]).reshape(block) for j in range(rows + 1)]
            y, new_rows = conv_silu_values(past, x, tap)
            ys[i][pl.ds(b, 1), channels] = y.reshape(1, block)
            for r, value in enumerate(new_rows):
                state[at(r)] = value.reshape(1, 1, block)


@functools.partial(jax.jit, static_argnames=("interpret",))
def _conv_silu_step(xs, taps, state, *, interpret: bool):
    B, width = xs[0].shape
    block = min(BLOCK_CHANNELS, width & -width)
    n = len(xs)
    out_shape = [jax.ShapeDtypeStruct((B, width), _F32)] * n + [jax.ShapeDtypeStruct(state.shape, _F32)]
    *ys, new_state = pl.pallas_call(
        functools.partial(_conv_silu_kernel, n_inputs=n, block=block),
        out_shape=out_shape,
        grid=(B, n * (width // block)),
        input_output_aliases={2 * n: n},
        compiler_params=triton_params(4, 1, interpret),
        interpret=interpret,
        name="conv_silu_step",
    )(*xs, *taps, state)
    return tuple(ys), new_state


def _conv_silu_chunk_kernel(*refs, n_inputs: int, block: int, rows: int):
    """Refs: xs [B, T, F] (n_inputs), taps [F, W] (n_inputs), the state [B, W-1, n F], then ys [B, T, F] float32
    (n_inputs). Program (sequence, block of ``rows`` tokens, input and block of channels): the W-1 inputs before
    its first token (from x, or from the state where they precede the chunk), then its tokens in order, each conv
    summed as ``conv_silu_values`` sums a decode step's."""
    xs, taps, state, ys = refs[:n_inputs], refs[n_inputs:2 * n_inputs], refs[2 * n_inputs], refs[2 * n_inputs + 1:]
    b, token_block, program = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    width = xs[0].shape[2]
    W = state.shape[1] + 1
    blocks_per_input = width // block
    first_token = token_block * rows
    for i in range(n_inputs):
        @pl.when(program // blocks_per_input == i)
        def _(i=i):
            first = pl.multiple_of((program % blocks_per_input) * block, block)
            channels = pl.ds(first, block)
            row = lambda t: xs[i][pl.ds(b, 1), pl.ds(t, 1), channels].astype(_F32).reshape(block)
            tap = [pltriton.load(taps[i].at[channels, pl.ds(j, 1)]).reshape(block) for j in range(W)]
            past = []
            for delay in range(W - 1, 0, -1):  # the input `delay` tokens before the block's first: x, or the state
                at = first_token - delay
                stored = state[pl.ds(b, 1), pl.ds(jnp.clip(W - 1 + at, 0, W - 2), 1), pl.ds(i * width + first, block)]
                past.append(jnp.where(at >= 0, row(jnp.maximum(at, 0)), stored.reshape(block)))

            def token(t, past):
                y, past = conv_silu_values(past, row(first_token + t), tap)
                ys[i][pl.ds(b, 1), pl.ds(first_token + t, 1), channels] = y.reshape(1, 1, block)
                return past

            jax.lax.fori_loop(0, rows, token, past)


@functools.partial(jax.jit, static_argnames=("interpret",))
def _conv_silu_chunk(xs, taps, state, *, interpret: bool):
    B, T, width = xs[0].shape
    block = min(BLOCK_CHANNELS, width & -width)
    rows = min(CHUNK_ROWS, T & -T)
    n = len(xs)
    return tuple(pl.pallas_call(
        functools.partial(_conv_silu_chunk_kernel, n_inputs=n, block=block, rows=rows),
        out_shape=[jax.ShapeDtypeStruct((B, T, width), _F32)] * n,
        grid=(B, T // rows, n * (width // block)),
        compiler_params=triton_params(2, 2, interpret),
        interpret=interpret,
        name="conv_silu_chunk",
    )(*xs, *taps, state))


def conv_silu_chunk(xs: Sequence[Array], taps: Sequence[Array], state: Array, *,
                    interpret: bool | None = None) -> tuple[Array, ...]:
    """xs: n arrays [B, T, F] (a prefill chunk's inputs, bf16 or float32), taps: n float32 [F, W], state: float32
    [B, W-1, n F] (the W-1 inputs before the chunk, side by side) -> n float32 [B, T, F]: silu of each causal conv,
    at every token (padding included). The state after the chunk is the caller's
    (``k3jax.functional.conv.last_inputs``)."""
    xs, taps = tuple(xs), tuple(taps)
    _check_operands(xs, taps, state, "[B, T, F]", 3)
    interpret = _platform.interpret() if interpret is None else interpret
    return _conv_silu_chunk(xs, tuple(w.astype(_F32) for w in taps), state, interpret=interpret)


def conv_silu_step(xs: Sequence[Array], taps: Sequence[Array], state: Array, *,
                   interpret: bool | None = None) -> tuple[tuple[Array, ...], Array]:
    """xs: n arrays [B, F] (one token per sequence; bf16 or float32), taps: n float32 [F, W], state:
    float32 [B, W-1, n F] (the inputs' last W-1 tokens, side by side) -> (n float32 [B, F]: silu of
    each causal conv, the new state [B, W-1, n F], written over the state's buffer where the caller no
    longer needs it, as in a decode step with a donated cache)."""
    xs, taps = tuple(xs), tuple(taps)
    _check_operands(xs, taps, state, "[B, F]", 2)
    interpret = _platform.interpret() if interpret is None else interpret
    return _conv_silu_step(xs, tuple(w.astype(_F32) for w in taps), state, interpret=interpret)


def _check_operands(xs: tuple, taps: tuple, state: Array, layout: str, ndim: int) -> None:
    """As many taps [F, W] as inputs (at least one), each input shaped as the first (``layout``, ``ndim`` axes,
    F last), the state float32 [B, W-1, n F]."""
    if not xs or len(taps) != len(xs):
        raise ValueError(f"the short convs need as many taps as inputs (at least one), got {len(xs)} and {len(taps)}")
    shape = xs[0].shape
    if len(shape) != ndim:
        raise ValueError(f"input 0 must be {layout}, got {shape}")
    B, width = shape[0], shape[-1]
    for i, (x, w) in enumerate(zip(xs, taps)):
        if x.shape != shape:
            raise ValueError(f"input {i} must be {layout} = {list(shape)} like input 0, got {x.shape}")
        if w.ndim != 2 or w.shape[0] != width or w.shape[1] < 2:
            raise ValueError(f"taps {i} must be [F, W] with F = {width} and W >= 2, got {w.shape}")
    W = taps[0].shape[1]
    if state.shape != (B, W - 1, len(xs) * width) or state.dtype != _F32:
        raise ValueError(f"state must be float32 [B, W-1, n F] = [{B}, {W - 1}, {len(xs) * width}], "
                         f"got {state.dtype} {state.shape}")


__all__ = ["BLOCK_CHANNELS", "CHUNK_ROWS", "conv_silu_chunk", "conv_silu_step", "conv_silu_values"]
