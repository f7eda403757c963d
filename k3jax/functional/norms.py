"""RMSNorm and the gated RMSNorm of KDA's output, in float32."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from k3jax.typing import Array


def rms_norm(x: Array, weight: Array, eps: float) -> Array:
    """x * rsqrt(mean(x^2) + eps) * weight over the last axis; computed in float32, returned as x.dtype."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * weight.astype(jnp.float32)).astype(x.dtype)


def gated_rms_norm(x: Array, gate: Array, weight: Array, eps: float) -> Array:
    """KDA output norm: RMSNorm(x) * weight * sigmoid(gate), per head over the last axis."""
    return rms_norm(x, weight, eps) * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(x.dtype)


__all__ = ["rms_norm", "gated_rms_norm"]
