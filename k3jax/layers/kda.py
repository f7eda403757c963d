"""The KDA layer (Kimi Delta Attention, spec section 3) as a Flax NNX module."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.config import KDAConfig
from k3jax.functional.kda import bounded_gate, softplus_gate
from k3jax.functional.norms import gated_rms_norm
from k3jax.layers.basic import Linear, RMSNorm, Rngs, norm_params, normal
from k3jax.typing import Array
from pallas_kernels.kda.ops import gated_kda
from pallas_kernels.matvec.ops import project


class KDAState(NamedTuple):
    """What a sequence carries between calls: the short convs' last W-1 inputs [B, W-1, 3*H*K] (q, k,
    v channels side by side: one buffer, so a decode step updates it in one kernel) and the state
    [B, H, K, V]."""

    conv: Array
    recurrent: Array


class ShortConv(nnx.Module):
    """A causal depthwise conv's weight over W taps, [F, 1, W] float32 as released. The KDA layer runs
    its three (q, k, v) as one conv over the channels side by side (``causal_conv``)."""

    def __init__(self, width: int, taps: int, *, rngs: Rngs):
        self.weight = nnx.Param(normal(rngs, (width, 1, taps), taps**-0.5))


class KDA(nnx.Module):
    """x [B, T, D] -> [B, T, D]. Parameter names follow the released ``self_attn.*`` tensors."""

    def __init__(self, dim: int, cfg: KDAConfig, eps: float, *, rngs: Rngs, param_dtype=jnp.float32):
        H, K, W = cfg.num_heads, cfg.head_dim, cfg.conv_size
        width = H * K
        self.num_heads, self.head_dim, self.eps = H, K, eps
        self.lower_bound = cfg.gate_lower_bound
        lin = lambda i, o: Linear(i, o, rngs=rngs, param_dtype=param_dtype)
        self.q_proj, self.k_proj, self.v_proj = lin(dim, width), lin(dim, width), lin(dim, width)
        conv = lambda: ShortConv(width, W, rngs=rngs)
        self.q_conv1d, self.k_conv1d, self.v_conv1d = conv(), conv(), conv()
        self.f_a_proj, self.f_b_proj = lin(dim, K), lin(K, width)
        self.b_proj = lin(dim, H)
        self.A_log = nnx.Param(jnp.log(1.0 + 15.0 * jax.nn.sigmoid(normal(rngs, (H,), 1.0))))
        self.dt_bias = nnx.Param(normal(rngs, (width,), 1.0))
        if cfg.full_rank_gate:
            self.g_proj = lin(dim, width)
        else:
            self.g_a_proj, self.g_b_proj = lin(dim, K), lin(K, width)
        self.o_norm = RMSNorm(K, eps, param_dtype=param_dtype)
        self.o_proj = lin(width, dim)

    def initial_state(self, batch: int) -> KDAState:
        width = self.num_heads * self.head_dim
        conv = jnp.zeros((batch, self.q_conv1d.weight.shape[-1] - 1, 3 * width), jnp.float32)
        rec = jnp.zeros((batch, self.num_heads, self.head_dim, self.head_dim), jnp.float32)
        return KDAState(conv, rec)

    def __call__(
        self, x: Array, state: KDAState | None = None, valid: Array | None = None, norm: RMSNorm | None = None,
        residual: Array | None = None, stats: bool = False,
    ) -> tuple[Array, KDAState]:
        """x [B, T, D] (RMS-normed by ``norm`` first, when given) -> (out [B, T, D], plus ``residual`` when
        given; state after the tokens). ``valid`` [B, T] marks real tokens (a prefix of each row; the rest
        is right padding that leaves the state untouched). ``stats`` adds a third result, the retention
        [H*K]: exp(g) per channel, averaged over the real tokens."""
        B, T, _ = x.shape
        H, K = self.num_heads, self.head_dim
        state = self.initial_state(B) if state is None else state
        lengths = None if valid is None else jnp.sum(valid, axis=1, dtype=jnp.int32)
        heads = lambda a: a.reshape(B, T, H, -1)
        gate_in = self.g_proj if hasattr(self, "g_proj") else self.g_a_proj
        maps = (self.q_proj, self.k_proj, self.v_proj, self.f_a_proj, self.b_proj, gate_in)
        taps = [c.weight[...][:, 0].astype(jnp.float32) for c in (self.q_conv1d, self.k_conv1d, self.v_conv1d)]
        q, k, v, f_a, beta_logits, gate, conv = project(x, [m.weight[...] for m in maps], norm=norm_params(norm),
                                                        conv=(taps, state.conv, lengths))
        z = heads(self.f_b_proj(f_a))
        o, rec = gated_kda(heads(q), heads(k), heads(v), z, self.A_log[...], self.dt_bias[...].reshape(H, K),
                           beta_logits, state.recurrent, self.lower_bound, valid)
        gate = gate if hasattr(self, "g_proj") else self.g_b_proj(gate)
        o = gated_rms_norm(o, heads(gate), self.o_norm.weight[...], self.eps).astype(x.dtype)
        add = () if residual is None else (residual,)
        out = project(o.reshape(B, T, H * K), [self.o_proj.weight[...]], add=add)[0], KDAState(conv, rec)
        return (*out, self._retention(z, valid)) if stats else out

    def _retention(self, z: Array, valid: Array | None) -> Array:
        """exp(g) [H*K] averaged over the real tokens of z [B, T, H, K]."""
        H, K = self.num_heads, self.head_dim
        dt_bias = self.dt_bias[...].reshape(H, K)
        g = (softplus_gate(z, self.A_log[...], dt_bias) if self.lower_bound is None
             else bounded_gate(z, self.A_log[...], dt_bias, self.lower_bound))
        weight = jnp.ones(z.shape[:2], jnp.float32) if valid is None else valid.astype(jnp.float32)
        kept = jnp.einsum("bt,btc->c", weight, jnp.exp(g).reshape(*z.shape[:2], H * K))
        return jax.lax.stop_gradient(kept / jnp.maximum(weight.sum(), 1.0))


__all__ = ["KDA", "KDAState", "ShortConv"]
