"""The MLA op's entries for the layer, with the signatures of ``k3jax.functional.mla``:

    write_latents(c, norm_weight, eps, c_kv, k_pe, positions)        -> (c_kv, k_pe)
    cached_attention(q, c_kv, k_pe, kv_b, positions, scale)          -> [B, T, H, V] float32
    latent_causal_attention(q, c_kv, k_pe, kv_b, scale, dtype)       -> [B, T, H, V] float32

On the Pallas path off TPU: a decode step's cache write is one Triton kernel (``triton_cache.py``: the
norm inside, the caches written in place); several new tokens (a prefill chunk, a whole sequence)
attend by the flash-attention kernel (``triton_attention.py``) over keys and values expanded from the
latents, no score matrix stored, where the head widths suit it (any in interpret mode). A decode step
attends in the reference's absorbed form. ``latent_causal_attention`` (a full forward's attention) has
the reference's gradient (``pallas_kernels._autodiff.with_reference_gradient``); the cached forms none
through their kernels.
"""

from __future__ import annotations

import jax.numpy as jnp

from k3jax.implementation import current
from k3jax.typing import Array
from pallas_kernels import _platform
from pallas_kernels._autodiff import with_reference_gradient
from pallas_kernels.mla import reference
from pallas_kernels.mla.triton_attention import prefill_attention, prefill_attention_runs
from pallas_kernels.mla.triton_cache import write_latents as write_latents_kernel


def _triton() -> bool:
    return current().name == "pallas" and not _platform.on_tpu()


def write_latents(c: Array, norm_weight: Array, eps: float, c_kv: Array, k_pe: Array, positions: Array):
    """``k3jax.functional.mla.write_latents``; one kernel for a decode step (T = 1) on the Pallas path."""
    if c.shape[1] == 1 and _triton():
        return write_latents_kernel(c[:, 0], norm_weight, eps, c_kv, k_pe, positions[:, 0])
    return reference.write_latents(c, norm_weight, eps, c_kv, k_pe, positions)


def _flash_runs(q: Array, k_pe: Array, kv_b: Array) -> bool:
    """The Pallas path off TPU, with head widths the kernel takes (any in interpret mode)."""
    nope, rope = q.shape[-1] - k_pe.shape[-1], k_pe.shape[-1]
    value = kv_b.shape[0] // q.shape[2] - nope
    return _triton() and (_platform.interpret() or prefill_attention_runs(nope, rope, value))


def _flash(q: Array, c_kv: Array, k_pe: Array, kv_b: Array, positions: Array, scale: float, dtype) -> Array:
    """The flash-attention kernel over keys and values expanded from the latents; operands in ``dtype``."""
    nope = q.shape[-1] - k_pe.shape[-1]
    k_nope, v = reference.mla_expand(c_kv.astype(dtype), kv_b.astype(dtype), q.shape[2], nope)
    return prefill_attention(q[..., :nope].astype(dtype), q[..., nope:].astype(dtype), k_nope, k_pe.astype(dtype),
                             v, positions, scale)


def cached_attention(q: Array, c_kv: Array, k_pe: Array, kv_b: Array, positions: Array, scale: float) -> Array:
    """``k3jax.functional.mla.cached_attention``; for several new tokens on the Pallas path the flash kernel
    (operands rounded to the cache's dtype, as the absorbed form's are)."""
    if q.shape[1] > 1 and _flash_runs(q, k_pe, kv_b):
        return _flash(q, c_kv, k_pe, kv_b, positions, scale, c_kv.dtype)
    return reference.cached_attention(q, c_kv, k_pe, kv_b, positions, scale)


def latent_causal_attention(q: Array, c_kv: Array, k_pe: Array, kv_b: Array, scale: float, dtype) -> Array:
    """``k3jax.functional.mla.latent_causal_attention``; the flash kernel on the Pallas path (no [B, H, T, T]
    scores), with the reference's gradient."""
    if _flash_runs(q, k_pe, kv_b):
        return with_reference_gradient(_flash_causal, reference.latent_causal_attention)(q, c_kv, k_pe, kv_b, scale,
                                                                                         dtype)
    return reference.latent_causal_attention(q, c_kv, k_pe, kv_b, scale, dtype)


def _flash_causal(q: Array, c_kv: Array, k_pe: Array, kv_b: Array, scale: float, dtype) -> Array:
    """``latent_causal_attention`` by the flash kernel: each query at position t sees keys 0..t."""
    B, T = q.shape[:2]
    return _flash(q, c_kv, k_pe, kv_b, jnp.broadcast_to(jnp.arange(T), (B, T)), scale, dtype)


__all__ = ["cached_attention", "latent_causal_attention", "write_latents"]
