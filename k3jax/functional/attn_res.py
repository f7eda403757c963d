"""Block Attention Residuals: a softmax over depth (spec section 2), in float32.

Sources are the stored blocks (the first ``n_blocks`` rows of a fixed buffer) and the live partial
sum, which is always last. Each source's score is its RMS-normalized value dotted with one learned
query ``norm_weight * proj_weight``; there is no 1/sqrt(D) temperature; the output mixes the raw
sources.
"""

from __future__ import annotations

import dataclasses
import functools

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
    norm_weight [D], proj_weight [D]; any other leading axes than (B, T) work alike. Returns (out
    [B, T, D] float32, weights [N + 1, B, T] float32: one per block, then the partial; zero for
    ignored rows; they sum to one). The blocks and the
    partial are scored and summed separately (one softmax over both), never copied into one array.
    """
    query = norm_weight.astype(jnp.float32) * proj_weight.astype(jnp.float32)  # [D]
    valid = (jnp.arange(blocks.shape[0]) < n_blocks).reshape(-1, *[1] * (partial.ndim - 1))  # [N, 1, 1]
    block_scores = jnp.where(valid, _scores(blocks, query, eps), -jnp.inf)  # [N, B, T]
    partial_score = _scores(partial, query, eps)  # [B, T]
    top = jnp.maximum(jnp.max(block_scores, axis=0), partial_score)
    block_e, partial_e = jnp.exp(block_scores - top), jnp.exp(partial_score - top)
    total = jnp.sum(block_e, axis=0) + partial_e
    block_w, partial_w = block_e / total, partial_e / total
    out = jnp.einsum("n...,n...d->...d", block_w, blocks.astype(jnp.float32), precision=_HI)
    out = out + partial_w[..., None] * partial.astype(jnp.float32)
    return out, jnp.concatenate([block_w, partial_w[None]], axis=0)


@dataclasses.dataclass(frozen=True)
class DepthMix:
    """A mix site's inputs, for its reader to mix: ``value()`` is ``attn_res_mix``'s output rounded to
    the partial's dtype (what the next layer reads), ``weights()`` its mixing weights. The reader
    chooses how: ``pallas_kernels.matvec.ops.project`` mixes and norms in one kernel on the
    Pallas path, else calls value(). shape, dtype and reshape are the partial's, so layers pass a mix
    on like an array."""

    blocks: Array
    n_blocks: Array | int
    partial: Array
    norm_weight: Array
    proj_weight: Array
    eps: float

    @property
    def shape(self) -> tuple[int, ...]:
        return self.partial.shape

    @property
    def dtype(self):
        return self.partial.dtype

    @property
    def ndim(self) -> int:
        return self.partial.ndim

    def reshape(self, *shape: int) -> "DepthMix":
        """The same mix over the partial reshaped to ``shape`` (the blocks alike)."""
        partial = self.partial.reshape(*shape)
        return dataclasses.replace(self, blocks=self.blocks.reshape(self.blocks.shape[0], *partial.shape),
                                   partial=partial)

    @functools.cached_property
    def _mix(self) -> tuple[Array, Array]:
        """The mix and its weights, computed once for value() and weights()."""
        return attn_res_mix(self.blocks, self.n_blocks, self.partial, self.norm_weight, self.proj_weight, self.eps)

    def value(self) -> Array:
        return self._mix[0].astype(self.partial.dtype)

    def weights(self) -> Array:
        return self._mix[1]


__all__ = ["DepthMix", "attn_res_mix"]
