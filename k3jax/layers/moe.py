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
from k3jax.functional.attn_res import DepthMix
from k3jax.functional.linear import add_rounded, prepared
from k3jax.functional.moe import Activation
from k3jax.layers.basic import Linear, RMSNorm, Rngs, norm_params, normal
from k3jax.layers.mlp import DenseMLP
from k3jax.mx import quantize_compiled
from k3jax.sharding.mesh import hold
from k3jax.typing import Array
from pallas_kernels.matvec.ops import project
from pallas_kernels.moe.ops import routed_experts, select_experts

Dispatch = Literal["sorted", "dense"]


class Router(nnx.Module):
    """Sigmoid router: weight [E, D] and the selection-only correction bias [E] (float32)."""

    def __init__(self, dim: int, num_experts: int, *, rngs: Rngs, param_dtype=jnp.float32):
        self.weight = nnx.Param(normal(rngs, (num_experts, dim), dim**-0.5, param_dtype))
        self.e_score_correction_bias = nnx.Param(jnp.zeros((num_experts,), jnp.float32))


class Experts(nnx.Module):
    """Stacked routed experts: w1 (gate), w3 (up) [E, F, R] and w2 (down) [E, R, F]; arrays, or
    ``MXTensor`` (MXFP4 codes + E8M0 scales, the released bytes) when ``packed``."""

    def __init__(self, num: int, width: int, hidden: int, *, rngs: Rngs, param_dtype=jnp.float32, packed=False):
        def weight(shape, fan_in):
            w = normal(rngs, shape, fan_in**-0.5, param_dtype)
            return nnx.Param(quantize_compiled(w) if packed else w)

        self.w1 = weight((num, hidden, width), width)
        self.w3 = weight((num, hidden, width), width)
        self.w2 = weight((num, width, hidden), hidden)


class MoE(nnx.Module):
    """x [B, T, D] -> [B, T, D]: routed experts (in the latent for K3) plus shared experts."""

    def __init__(
        self, dim: int, cfg: MoEConfig, act: Activation, eps: float, *, rngs: Rngs,
        param_dtype=jnp.float32, dispatch: Dispatch = "sorted", packed_experts: bool = False,
    ):
        self.cfg, self.act, self.dispatch = cfg, act, dispatch
        width = cfg.latent_size or dim
        self.gate = Router(dim, cfg.num_experts, rngs=rngs, param_dtype=param_dtype)
        self.experts = Experts(cfg.num_experts, width, cfg.intermediate_size, rngs=rngs, param_dtype=param_dtype,
                               packed=packed_experts)
        if cfg.latent_size:
            self.routed_expert_down_proj = Linear(dim, width, rngs=rngs, param_dtype=param_dtype)
            self.routed_expert_up_proj = Linear(width, dim, rngs=rngs, param_dtype=param_dtype)
            if cfg.latent_norm:
                self.routed_expert_norm = RMSNorm(width, eps, param_dtype=param_dtype)
        if cfg.num_shared_experts:
            shared = cfg.num_shared_experts * cfg.intermediate_size
            self.shared_experts = DenseMLP(dim, shared, act, rngs=rngs, param_dtype=param_dtype)

    def route(self, x: Array) -> tuple[Array, Array]:
        """x [T, D] (normed) -> (weights [T, k] float32, experts [T, k] int32)."""
        cfg = self.cfg
        logits = project(x, [self.gate.weight[...]], [jnp.float32])[0]
        return select_experts(logits, self.gate.e_score_correction_bias[...], cfg.experts_per_token, cfg.renormalize,
                              cfg.routed_scaling_factor)

    def _inputs(self, x: "Array | DepthMix", norm: RMSNorm | None) -> tuple[Array, Array, list[Array]]:
        """(router logits float32, the routed experts' input, the shared experts' gate and up): the
        maps that read the layer's input, together (``project``)."""
        norm = norm_params(norm)
        if not self.cfg.latent_size:  # the routed experts read the (normed) input itself
            x, norm = prepared(x, norm), None
        weights, dtypes = [self.gate.weight[...]], [jnp.float32]
        if self.cfg.latent_size:
            weights.append(self.routed_expert_down_proj.weight[...])
        if self.cfg.num_shared_experts:
            weights += [self.shared_experts.gate_proj.weight[...], self.shared_experts.up_proj.weight[...]]
        outs = project(x, weights, dtypes + [x.dtype] * (len(weights) - 1), norm)
        logits, rest = outs[0], outs[1:]
        if self.cfg.latent_size:
            return logits, rest[0], rest[1:]
        return logits, x, rest

    def __call__(self, x: Array, norm: RMSNorm | None = None, residual: Array | None = None, stats: bool = False):
        """x [B, T, D] (RMS-normed by ``norm`` first, when given) -> [B, T, D], plus ``residual`` when
        given: routed + shared + residual, each sum rounded (with a latent, added by the up projection:
        ``project``'s ``add``). ``stats``: (output, expert load [E] float32, the top-k picks per expert)."""
        B, T, D = x.shape
        cfg = self.cfg
        logits, z, shared = self._inputs(x.reshape(B * T, D), norm)
        w1, w3, w2 = (w.get_value() for w in (self.experts.w1, self.experts.w3, self.experts.w2))
        # with a latent, the up projection rounds the routed sums itself (``read_as``): float32 where they come so
        y = routed_experts(z, logits, self.gate.e_score_correction_bias[...], w1, w3, w2, self.act,
                           cfg.experts_per_token, cfg.renormalize, cfg.routed_scaling_factor, self.dispatch,
                           out_dtype=jnp.float32 if cfg.latent_size else None)
        y = hold(y.reshape(B, T, -1), "batch", None, None).reshape(B * T, -1)  # on a mesh: the attention's layout
        shared = [hold(a.reshape(B, T, -1), "batch", None, "mlp").reshape(B * T, -1) for a in shared]
        add = [self.shared_experts.down(*shared)] if cfg.num_shared_experts else []
        add += [] if residual is None else [residual.reshape(B * T, D)]
        if cfg.latent_size:
            norm = norm_params(self.routed_expert_norm) if cfg.latent_norm else None
            y = project(y, [self.routed_expert_up_proj.weight[...]], norm=norm, read_as=z.dtype, add=add)[0]
        else:
            y = add_rounded(y, add)
        y = y.reshape(B, T, D)
        return (y, self._load(logits)) if stats else y

    def _load(self, logits: Array) -> Array:
        """How many of the tokens' top-k picks went to each expert: [E] float32, no gradient."""
        cfg = self.cfg
        _, experts = select_experts(logits, self.gate.e_score_correction_bias[...], cfg.experts_per_token,
                                    cfg.renormalize, cfg.routed_scaling_factor)
        load = jnp.zeros((cfg.num_experts,), jnp.float32).at[experts.reshape(-1)].add(1.0)
        return jax.lax.stop_gradient(load)


__all__ = ["MoE", "Router", "Experts", "Dispatch"]
