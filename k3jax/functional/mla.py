"""Gated multi-head latent attention without rotary embeddings (spec section 4): the attention core."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from k3jax.functional.norms import rms_norm
from k3jax.typing import Array

_HI = jax.lax.Precision.HIGHEST


def _matmul(spec: str, a: Array, b: Array, dtype) -> Array:
    """einsum of a and b rounded to ``dtype`` (the attention's compute dtype: the matrix units'
    operand type), accumulated and returned in float32. For float32 inputs: full float32. On CPU the
    operands stay float32 (XLA's CPU backend lacks some bf16 x bf16 -> float32 products)."""
    if jax.default_backend() == "cpu":
        dtype = jnp.float32
    return jnp.einsum(spec, a.astype(dtype), b.astype(dtype), precision=_HI, preferred_element_type=jnp.float32)


def causal_attention(q: Array, k: Array, v: Array, scale: float) -> Array:
    """Causal softmax attention: float32 scores and softmax, matmul operands in the inputs' dtype.

    q [B, T, H, K], k [B, S, H, K], v [B, S, H, V] with S >= T: the T queries are the last T
    positions of the S keys. Returns [B, T, H, V] float32.
    """
    T, S = q.shape[1], k.shape[1]
    dtype = jnp.result_type(q, k, v)
    scores = _matmul("bthk,bshk->bhts", q, k, dtype) * scale
    visible = jnp.arange(S)[None, :] <= jnp.arange(S - T, S)[:, None]  # [T, S]
    probs = jax.nn.softmax(jnp.where(visible, scores, -jnp.inf), axis=-1)
    return _matmul("bhts,bshv->bthv", probs, v, dtype)


def mla_expand(c_kv_normed: Array, kv_b: Array, num_heads: int, nope_dim: int) -> tuple[Array, Array]:
    """The latent's per-head key and value parts: c_kv_normed [B, S, R] (after kv_a_layernorm), kv_b
    [H*(nope+V), R] (per head: k_nope rows then v rows) -> k_nope [B, S, H, nope], v [B, S, H, V], in
    c_kv_normed's dtype."""
    B, S, _ = c_kv_normed.shape
    kv = jnp.einsum("bsr,or->bso", c_kv_normed, kv_b, precision=_HI).reshape(B, S, num_heads, -1)
    return kv[..., :nope_dim], kv[..., nope_dim:]


def mla_keys_values(c_kv_normed: Array, k_pe: Array, kv_b: Array, num_heads: int, nope_dim: int) -> tuple[Array, Array]:
    """Expand the latent into per-head keys and values.

    c_kv_normed [B, S, R] (after kv_a_layernorm), k_pe [B, S, P] (shared by all heads, not rotated),
    kv_b [H*(nope+V), R] (per head: k_nope rows then v rows). Returns k [B, S, H, nope+P], v [B, S, H, V].
    """
    B, S, _ = c_kv_normed.shape
    k_nope, v = mla_expand(c_kv_normed, kv_b, num_heads, nope_dim)
    k_pe = jnp.broadcast_to(k_pe[:, :, None, :], (B, S, num_heads, k_pe.shape[-1]))
    return jnp.concatenate([k_nope, k_pe.astype(k_nope.dtype)], axis=-1), v


def absorbed_attention(
    q_nope: Array, q_pe: Array, c_kv: Array, k_pe: Array, kv_b: Array, visible: Array, scale: float
) -> Array:
    """MLA over the latent cache with kv_b absorbed into the query and the output.

    q_nope [B, T, H, N], q_pe [B, T, H, P]; the cache c_kv [B, S, R] (after kv_a_layernorm) and
    k_pe [B, S, P]; kv_b [H*(N+V), R]; visible [B, T, S] bool. With W_UK, W_UV the key and value rows
    of kv_b per head: q_lat = q_nope W_UK [B, T, H, R]; scores = q_lat . c_kv + q_pe . k_pe;
    o = (p c_kv) W_UV. Equals the expanded form exactly in exact arithmetic. Matmul operands are
    rounded to the cache's dtype (bf16 caches run on the matrix units), scores, softmax and
    accumulation are float32. Returns [B, T, H, V] f32.
    """
    dtype = c_kv.dtype
    q_lat = absorbed_query(q_nope, kv_b, dtype)
    scores = _matmul("bthr,bsr->bhts", q_lat, c_kv, dtype) + _matmul("bthp,bsp->bhts", q_pe, k_pe, dtype)
    probs = jax.nn.softmax(jnp.where(visible[:, None], scores * scale, -jnp.inf), axis=-1)
    o_lat = _matmul("bhts,bsr->bthr", probs, c_kv, dtype)
    return absorbed_output(o_lat, kv_b, q_nope.shape[3], dtype)


def _absorbed_weights(kv_b: Array, heads: int, nope_dim: int) -> tuple[Array, Array]:
    """kv_b [H*(N+V), R] -> W_UK [H, N, R], W_UV [H, V, R]."""
    w = kv_b.reshape(heads, -1, kv_b.shape[-1])
    return w[:, :nope_dim], w[:, nope_dim:]


def absorbed_query(q_nope: Array, kv_b: Array, dtype) -> Array:
    """q_nope [B, T, H, N] -> q_lat = q_nope W_UK [B, T, H, R] float32 (operands rounded to ``dtype``)."""
    w_uk, _ = _absorbed_weights(kv_b, q_nope.shape[2], q_nope.shape[3])
    return _matmul("bthn,hnr->bthr", q_nope, w_uk, dtype)


def absorbed_output(o_lat: Array, kv_b: Array, nope_dim: int, dtype) -> Array:
    """The attention's latent output o_lat [B, T, H, R] -> o_lat W_UV [B, T, H, V] float32 (operands
    rounded to ``dtype``)."""
    _, w_uv = _absorbed_weights(kv_b, o_lat.shape[2], nope_dim)
    return _matmul("bthr,hvr->bthv", o_lat, w_uv, dtype)


def write_latents(c: Array, norm_weight: Array, eps: float, c_kv: Array, k_pe: Array, positions: Array
                  ) -> tuple[Array, Array]:
    """The latent cache with new tokens written: c [B, T, R + P] (kv_a_proj_with_mqa's output; its first R
    values RMS-normed by kv_a_layernorm's ``norm_weight`` [R] and ``eps``) at positions [B, T] of the caches
    c_kv [B, S, R] and k_pe [B, S, P]; positions past S are dropped. Returns (c_kv, k_pe)."""
    R = c_kv.shape[-1]
    latent, pe = rms_norm(c[..., :R], norm_weight, eps), c[..., R:]
    rows = jnp.arange(c.shape[0])[:, None]
    return (c_kv.at[rows, positions].set(latent.astype(c_kv.dtype), mode="drop"),
            k_pe.at[rows, positions].set(pe.astype(k_pe.dtype), mode="drop"))


def cached_attention(q: Array, c_kv: Array, k_pe: Array, kv_b: Array, positions: Array, scale: float) -> Array:
    """Queries q [B, T, H, N + P] at positions [B, T] over a latent cache c_kv [B, S, R] (after
    kv_a_layernorm), k_pe [B, S, P]: each query sees the cached positions at or before its own, in the
    absorbed form (``absorbed_attention``). Returns [B, T, H, V] float32."""
    nope = q.shape[-1] - k_pe.shape[-1]
    visible = jnp.arange(c_kv.shape[1])[None, None, :] <= positions[:, :, None]  # [B, T, S]
    return absorbed_attention(q[..., :nope], q[..., nope:], c_kv, k_pe, kv_b, visible, scale)


def latent_causal_attention(q: Array, c_kv: Array, k_pe: Array, kv_b: Array, scale: float, dtype) -> Array:
    """Causal attention of a whole sequence from its latents (c_kv [B, T, R] after kv_a_layernorm, k_pe
    [B, T, P]) expanded into per-head keys and values by kv_b rounded to ``dtype``; q [B, T, H, N + P].
    Returns [B, T, H, V] float32."""
    nope = q.shape[-1] - k_pe.shape[-1]
    k, v = mla_keys_values(c_kv, k_pe, kv_b.astype(dtype), q.shape[2], nope)
    return causal_attention(q, k, v, scale)


__all__ = ["cached_attention", "latent_causal_attention", "write_latents", "absorbed_attention", "absorbed_output", "absorbed_query", "causal_attention", "mla_expand",
           "mla_keys_values"]
