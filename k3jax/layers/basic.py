"""Small building blocks: a bias-free linear map in the PyTorch [out, in] layout, RMSNorm, embedding.

Weights keep the released checkpoint's layout ([out, in]) so the converter copies tensors as they
are and an export back is bit-identical.
"""

from __future__ import annotations

import math
from typing import Sequence, Union

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.functional.attn_res import DepthMix
from k3jax.functional.norms import rms_norm
from k3jax.implementation import get_implementation
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


# Rows of x up to which ``project`` takes the one-kernel matvecs: on the H200 the kernel matched XLA's
# einsums at one row and took twice their time at eight (benchmarks/RESULTS.md, issue 4).
MATVEC_KERNEL_ROWS = 1


def _matvec_kernel_fits(x: Array, weights: Sequence[Array], dtypes: Sequence) -> bool:
    """The Pallas path, one row (a batch-1 decode step), off TPU, and operands the kernel reads
    exactly as the einsums would (each weight and x in the product's dtype, or the product in float32)."""
    if get_implementation() != "pallas" or jax.default_backend() == "tpu":
        return False
    exact = lambda a, dt: a.dtype == dt or dt == jnp.float32
    rows = math.prod(x.shape[:-1])
    return 0 < rows <= MATVEC_KERNEL_ROWS and all(exact(w, dt) and exact(x, dt) for w, dt in zip(weights, dtypes))


def materialize(x: "Array | DepthMix") -> Array:
    """x itself, or a ``DepthMix``'s value: for readers that need the array."""
    return x.value() if isinstance(x, DepthMix) else x


def _mixed(mix: DepthMix, norm: "RMSNorm | None", kernel: bool) -> tuple[Array, "RMSNorm | None"]:
    """A Block AttnRes mix's value and the norm still to apply: with ``kernel``, mixed and normed in
    one small kernel (``pallas_kernels.depth_mix``), else by XLA (the norm left to the caller)."""
    if not kernel:
        return mix.value(), norm
    from pallas_kernels.depth_mix import mix_norm

    rows = mix.reshape(-1, mix.shape[-1])
    out = mix_norm(rows.partial, rows.blocks, rows.n_blocks, rows.norm_weight, rows.proj_weight, rows.eps,
                   None if norm is None else (norm.weight[...], norm.eps))
    return out.reshape(mix.shape), None


def project(x: "Array | DepthMix", weights: Sequence[Array], dtypes: Sequence | None = None,
            norm: "RMSNorm | None" = None) -> list[Array]:
    """x [..., D] (a Block AttnRes ``DepthMix`` is mixed first; RMS-normed by ``norm``, when given)
    times each weight [N_i, D]^T, as ``einsum(x.astype(dt), w.astype(dt))`` with dt = dtypes[i]
    (default x.dtype; float32 sums): what ``Linear`` computes, or the router's float32 logits. The
    maps that read one input (a layer's projections) go together so that, on the Pallas path for one
    row (batch-1 decode) off TPU, one kernel computes them all, norm included
    (``pallas_kernels.matvec``), instead of one small kernel each; a mix before them is then computed
    with the norm in one more small kernel (``pallas_kernels.depth_mix``)."""
    dtypes = [x.dtype] * len(weights) if dtypes is None else list(dtypes)
    kernel = _matvec_kernel_fits(x, weights, dtypes)
    if isinstance(x, DepthMix):
        x, norm = _mixed(x, norm, kernel)
    if kernel:
        from pallas_kernels.matvec import matvecs

        lead = x.shape[:-1]
        rms = None if norm is None else (norm.weight[...], norm.eps)
        outs = matvecs(x.reshape(-1, x.shape[-1]), list(weights), dtypes, norm=rms)
        return [y.reshape(*lead, y.shape[-1]) for y in outs]
    if norm is not None:
        x = norm(x)
    return [jnp.einsum("...i,oi->...o", x.astype(dt), w.astype(dt), precision=_HI) for w, dt in zip(weights, dtypes)]


class RMSNorm(nnx.Module):
    """RMSNorm over the last axis with a learned scale (float32 inside)."""

    def __init__(self, dim: int, eps: float, *, param_dtype=jnp.float32):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))

    def __call__(self, x: Array) -> Array:
        return rms_norm(x, self.weight[...], self.eps)


class Embed(nnx.Module):
    """Token embedding table [V, D]."""

    def __init__(self, vocab: int, dim: int, *, rngs: Rngs, param_dtype=jnp.float32):
        self.weight = nnx.Param(normal(rngs, (vocab, dim), 1.0, param_dtype))

    def __call__(self, tokens: Array) -> Array:
        return jnp.take(self.weight[...], tokens, axis=0)


__all__ = ["Rngs", "Keys", "Linear", "RMSNorm", "Embed", "normal", "materialize", "project", "MATVEC_KERNEL_ROWS"]
