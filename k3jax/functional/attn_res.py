"""Block Attention Residuals: a softmax over depth (spec section 2), in float32.

Sources are the stored blocks (the first ``n_blocks`` rows of a fixed buffer) and the live partial
sum, which is always last. Each source's score is its RMS-normalized value dotted with one learned
query ``norm_weight * proj_weight``; there is no 1/sqrt(D) temperature; the output mixes the raw
sources.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from k3jax.typing import Array

_HI = jax.lax.Precision.HIGHEST


def _scores(sources: Array, query: Array, eps: float) -> Array:
    """[..., D] -> [...]: each source's RMS-normalized value dotted with the query, float32."""
    x = sources.astype(jnp.float32)
    normed = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    return jnp.einsum("...d,d->...", normed, query, precision=_HI)


def attn_res_mix(
    blocks: Array, n_blocks: Array | int, partial: Array, norm_weight: Array, proj_weight: Array, eps: float
) -> tuple[Array, Array]:
    """Mix stored blocks and the partial sum over depth.

    blocks [N, B, T, D] (rows at or beyond ``n_blocks`` are ignored), partial [B, T, D],
    norm_weight [D], proj_weight [D]. Returns (out [B, T, D] float32, weights [N + 1, B, T] float32:
    one per block, then the partial; zero for ignored rows; they sum to one). The blocks and the
    partial are scored and summed separately (one softmax over both), never copied into one array.
    """
    query = norm_weight.astype(jnp.float32) * proj_weight.astype(jnp.float32)  # [D]
    valid = (jnp.arange(blocks.shape[0]) < n_blocks)[:, None, None]
    block_scores = jnp.where(valid, _scores(blocks, query, eps), -jnp.inf)  # [N, B, T]
    partial_score = _scores(partial, query, eps)  # [B, T]
    top = jnp.maximum(jnp.max(block_scores, axis=0), partial_score)
    block_e, partial_e = jnp.exp(block_scores - top), jnp.exp(partial_score - top)
    total = jnp.sum(block_e, axis=0) + partial_e
    block_w, partial_w = block_e / total, partial_e / total
    out = jnp.einsum("nbt,nbtd->btd", block_w, blocks.astype(jnp.float32), precision=_HI)
    out = out + partial_w[..., None] * partial.astype(jnp.float32)
    return out, jnp.concatenate([block_w, partial_w[None]], axis=0)


__all__ = ["attn_res_mix"]
