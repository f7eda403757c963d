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


def attn_res_mix(
    blocks: Array, n_blocks: Array | int, partial: Array, norm_weight: Array, proj_weight: Array, eps: float
) -> tuple[Array, Array]:
    """Mix stored blocks and the partial sum over depth.

    blocks [N, B, T, D] (rows at or beyond ``n_blocks`` are ignored), partial [B, T, D],
    norm_weight [D], proj_weight [D]. Returns (out [B, T, D] float32, weights [N + 1, B, T] float32:
    one per block, then the partial; zero for ignored rows; they sum to one).
    """
    sources = jnp.concatenate([blocks, partial[None]], axis=0).astype(jnp.float32)  # [N+1, B, T, D]
    query = norm_weight.astype(jnp.float32) * proj_weight.astype(jnp.float32)  # [D]
    normed = sources * jax.lax.rsqrt(jnp.mean(sources * sources, axis=-1, keepdims=True) + eps)
    scores = jnp.einsum("nbtd,d->nbt", normed, query, precision=_HI)
    valid = jnp.arange(sources.shape[0]) < n_blocks
    valid = valid.at[-1].set(True)
    scores = jnp.where(valid[:, None, None], scores, -jnp.inf)
    weights = jax.nn.softmax(scores, axis=0)
    out = jnp.einsum("nbt,nbtd->btd", weights, sources, precision=_HI)
    return out, weights


__all__ = ["attn_res_mix"]
