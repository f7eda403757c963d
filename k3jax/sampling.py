"""Next-token sampling: greedy, temperature, top-k, top-p, one compiled function for all settings."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from k3jax.typing import Array


@dataclass(frozen=True)
class Sampling:
    """temperature 0 is greedy; top_k 0 and top_p 1.0 switch those filters off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature: must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k: must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")


def sample(logits: Array, key: Array, temperature: Array, top_k: Array, top_p: Array) -> Array:
    """logits [B, V] -> tokens [B] int32. The settings are arrays, so changing them does not recompile."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    order = jnp.argsort(-logits, axis=-1)
    ranked = jnp.take_along_axis(logits, order, axis=-1) / jnp.maximum(temperature, 1e-6)
    rank = jnp.arange(logits.shape[-1])
    keep = (top_k <= 0) | (rank < top_k)
    probs = jax.nn.softmax(jnp.where(keep, ranked, -jnp.inf), axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # probability mass ranked strictly above each token
    keep = keep & (before < top_p)
    choice = jax.random.categorical(key, jnp.where(keep, ranked, -jnp.inf), axis=-1)
    sampled = jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)
    return jnp.where(temperature > 0, sampled, greedy)


__all__ = ["Sampling", "sample"]
