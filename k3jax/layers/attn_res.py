"""Block Attention Residuals (spec section 2): one learned depth query per mix site."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from k3jax.functional.attn_res import DepthMix
from k3jax.layers.basic import RMSNorm
from k3jax.typing import Array


class _Query(nnx.Module):
    def __init__(self, dim: int, param_dtype):
        self.weight = nnx.Param(jnp.zeros((1, dim), param_dtype))


class AttnRes(nnx.Module):
    """A mix site: ``norm.weight [D]`` and ``proj.weight [1, D]`` (released as ``<site>_res_norm.weight``
    and ``<site>_res_proj.weight``); the zero-initialized query makes a fresh mix a uniform average."""

    def __init__(self, dim: int, eps: float, *, param_dtype=jnp.float32):
        self.norm = RMSNorm(dim, eps, param_dtype=param_dtype)
        self.proj = _Query(dim, param_dtype)

    def deferred(self, blocks: Array, n_blocks: Array | int, partial: Array) -> DepthMix:
        """blocks [N, B, T, D] (first n_blocks valid), partial [B, T, D] -> the mix, for its reader to compute."""
        return DepthMix(blocks, n_blocks, partial, self.norm.weight[...], self.proj.weight[...][0], self.norm.eps)

    def __call__(self, blocks: Array, n_blocks: Array | int, partial: Array) -> tuple[Array, Array]:
        """blocks [N, B, T, D] (first n_blocks valid), partial [B, T, D] -> (mix [B, T, D], weights [N+1, B, T])."""
        mix = self.deferred(blocks, n_blocks, partial)
        return mix.value(), mix.weights()


__all__ = ["AttnRes"]
