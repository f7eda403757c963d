"""Small building blocks: a bias-free linear map in the PyTorch [out, in] layout, RMSNorm, embedding.

Weights keep the released checkpoint's layout ([out, in]) so the converter copies tensors as they
are and an export back is bit-identical.
"""

from __future__ import annotations

from typing import Union

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.functional.norms import rms_norm
from k3jax.typing import Array

_HI = jax.lax.Precision.HIGHEST


class Keys:
    """Parameter keys folded from one base key and a Python counter.

    Drawing from an ``nnx.Rngs`` stream updates a Variable per draw, which is slow to trace (minutes
    for the 2.8T-parameter abstract model); modules accept either and the model shares one ``Keys``.
    """

    def __init__(self, key: Array):
        self.key, self.count = key, 0

    @classmethod
    def of(cls, rngs: "nnx.Rngs | Keys") -> "Keys":
        return rngs if isinstance(rngs, Keys) else cls(rngs.params())

    def __call__(self) -> Array:
        self.count += 1
        return jax.random.fold_in(self.key, self.count)


Rngs = Union[nnx.Rngs, Keys]


def normal(rngs: Rngs, shape: tuple[int, ...], std: float, dtype=jnp.float32) -> Array:
    key = rngs() if isinstance(rngs, Keys) else rngs.params()
    return (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


class Linear(nnx.Module):
    """y = x W^T with W [out, in] (no bias)."""

    def __init__(self, d_in: int, d_out: int, *, rngs: Rngs, param_dtype=jnp.float32):
        self.weight = nnx.Param(normal(rngs, (d_out, d_in), d_in**-0.5, param_dtype))

    def __call__(self, x: Array) -> Array:
        return jnp.einsum("...i,oi->...o", x, self.weight[...].astype(x.dtype), precision=_HI)


class RMSNorm(nnx.Module):
    """RMSNorm over the last axis with a learned scale (float32 inside)."""

    def __init__(self, dim: int, eps: float, *, param_dtype=jnp.float32):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))

    def __call__(self, x: Array) -> Array:
        return rms_norm(x, self.weight[...], self.eps)


def norm_params(norm: RMSNorm | None) -> tuple[Array, float] | None:
    """An RMS norm as the op entries take it: (weight, eps), or None for no norm."""
    return None if norm is None else (norm.weight[...], norm.eps)


class Embed(nnx.Module):
    """Token embedding table [V, D]."""

    def __init__(self, vocab: int, dim: int, *, rngs: Rngs, param_dtype=jnp.float32):
        self.weight = nnx.Param(normal(rngs, (vocab, dim), 1.0, param_dtype))

    def __call__(self, tokens: Array) -> Array:
        return jnp.take(self.weight[...], tokens, axis=0)


__all__ = ["Rngs", "Keys", "Linear", "RMSNorm", "Embed", "normal", "norm_params"]
