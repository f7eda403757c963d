"""Gated multi-head latent attention without rotary embeddings (spec section 4): the attention core."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from k3jax.typing import Array

_HI = jax.lax.Precision.HIGHEST


def causal_attention(q: Array, k: Array, v: Array, scale: float) -> Array:
    """Causal softmax attention, float32 scores.

    q [B, T, H, K], k [B, S, H, K], v [B, S, H, V] with S >= T: the T queries are the last T
    positions of the S keys. Returns [B, T, H, V] float32.
    """
    T, S = q.shape[1], k.shape[1]
    scores = jnp.einsum("bthk,bshk->bhts", q.astype(jnp.float32), k.astype(jnp.float32), precision=_HI) * scale
    visible = jnp.arange(S)[None, :] <= jnp.arange(S - T, S)[:, None]  # [T, S]
    probs = jax.nn.softmax(jnp.where(visible, scores, -jnp.inf), axis=-1)
    return jnp.einsum("bhts,bshv->bthv", probs, v.astype(jnp.float32), precision=_HI)


def mla_keys_values(c_kv_normed: Array, k_pe: Array, kv_b: Array, num_heads: int, nope_dim: int) -> tuple[Array, Array]:
    """Expand the latent into per-head keys and values.

    c_kv_normed [B, S, R] (after kv_a_layernorm), k_pe [B, S, P] (shared by all heads, not rotated),
    kv_b [H*(nope+V), R] (per head: k_nope rows then v rows). Returns k [B, S, H, nope+P], v [B, S, H, V].
    """
    B, S, _ = c_kv_normed.shape
    kv = jnp.einsum("bsr,or->bso", c_kv_normed, kv_b, precision=_HI).reshape(B, S, num_heads, -1)
    k_nope, v = kv[..., :nope_dim], kv[..., nope_dim:]
    k_pe = jnp.broadcast_to(k_pe[:, :, None, :], (B, S, num_heads, k_pe.shape[-1]))
    return jnp.concatenate([k_nope, k_pe.astype(k_nope.dtype)], axis=-1), v


def absorbed_attention(
    q_nope: Array, q_pe: Array, c_kv: Array, k_pe: Array, kv_b: Array, visible: Array, scale: float
) -> Array:
    """MLA over the latent cache with kv_b absorbed into the query and the output.

    q_nope [B, T, H, N], q_pe [B, T, H, P]; the cache c_kv [B, S, R] (after kv_a_layernorm) and
    k_pe [B, S, P]; kv_b [H*(N+V), R]; visible [B, T, S] bool. With W_UK, W_UV the key and value rows
    of kv_b per head: q_lat = q_nope W_UK [B, T, H, R]; scores = q_lat . c_kv + q_pe . k_pe;
    o = (p c_kv) W_UV. Equals the expanded form exactly in exact arithmetic. Returns [B, T, H, V] f32.
    """
    H, N = q_nope.shape[2], q_nope.shape[3]
    f32 = lambda a: a.astype(jnp.float32)
    w = f32(kv_b).reshape(H, -1, kv_b.shape[-1])  # [H, N+V, R]
    w_uk, w_uv = w[:, :N], w[:, N:]
    q_lat = jnp.einsum("bthn,hnr->bthr", f32(q_nope), w_uk, precision=_HI)
    scores = jnp.einsum("bthr,bsr->bhts", q_lat, f32(c_kv), precision=_HI)
    scores = (scores + jnp.einsum("bthp,bsp->bhts", f32(q_pe), f32(k_pe), precision=_HI)) * scale
    probs = jax.nn.softmax(jnp.where(visible[:, None], scores, -jnp.inf), axis=-1)
    o_lat = jnp.einsum("bhts,bsr->bthr", probs, f32(c_kv), precision=_HI)
    return jnp.einsum("bthr,hvr->bthv", o_lat, w_uv, precision=_HI)


__all__ = ["causal_attention", "mla_keys_values", "absorbed_attention"]
