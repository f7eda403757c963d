"""Gated multi-head latent attention (spec section 4) as a Flax NNX module: the expanded full-sequence
form (``__call__``) and the form over a latent cache (``extend``): absorbed for decode steps (and
prefill chunks on the reference path), expanded keys with a flash-attention kernel for prefill chunks
on the Pallas path, as ``__call__`` there."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.config import MLAConfig
from k3jax.functional.mla import absorbed_attention, causal_attention, mla_expand, mla_keys_values
from k3jax.implementation import pallas_interpret, triton_kernels
from k3jax.layers.basic import Linear, RMSNorm, Rngs, project
from k3jax.typing import Array

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
        outs = project(x, [m.weight[...] for m in maps], norm=norm)
        return outs[0], outs[1], outs[2] if self.cfg.output_gate else None

    def queries(self, q_in: Array) -> Array:
        """The query input [B, T, *] -> queries [B, T, H, nope + rope]."""
        B, T, _ = q_in.shape
        q = project(q_in, [self.q_b_proj.weight[...]], norm=self.q_a_layernorm)[0] if self.cfg.q_lora_rank else q_in
        return q.reshape(B, T, self.cfg.num_heads, self.cfg.qk_head_dim)

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

    def _write(self, c: Array, cache: MLACache, pos: Array) -> MLACache:
        """``_write_xla``, or for a decode step (T = 1) on the Pallas path off TPU one kernel
        (``pallas_kernels.latent_cache``)."""
        if c.shape[1] == 1 and triton_kernels():
            from pallas_kernels.latent_cache import write_latents

            norm = self.kv_a_layernorm
            return MLACache(*write_latents(c[:, 0], norm.weight[...], norm.eps, cache.c_kv, cache.k_pe, pos[:, 0]))
        return self._write_xla(c, cache, pos)

    def _write_xla(self, c: Array, cache: MLACache, pos: Array) -> MLACache:
        """The cache with the new tokens' latents (kv_a_proj_with_mqa's output c [B, T, R + P]) at
        positions pos [B, T]; positions past its end are dropped."""
        c_kv, k_pe = self.latent(c)
        rows = jnp.arange(c.shape[0])[:, None]
        return MLACache(cache.c_kv.at[rows, pos].set(c_kv.astype(cache.c_kv.dtype), mode="drop"),
                        cache.k_pe.at[rows, pos].set(k_pe.astype(cache.k_pe.dtype), mode="drop"))

    def init_cache(self, batch: int, max_len: int, dtype=jnp.float32) -> MLACache:
        cfg = self.cfg
        return MLACache(jnp.zeros((batch, max_len, cfg.kv_lora_rank), dtype),
                        jnp.zeros((batch, max_len, cfg.qk_rope_head_dim), dtype))

    def extend(self, x: Array, cache: MLACache, start: Array, window: int | None = None,
               norm: RMSNorm | None = None, residual: Array | None = None) -> tuple[Array, MLACache]:
        """New tokens x [B, T, D] at positions start[b] + t against the cache: in the absorbed form, or
        for T > 1 on the Pallas path (``_flash_kernel``) over keys and values expanded from the
        cache's latents by ``pallas_kernels.prefill_attention``, which does not materialize scores.

        Writes the new latents into the cache (positions past its end are dropped), then attends
        every query to the cached positions at or before its own. Padding after a sequence's last
        token is written too, but only ever seen by later padding: the next real token overwrites it.
        ``window`` (static) reads only the first ``window`` cache positions: every real token's
        position must be below it (the caller's guarantee); None reads the whole cache. ``residual``
        [B, T, D], when given, is added to the output.
        """
        cfg = self.cfg
        q_in, c, gate = self.inputs(x, norm)
        pos = start[:, None] + jnp.arange(x.shape[1])  # [B, T]
        cache = self._write(c, cache, pos)
        keys = MLACache(cache.c_kv[:, :window], cache.k_pe[:, :window])  # [:None] is everything
        q = self.queries(q_in)
        if x.shape[1] > 1 and self._flash_kernel():  # the cache's dtype rounds the operands, as absorbed
            o = self._flash_attention(q, keys.c_kv, keys.k_pe, pos, keys.c_kv.dtype)
        else:
            visible = jnp.arange(keys.c_kv.shape[1])[None, None, :] <= pos[:, :, None]  # [B, T, S]
            q_nope, q_pe = q[..., : cfg.qk_nope_head_dim], q[..., cfg.qk_nope_head_dim :]
            o = absorbed_attention(q_nope, q_pe, keys.c_kv, keys.k_pe, self.kv_b_proj.weight[...], visible,
                                   cfg.qk_head_dim**-0.5)
        return self.output(gate, o, x.dtype, residual), cache

    def _flash_kernel(self) -> bool:
        """Whether the expanded form attends by the flash-attention kernel (``pallas_kernels.prefill_attention``):
        on the Pallas path off TPU, with head widths the kernel takes (any in interpret mode)."""
        from pallas_kernels.prefill_attention import prefill_attention_runs

        cfg = self.cfg
        return triton_kernels() and (pallas_interpret() or prefill_attention_runs(
            cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim))

    def _flash_attention(self, q: Array, c_kv: Array, k_pe: Array, positions: Array, dtype) -> Array:
        """Queries q [B, T, H, nope + rope] at positions [B, T] over the latents c_kv [B, S, R] (after
        kv_a_layernorm) and k_pe [B, S, P], expanded into per-head keys and values, by the kernel;
        operands rounded to ``dtype``. Returns [B, T, H, V] float32."""
        from pallas_kernels.prefill_attention import prefill_attention

        cfg, nope = self.cfg, self.cfg.qk_nope_head_dim
        k_nope, v = mla_expand(c_kv.astype(dtype), self.kv_b_proj.weight[...].astype(dtype), cfg.num_heads, nope)
        return prefill_attention(q[..., :nope].astype(dtype), q[..., nope:].astype(dtype), k_nope, k_pe.astype(dtype),
                                 v, positions, cfg.qk_head_dim**-0.5)

    def __call__(self, x: Array, norm: RMSNorm | None = None, residual: Array | None = None) -> Array:
        """x [B, T, D] (RMS-normed by ``norm`` first, when given) -> [B, T, D], the expanded form (on the
        Pallas path by the flash-attention kernel: no [B, H, T, T] scores), plus ``residual`` when given."""
        cfg = self.cfg
        q_in, c, gate = self.inputs(x, norm)
        c_kv, k_pe = self.latent(c)
        q = self.queries(q_in)
        if self._flash_kernel():
            B, T = x.shape[:2]
            o = self._flash_attention(q, c_kv, k_pe, jnp.broadcast_to(jnp.arange(T), (B, T)), x.dtype)
        else:
            k, v = mla_keys_values(c_kv, k_pe, self.kv_b_proj.weight[...].astype(x.dtype), cfg.num_heads,
                                   cfg.qk_nope_head_dim)
            o = causal_attention(q, k, v, cfg.qk_head_dim**-0.5)
        return self.output(gate, o, x.dtype, residual)


__all__ = ["MLA", "MLACache", "LATENT_NORM_EPS"]
