"""Next-token sampling: greedy, temperature, top-k, top-p.

The settings are static (``Sampling`` is hashable): each mode compiles only what it needs, so greedy
decoding is one argmax and plain temperature sampling never sorts the vocabulary. A jitted caller
compiles once per distinct ``Sampling``.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from k3jax.arguments import integer, real
from k3jax.typing import Array


@dataclass(frozen=True)
class Sampling:
    """temperature 0 is greedy; top_k 0 and top_p 1.0 switch those filters off. The temperature is a finite number
    >= 0, top_k an integer >= 0, top_p a number in (0, 1]: anything else raises TypeError or ValueError."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        real("temperature", self.temperature, minimum=0.0)
        integer("top_k", self.top_k, minimum=0)
        real("top_p", self.top_p, maximum=1.0, above=0.0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def filtered(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0


def _kept(scaled: Array, top_k: int, top_p: float) -> Array:
    """bool [B, V]: the tokens that survive top-k, then top-p (nucleus) on tempered logits [B, V]."""
    order = jnp.argsort(-scaled, axis=-1)
    ranked = jnp.take_along_axis(scaled, order, axis=-1)
    rank = jnp.arange(scaled.shape[-1])
    keep = (rank < top_k) if top_k > 0 else jnp.ones(ranked.shape, bool)
    probs = jax.nn.softmax(jnp.where(keep, ranked, -jnp.inf), axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # probability mass ranked strictly above each token
    keep = keep & (before < top_p)
    rows = jnp.arange(scaled.shape[0])[:, None]
    return jnp.zeros(keep.shape, bool).at[rows, order].set(keep)


def sample(logits: Array, key: Array, sampling: Sampling) -> Array:
    """logits [B, V] -> tokens [B] int32. Filters mask the vocabulary in place, so a filter that
    keeps every token draws exactly what plain temperature sampling draws with the same key."""
    if sampling.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    scaled = logits.astype(jnp.float32) / sampling.temperature
    if sampling.filtered:
        scaled = jnp.where(_kept(scaled, sampling.top_k, sampling.top_p), scaled, -jnp.inf)
    return jax.random.categorical(key, scaled, axis=-1).astype(jnp.int32)


def token_logprobs(logits: Array, tokens: Array) -> Array:
    """logits [B, V], tokens [B] -> float32 [B]: each token's log-probability under the model's own
    distribution, softmax(logits) in float32, before any temperature or filter."""
    logits = logits.astype(jnp.float32)
    chosen = jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0]
    return chosen - jax.nn.logsumexp(logits, axis=-1)


__all__ = ["Sampling", "sample", "token_logprobs"]
