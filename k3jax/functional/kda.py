"""Kimi Delta Attention maths (spec section 3): gates, the recurrent rule and its chunked form.

Conventions shared by every KDA function in the project:
    q, k  [B, T, H, K]  already L2-normalized (``l2_normalize``); the 1/sqrt(K) scale is applied here
    v     [B, T, H, V]
    g     [B, T, H, K]  per-channel log decay (<= 0), float32
    beta  [B, T, H]     after the sigmoid, float32
    state [B, H, K, V]  float32
Outputs are float32 [B, T, H, V] and the final state.

The delta rule, per head:  S_t = Diag(exp g_t) S_{t-1};  S_t += beta_t k_t (v_t - S_t^T k_t)^T;
o_t = S_t^T (scale q_t).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from k3jax.typing import Array

TILE = 16
_HI = jax.lax.Precision.HIGHEST


def l2_normalize(x: Array, eps: float = 1e-6) -> Array:
    """x / sqrt(sum x^2 + eps) over the last axis, in float32."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def bounded_gate(z: Array, a_log: Array, dt_bias: Array, lower_bound: float) -> Array:
    """K3's gate: g = lower_bound * sigmoid(exp(A_log[h]) * (z + dt_bias)), in (lower_bound, 0).

    z [..., H, K] (the f_b_proj output), a_log [H], dt_bias [H, K]. Float32 out.
    """
    z = z.astype(jnp.float32) + dt_bias.astype(jnp.float32)
    return lower_bound * jax.nn.sigmoid(jnp.exp(a_log.astype(jnp.float32))[:, None] * z)


def softplus_gate(z: Array, a_log: Array, dt_bias: Array) -> Array:
    """Kimi Linear's gate: g = -exp(A_log[h]) * softplus(z + dt_bias), unbounded below. Float32 out."""
    z = z.astype(jnp.float32) + dt_bias.astype(jnp.float32)
    return -jnp.exp(a_log.astype(jnp.float32))[:, None] * jax.nn.softplus(z)


def _prepare(q, k, v, g, beta, initial_state, scale):
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else scale
    f32 = lambda a: a.astype(jnp.float32)
    state = jnp.zeros((B, H, K, V), jnp.float32) if initial_state is None else f32(initial_state)
    return f32(q) * scale, f32(k), f32(v), f32(g), f32(beta), state


def recurrent_kda(
    q: Array, k: Array, v: Array, g: Array, beta: Array,
    initial_state: Array | None = None, scale: float | None = None,
) -> tuple[Array, Array]:
    """Token-by-token delta rule (the oracle). Returns (o [B, T, H, V], state [B, H, K, V])."""
    q, k, v, g, beta, state = _prepare(q, k, v, g, beta, initial_state, scale)

    def step(S, xs):  # S [B, H, K, V]
        q_t, k_t, v_t, g_t, b_t = xs  # [B, H, K], ..., [B, H]
        S = S * jnp.exp(g_t)[..., None]
        residual = v_t - jnp.einsum("bhkv,bhk->bhv", S, k_t, precision=_HI)
        S = S + jnp.einsum("bhk,bhv->bhkv", b_t[..., None] * k_t, residual, precision=_HI)
        return S, jnp.einsum("bhkv,bhk->bhv", S, q_t, precision=_HI)

    xs = tuple(jnp.moveaxis(a, 1, 0) for a in (q, k, v, g, beta))
    state, o = jax.lax.scan(step, state, xs)
    return jnp.moveaxis(o, 0, 1), state


def step_kda(
    q: Array, k: Array, v: Array, g: Array, beta: Array, state: Array, scale: float | None = None
) -> tuple[Array, Array]:
    """One decode step: q, k, g [B, H, K], v [B, H, V], beta [B, H], state [B, H, K, V]."""
    o, state = recurrent_kda(q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None], state, scale)
    return o[:, 0], state


def unit_lower_inverse(L: Array) -> Array:
    """(I + L)^-1 for strictly lower-triangular L [..., C, C], by 2 x 2 blocks, recursively:
    [[A, 0], [M, B]]^-1 = [[A^-1, 0], [-B^-1 M A^-1, B^-1]] (the Pallas kernels' form, and as stable as
    forward substitution). Matrix products only: LAPACK's batched triangular solve (``solve_triangular``),
    run twice at once in a train step's backward, deadlocks XLA's CPU thread pool on a 2-core machine
    (jaxlib 0.10.2: both pool threads wait inside ``ParallelBatchMap`` for work neither can run)."""
    n = L.shape[-1]
    if n == 1:
        return jnp.ones_like(L)
    h = n // 2
    A, B = unit_lower_inverse(L[..., :h, :h]), unit_lower_inverse(L[..., h:, h:])
    M = -jnp.einsum("...ij,...jk,...kl->...il", B, L[..., h:, :h], A, precision=_HI)
    top = jnp.concatenate([A, jnp.zeros((*L.shape[:-2], h, n - h), L.dtype)], axis=-1)
    return jnp.concatenate([top, jnp.concatenate([M, B], axis=-1)], axis=-2)


def _tile(q, k, v, g, beta, S):
    """One tile of C tokens (WY / UT transform). Inputs [B, H, C, *]; S [B, H, K, V]."""
    C = q.shape[2]
    G = jnp.cumsum(g, axis=2)  # [B, H, C, K] cumulative log decay
    causal = jnp.tril(jnp.ones((C, C), bool))
    strict = jnp.tril(jnp.ones((C, C), bool), -1)
    # exp(G_i - G_j) for j <= i only: the differences there are <= 0, so nothing can overflow.
    diff = G[:, :, :, None, :] - G[:, :, None, :, :]  # [B, H, C(i), C(j), K]
    decay = jnp.exp(jnp.where(causal[:, :, None], diff, -jnp.inf))
    A_kk = jnp.einsum("bhik,bhjk,bhijk->bhij", k, k, decay, precision=_HI)
    A_kk = jnp.where(strict, A_kk * beta[..., None], 0.0)
    # Tm = (I + A_kk)^-1 Diag(beta): the unit lower-triangular inverse, then products.
    inverse = unit_lower_inverse(A_kk)
    W = jnp.einsum("bhij,bhjk->bhik", inverse, beta[..., None] * (jnp.exp(G) * k), precision=_HI)  # Diag(beta) exp(G) K
    U = jnp.einsum("bhij,bhjv->bhiv", inverse, beta[..., None] * v, precision=_HI)
    V_new = U - jnp.einsum("bhck,bhkv->bhcv", W, S, precision=_HI)  # corrected values
    A_qk = jnp.einsum("bhik,bhjk,bhijk->bhij", q, k, decay, precision=_HI)
    o = jnp.einsum("bhck,bhkv->bhcv", q * jnp.exp(G), S, precision=_HI)
    o = o + jnp.einsum("bhij,bhjv->bhiv", A_qk, V_new, precision=_HI)
    G_end = G[:, :, -1:, :]  # [B, H, 1, K]
    S = jnp.exp(G_end[:, :, 0, :, None]) * S
    S = S + jnp.einsum("bhck,bhcv->bhkv", jnp.exp(G_end - G) * k, V_new, precision=_HI)
    return o, S


def chunk_kda(
    q: Array, k: Array, v: Array, g: Array, beta: Array,
    initial_state: Array | None = None, scale: float | None = None, chunk_size: int = TILE,
) -> tuple[Array, Array]:
    """Chunked KDA: ``lax.scan`` over tiles of ``chunk_size`` (16) tokens, WY transform inside a tile.

    Same contract as ``recurrent_kda``. T need not be a multiple of the tile: the tail is padded with
    tokens that neither decay (g = 0) nor write (beta = 0), so outputs and final state are exact.
    """
    q, k, v, g, beta, state = _prepare(q, k, v, g, beta, initial_state, scale)
    B, T, H, K = q.shape
    n = -(-T // chunk_size)
    pad = n * chunk_size - T

    def tiles(a):  # [B, T, H, ...] -> [n, B, H, C, ...]
        a = jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
        a = a.reshape(B, n, chunk_size, H, *a.shape[3:])
        return jnp.moveaxis(jnp.moveaxis(a, 1, 0), 3, 2)

    def body(S, xs):
        o, S = _tile(*xs, S)
        return S, o

    state, o = jax.lax.scan(body, state, tuple(tiles(a) for a in (q, k, v, g, beta)))
    o = jnp.moveaxis(o, 2, 3).transpose(1, 0, 2, 3, 4).reshape(B, n * chunk_size, H, -1)
    return o[:, :T], state


def gates(q: Array, k: Array, z: Array, a_log: Array, dt_bias: Array, beta_logits: Array, lower_bound: float | None,
          valid: Array | None = None) -> tuple[Array, Array, Array, Array]:
    """The KDA layer's maps' outputs -> (q, k L2-normed, the log decay g, beta = sigmoid(beta_logits)): the gate
    bounded by ``lower_bound`` (K3) or softplus where None (Kimi Linear); where ``valid`` [B, T] is False
    (padding), g = 0 and beta = 0, so the token neither decays nor writes the state."""
    q, k = l2_normalize(q), l2_normalize(k)
    g = softplus_gate(z, a_log, dt_bias) if lower_bound is None else bounded_gate(z, a_log, dt_bias, lower_bound)
    beta = jax.nn.sigmoid(beta_logits.astype(jnp.float32))
    if valid is not None:
        g = jnp.where(valid[:, :, None, None], g, 0.0)
        beta = jnp.where(valid[:, :, None], beta, 0.0)
    return q, k, g, beta


def gated_kda(q: Array, k: Array, v: Array, z: Array, a_log: Array, dt_bias: Array, beta_logits: Array,
              state: Array, lower_bound: float | None, valid: Array | None = None) -> tuple[Array, Array]:
    """The KDA layer's core from its maps' outputs: ``gates``, then the chunked form for T > 1 or the
    recurrence for T = 1.

    q, k, z [B, T, H, K]; v [B, T, H, V]; a_log [H]; dt_bias [H, K]; beta_logits [B, T, H]; state
    [B, H, K, V] float32; valid [B, T] marks real tokens. Returns (o float32 [B, T, H, V], state)."""
    q, k, g, beta = gates(q, k, z, a_log, dt_bias, beta_logits, lower_bound, valid)
    if q.shape[1] == 1:
        return recurrent_kda(q, k, v, g, beta, state)
    return chunk_kda(q, k, v, g, beta, state)


__all__ = ["TILE", "gates", "unit_lower_inverse", "gated_kda", "l2_normalize", "bounded_gate", "softplus_gate", "recurrent_kda", "step_kda", "chunk_kda"]
