"""Mixture of experts as a Flax NNX module: Stable LatentMoE (K3) or plain MoE (Kimi Linear).

Routed experts are stacked per layer in the PyTorch layout (w1, w3 [E, F, R]; w2 [E, R, F]); the
released checkpoint's per-expert tensors ``experts.<e>.w1.weight`` are rows of these stacks.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.config import MoEConfig
from k3jax.functional.moe import Activation, moe_dense, moe_sorted, route
from k3jax.layers.basic import Linear, RMSNorm, Rngs, normal
from k3jax.layers.mlp import DenseMLP
from k3jax.typing import Array

Dispatch = Literal["sorted", "dense"]


class Router(nnx.Module):
    """Sigmoid router: weight [E, D] and the selection-only correction bias [E] (float32)."""

    def __init__(self, dim: int, num_experts: int, *, rngs: Rngs, param_dtype=jnp.float32):
        self.weight = nnx.Param(normal(rngs, (num_experts, dim), dim**-0.5, param_dtype))
        self.e_score_correction_bias = nnx.Param(jnp.zeros((num_experts,), jnp.float32))


class Experts(nnx.Module):
    """Stacked routed experts: w1 (gate), w3 (up) [E, F, R] and w2 (down) [E, R, F]."""

    def __init__(self, num: int, width: int, hidden: int, *, rngs: Rngs, param_dtype=jnp.float32):
        self.w1 = nnx.Param(normal(rngs, (num, hidden, width), width**-0.5, param_dtype))
        self.w3 = nnx.Param(normal(rngs, (num, hidden, width), width**-0.5, param_dtype))
        self.w2 = nnx.Param(normal(rngs, (num, width, hidden), hidden**-0.5, param_dtype))


class MoE(nnx.Module):
    """x [B, T, D] -> [B, T, D]: routed experts (in the latent for K3) plus shared experts."""

    def __init__(
        self, dim: int, cfg: MoEConfig, act: Activation, eps: float, *, rngs: Rngs,
        param_dtype=jnp.float32, dispatch: Dispatch = "sorted",
    ):
        self.cfg, self.act, self.dispatch = cfg, act, dispatch
        width = cfg.latent_size or dim
        self.gate = Router(dim, cfg.num_experts, rngs=rngs, param_dtype=param_dtype)
        self.experts = Experts(cfg.num_experts, width, cfg.intermediate_size, rngs=rngs, param_dtype=param_dtype)
        if cfg.latent_size:
            self.routed_expert_down_proj = Linear(dim, width, rngs=rngs, param_dtype=param_dtype)
            self.routed_expert_up_proj = Linear(width, dim, rngs=rngs, param_dtype=param_dtype)
            if cfg.latent_norm:
                self.routed_expert_norm = RMSNorm(width, eps, param_dtype=param_dtype)
        if cfg.num_shared_experts:
            shared = cfg.num_shared_experts * cfg.intermediate_size
            self.shared_experts = DenseMLP(dim, shared, act, rngs=rngs, param_dtype=param_dtype)

    def route(self, x: Array) -> tuple[Array, Array]:
        """x [T, D] -> (weights [T, k] float32, experts [T, k] int32)."""
        cfg = self.cfg
        return route(x, self.gate.weight[...], self.gate.e_score_correction_bias[...], cfg.experts_per_token,
                     cfg.renormalize, cfg.routed_scaling_factor)

    def __call__(self, x: Array) -> Array:
        B, T, D = x.shape
        flat = x.reshape(B * T, D)
        weights, experts = self.route(flat)
        z = self.routed_expert_down_proj(flat) if self.cfg.latent_size else flat
        dispatch = moe_sorted if self.dispatch == "sorted" else moe_dense
        e = self.experts
        y = dispatch(z, e.w1[...], e.w3[...], e.w2[...], weights, experts, self.act)
        if self.cfg.latent_size:
            if self.cfg.latent_norm:
                y = self.routed_expert_norm(y)
            y = self.routed_expert_up_proj(y)
        if self.cfg.num_shared_experts:
            y = y + self.shared_experts(flat)
        return y.reshape(B, T, D)


__all__ = ["MoE", "Router", "Experts", "Dispatch"]
