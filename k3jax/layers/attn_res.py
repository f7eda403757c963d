"""Block Attention Residuals (spec section 2): one learned depth query per mix site."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from k3jax.functional.attn_res import attn_res_mix
from k3jax.typing import Array


class AttnRes(nnx.Module):
    """Holds ``<site>_res_norm.weight [D]`` and ``<site>_res_proj.weight [1, D]`` (zero-initialized:
    a fresh mix is a uniform average)."""

    def __init__(self, dim: int, eps: float, *, param_dtype=jnp.float32):
        self.eps = eps
        self.norm_weight = nnx.Param(jnp.ones((dim,), param_dtype))
        self.proj_weight = nnx.Param(jnp.zeros((1, dim), param_dtype))

    def __call__(self, blocks: Array, n_blocks: Array | int, partial: Array) -> tuple[Array, Array]:
        """blocks [N, B, T, D] (first n_blocks valid), partial [B, T, D] -> (mix [B, T, D], weights [N+1, B, T])."""
        out, weights = attn_res_mix(blocks, n_blocks, partial, self.norm_weight[...], self.proj_weight[...][0], self.eps)
        return out.astype(partial.dtype), weights


__all__ = ["AttnRes"]
