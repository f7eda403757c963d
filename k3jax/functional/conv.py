"""Causal depthwise short convolution (KDA's q/k/v conv, 4 taps), with its decode state."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from k3jax.typing import Array


def causal_conv(
    x: Array, weight: Array, state: Array | None = None, lengths: Array | None = None
) -> tuple[Array, Array]:
    """Depthwise causal conv: y[t, c] = sum_j weight[c, j] * x[t - W + 1 + j, c].

    x [B, T, F]; weight [F, W] (the last tap multiplies the current token); state [B, W-1, F] holds
    the W-1 inputs before x (zeros for a fresh sequence); lengths [B] (default T) counts the real
    tokens of each row, the rest being right padding. Returns (y [B, T, F] float32, the new state
    [B, W-1, F]: the last W-1 real inputs of each row, which is what the next call needs).
    """
    B, T, F = x.shape
    W = weight.shape[-1]
    x = x.astype(jnp.float32)
    if state is None:
        state = jnp.zeros((B, W - 1, F), jnp.float32)
    padded = jnp.concatenate([state.astype(jnp.float32), x], axis=1)  # [B, T + W - 1, F]
    w = weight.astype(jnp.float32)
    y = sum(padded[:, j : j + T] * w[:, j] for j in range(W))
    if lengths is None:
        return y, padded[:, T:]
    last = jax.vmap(lambda row, n: jax.lax.dynamic_slice_in_dim(row, n, W - 1, axis=0))(padded, lengths)
    return y, last


__all__ = ["causal_conv"]
