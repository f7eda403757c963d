"""Causal depthwise short convolution (KDA's q/k/v conv, 4 taps), with its decode state."""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.typing import Array


def _delayed(x: Array, state: Array, s: int) -> Array:
    """x [B, T, F] delayed by s steps along T, the state [B, W-1, F] (the inputs before x) filling the
    first s: rows [W-1-s, W-1-s+T) of the state and x side by side, without building that array."""
    T, first = x.shape[1], state.shape[1] - s  # the state's first row that the delayed x reads
    if s == 0:
        return x
    if s >= T:
        return state[:, first : first + T]
    return jnp.concatenate([state[:, first:], x[:, : T - s]], axis=1)


def last_inputs(x: Array, state: Array, lengths: Array | None) -> Array:
    """The last W-1 real inputs of each row of the state and x side by side [B, W-1, F]: those before
    position lengths[b] of x (default T)."""
    T, keep = x.shape[1], state.shape[1]
    if lengths is None:
        return x[:, T - keep :] if T >= keep else jnp.concatenate([state[:, T:], x], axis=1)
    position = lengths[:, None] + jnp.arange(keep)  # in the state and x side by side
    take = lambda a, i: jnp.take_along_axis(a, jnp.clip(i, 0, a.shape[1] - 1)[:, :, None], axis=1)
    return jnp.where((position < keep)[:, :, None], take(state, position), take(x, position - keep))


def causal_conv(
    x: Array, weight: Array, state: Array | None = None, lengths: Array | None = None
) -> tuple[Array, Array]:
    """Depthwise causal conv: y[t, c] = sum_j weight[c, j] * x[t - W + 1 + j, c].

    x [B, T, F]; weight [F, W] (the last tap multiplies the current token); state [B, W-1, F] holds
    the W-1 inputs before x (zeros for a fresh sequence); lengths [B] (default T) counts the real
    tokens of each row, the rest being right padding. Returns (y [B, T, F] float32, the new state
    [B, W-1, F]: the last W-1 real inputs of each row, which is what the next call needs).

    Each tap reads x delayed (``_delayed``), not a slice of the state and x concatenated: XLA keeps
    such a concatenation, read at W offsets, as an array of its own (on the H200 a 2048-token prefill
    chunk spent 21 us a KDA input writing it, then 14 us on the conv; benchmarks/HISTORY.md,
    2026-12-03), where a delayed copy per tap fuses into the conv.
    """
    B, T, F = x.shape
    W = weight.shape[-1]
    x = x.astype(jnp.float32)
    state = jnp.zeros((B, W - 1, F), jnp.float32) if state is None else state.astype(jnp.float32)
    w = weight.astype(jnp.float32)
    y = sum(_delayed(x, state, W - 1 - j) * w[:, j] for j in range(W))
    return y, last_inputs(x, state, lengths)


def input_states(xs: Sequence[Array], state: Array) -> list[Array]:
    """Each input's channels of a shared conv state [B, W - 1, sum F_i] (the inputs' channels side by side)."""
    ends = np.cumsum([x.shape[-1] for x in xs])
    return [state[..., end - x.shape[-1]:end] for x, end in zip(xs, ends)]


def short_convs(xs: Sequence[Array], taps: Sequence[Array], state: Array, lengths: Array | None = None) -> tuple:
    """KDA's short convs: silu(causal_conv(x_i, taps_i)) of each input x_i [B, T, F_i] with its channels
    of the shared state [B, W - 1, sum F_i] (no concatenated copy of the inputs). Returns (y_1, ...,
    y_n float32 [B, T, F_i], the new shared state)."""
    ys, states = [], []
    for x, w, s in zip(xs, taps, input_states(xs, state)):
        y, s = causal_conv(x, w, s, lengths)
        ys.append(jax.nn.silu(y))
        states.append(s)
    return (*ys, jnp.concatenate(states, axis=-1))


__all__ = ["causal_conv", "input_states", "last_inputs", "short_convs"]
