"""Gated multi-head latent attention (spec section 4) as a Flax NNX module: the full-sequence form
(``__call__``) and the form over a latent cache (``extend``; ``pallas_kernels.mla`` says which kernels
run each)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.config import MLAConfig
from k3jax.layers.basic import Linear, RMSNorm, Rngs, norm_params
from k3jax.typing import Array
from pallas_kernels.matvec.ops import project
from pallas_kernels.mla.ops import cached_attention, latent_causal_attention, write_latents

LATENT_NORM_EPS = 1e-6  # q_a_layernorm and kv_a_layernorm, as in the public implementations


class MLACache(NamedTuple):
    """Per-sequence latent cache: c_kv AFTER kv_a_layernorm [B, S, R] and the shared k_pe [B, S, P]
    (R + P = 576 values per token for K3), preallocated to S positions."""

    c_kv: Array
    k_pe: Array


class MLA(nnx.Module):
    """x [B, T, D] -> [B, T, D]. Parameter names follow the released ``self_attn.*`` tensors."""

    def __init__(self, dim: int, cfg: MLAConfig, *, rngs: Rngs, param_dtype=jnp.float32):
        H = cfg.num_heads
        self.cfg = cfg
        lin = lambda i, o: Linear(i, o, rngs=rngs, param_dtype=param_dtype)
        if cfg.q_lora_rank:
            self.q_a_proj = lin(dim, cfg.q_lora_rank)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS, param_dtype=param_dtype)
            self.q_b_proj = lin(cfg.q_lora_rank, H * cfg.qk_head_dim)
        else:
            self.q_proj = lin(dim, H * cfg.qk_head_dim)
        self.kv_a_proj_with_mqa = lin(dim, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, LATENT_NORM_EPS, param_dtype=param_dtype)
        self.kv_b_proj = lin(cfg.kv_lora_rank, H * (cfg.qk_nope_head_dim + cfg.v_head_dim))
        if cfg.output_gate:
            self.g_proj = lin(dim, H * cfg.v_head_dim)
        self.o_proj = lin(H * cfg.v_head_dim, dim)

    def inputs(self, x: Array, norm: RMSNorm | None = None) -> tuple[Array, Array, Array | None]:
        """x [B, T, D] (RMS-normed by ``norm`` first, when given) -> the maps that read it, together
        (``project``): (the query input: q_a_proj's or q_proj's output, kv_a_proj_with_mqa's output
        [B, T, R + P], the output gate's logits or None)."""
        maps = [self.q_a_proj if self.cfg.q_lora_rank else self.q_proj, self.kv_a_proj_with_mqa]
        if self.cfg.output_gate:
            maps.append(self.g_proj)
        outs = project(x, [m.weight[...] for m in maps], norm=norm_params(norm))
        return outs[0], outs[1], outs[2] if self.cfg.output_gate else None

    def queries(self, q_in: Array) -> Array:
        """The query input [B, T, *] -> queries [B, T, H, nope + rope]."""
        B, T, _ = q_in.shape
        if self.cfg.q_lora_rank:
            q_in = project(q_in, [self.q_b_proj.weight[...]], norm=norm_params(self.q_a_layernorm))[0]
        return q_in.reshape(B, T, self.cfg.num_heads, self.cfg.qk_head_dim)

    def latent(self, c: Array) -> tuple[Array, Array]:
        """kv_a_proj_with_mqa's output [B, T, R + P] -> (c_kv after kv_a_layernorm [B, T, R], k_pe
        [B, T, P]): what a decode cache holds."""
        c_kv, k_pe = c[..., : self.cfg.kv_lora_rank], c[..., self.cfg.kv_lora_rank :]
        return self.kv_a_layernorm(c_kv), k_pe

    def output(self, gate: Array | None, o: Array, dtype, residual: Array | None = None) -> Array:
        """Attention output o [B, T, H, V] -> output gate (K3; its logits ``gate``) -> o_proj -> [B, T, D],
        plus ``residual`` when given (``project``'s epilogue)."""
        B, T = o.shape[:2]
        o = o.reshape(B, T, -1).astype(dtype)
        if gate is not None:
            o = o * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(dtype)
        return project(o, [self.o_proj.weight[...]], add=() if residual is None else (residual,))[0]

    def init_cache(self, batch: int, max_len: int, dtype=jnp.float32) -> MLACache:
        cfg = self.cfg
        return MLACache(jnp.zeros((batch, max_len, cfg.kv_lora_rank), dtype),
                        jnp.zeros((batch, max_len, cfg.qk_rope_head_dim), dtype))

    def extend(self, x: Array, cache: MLACache, start: Array, window: int | None = None,
               norm: RMSNorm | None = None, residual: Array | None = None) -> tuple[Array, MLACache]:
        """New tokens x [B, T, D] at positions start[b] + t against the cache.

        Writes the new latents into the cache (positions past its end are dropped), then attends
        every query to the cached positions at or before its own. Padding after a sequence's last
        token is written too, but only ever seen by later padding: the next real token overwrites it.
        ``window`` (static) reads only the first ``window`` cache positions: every real token's
        position must be below it (the caller's guarantee); None reads the whole cache. ``residual``
        [B, T, D], when given, is added to the output.
        """
        q_in, c, gate = self.inputs(x, norm)
        pos = start[:, None] + jnp.arange(x.shape[1])  # [B, T]
        norm = self.kv_a_layernorm
        cache = MLACache(*write_latents(c, norm.weight[...], norm.eps, cache.c_kv, cache.k_pe, pos))
        o = cached_attention(self.queries(q_in), cache.c_kv[:, :window], cache.k_pe[:, :window],  # [:None]: all
                             self.kv_b_proj.weight[...], pos, self.cfg.qk_head_dim**-0.5)
        return self.output(gate, o, x.dtype, residual), cache

    def __call__(self, x: Array, norm: RMSNorm | None = None, residual: Array | None = None) -> Array:
        """x [B, T, D] (RMS-normed by ``norm`` first, when given) -> [B, T, D], plus ``residual`` when given."""
        q_in, c, gate = self.inputs(x, norm)
        c_kv, k_pe = self.latent(c)
        o = latent_causal_attention(self.queries(q_in), c_kv, k_pe, self.kv_b_proj.weight[...],
                                    self.cfg.qk_head_dim**-0.5, x.dtype)
        return self.output(gate, o, x.dtype, residual)


__all__ = ["MLA", "MLACache", "LATENT_NORM_EPS"]
