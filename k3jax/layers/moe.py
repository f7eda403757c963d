"""Mixture of experts as a Flax NNX module: Stable LatentMoE (K3) or plain MoE (Kimi Linear).

Routed experts are stacked per layer in the PyTorch layout (w1, w3 [E, F, R]; w2 [E, R, F]); the
released checkpoint's per-expert tensors ``experts.<e>.w1.weight`` are rows of these stacks.
"""

from __future__ import annotations

import functools
from typing import Literal

import jax.numpy as jnp
from flax import nnx

from k3jax.config import MoEConfig
from k3jax.functional.moe import Activation, grouped_matmul, moe_dense, moe_sorted, select_experts
from k3jax.implementation import get_implementation, pallas_interpret, triton_kernels
from k3jax.layers.basic import Linear, RMSNorm, Rngs, add_rounded, materialize, normal, project
from k3jax.layers.mlp import DenseMLP
from k3jax.mx import MXTensor, quantize_compiled
from k3jax.sharding import expert_mesh, moe_expert_parallel
from k3jax.typing import Array

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


# The Pallas path takes the routed experts of MXFP4 layers through the grouped Mosaic GPU kernel in its tiled layout
# (``pallas_kernels.mx_matmul.tiled_moe_mx``), in tiles by the kernel's own density rule
# (``mosaic_gpu_grouped.default_bm``); False: the sorted dispatch there.
# From this many pairs per expert on average the layer counts its routed products as prefill's
# (``TILED_MOE_AT_PREFILL``), below as decode's (``TILED_MOE_AT_DECODE``): 256 is `mini`'s 2048-token chunk.
PREFILL_PAIRS_PER_EXPERT = 256
# Prefill: at `mini`'s 2048-token chunk the MoE alone measured 20% faster than the sorted dispatch and the whole 8K
# prefill 60.9 against 66.6 ms (benchmarks/RESULTS.md, issue 4, sixteenth session).
TILED_MOE_AT_PREFILL = True
# Sparse (decode), on a GPU only: on the H200 (MX run 15) K3's routed layer (896 experts, top 16) took 137 against
# 251 us at 1 token and 3.9 against 7.0 ms at 64 (1.8-2.0x at 1-64 tokens, 2.1-3.0 TB/s of MXFP4 weights), `mini`'s
# 58-85 against 86-131 us at 8-64 tokens; tiles of 16 were slower except at `mini`'s 64 tokens (81 against 85 us).
TILED_MOE_AT_DECODE = True
# Where the tiled MoE runs, the fused decode kernels (``_fused_decode``) only up to this many tokens: at `mini`'s
# 8 tokens the tiled MoE took 58.0 us against 65.8 for the two-kernel MoE, at 1 token 40.7 against 14.6.
FUSED_MOE_MAX_TOKENS_BESIDE_TILED = 1


def _expert_matmul(x: Array, w: Array | MXTensor, group_sizes: Array) -> Array:
    """Grouped expert matmul: the MX kernel on the Pallas path, decode-then-``ragged_dot`` otherwise."""
    if isinstance(w, MXTensor):
        if get_implementation() == "pallas":
            from pallas_kernels.mx_matmul import grouped_mx_matmul

            return grouped_mx_matmul(x, w, group_sizes)
        w = w.decode(x.dtype)
    return grouped_matmul(x, w, group_sizes)


def _fused_decode(w: Array | MXTensor, tokens: int, k: int, tiled: bool) -> bool:
    """The Pallas path's fused MoE kernels for a few (token, expert) pairs (decode) on MXFP4 experts,
    where they measured faster than the sorted dispatch (``fused_moe_pays``) and, where the tiled MoE
    runs (``tiled``), up to ``FUSED_MOE_MAX_TOKENS_BESIDE_TILED`` tokens; Triton's, so not on a TPU, and not
    for stacks whose offsets wrap in them (``offsets_wrap``)."""
    if not isinstance(w, MXTensor) or not triton_kernels():
        return False
    from pallas_kernels._triton import offsets_wrap

    if (tiled and tokens > FUSED_MOE_MAX_TOKENS_BESIDE_TILED) or offsets_wrap(w.codes):
        return False
    from pallas_kernels.mx_matmul import fused_moe_pays

    return fused_moe_pays(tokens * k, k, w.shape[1])


def _mosaic_gpu_runs() -> bool:
    from pallas_kernels.mx_matmul.ops import mosaic_gpu_runs

    return mosaic_gpu_runs()


def _tiled_bm(w: Array | MXTensor, x: Array, pairs: int) -> int | None:
    """Pairs per tile of the Pallas path's tiled Mosaic GPU MoE for MXFP4 experts and bf16 x
    (``default_bm``), or None where it does not run: from ``PREFILL_PAIRS_PER_EXPERT`` pairs an expert (prefill,
    ``TILED_MOE_AT_PREFILL``) on a GPU where the Mosaic GPU kernels run or in interpret mode on a CPU, below that
    (decode, ``TILED_MOE_AT_DECODE``) on such a GPU only (a decode step through the interpreter takes seconds)."""
    if not isinstance(w, MXTensor) or x.dtype != jnp.bfloat16 or get_implementation() != "pallas":
        return None
    from pallas_kernels.mx_matmul.mosaic_gpu_grouped import default_bm

    bm, runs = default_bm(pairs, w.shape[0]), _mosaic_gpu_runs()
    if pairs < PREFILL_PAIRS_PER_EXPERT * w.shape[0]:
        return bm if TILED_MOE_AT_DECODE and runs else None
    return bm if TILED_MOE_AT_PREFILL and (runs or pallas_interpret()) else None


def _dense(w: Array | MXTensor, dtype) -> Array:
    return w.decode(dtype) if isinstance(w, MXTensor) else w


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
        return self._select(project(x, [self.gate.weight[...]], [jnp.float32])[0])

    def _select(self, logits: Array) -> tuple[Array, Array]:
        """Router logits [T, E] float32 -> (weights, experts). The Pallas path (off TPU) picks the
        experts in one kernel (``pallas_kernels.route``)."""
        cfg = self.cfg
        select = select_experts
        if triton_kernels():
            from pallas_kernels import route as kernels

            select = kernels.select_experts
        return select(logits, self.gate.e_score_correction_bias[...], cfg.experts_per_token, cfg.renormalize,
                      cfg.routed_scaling_factor)

    def _inputs(self, flat: Array, norm: RMSNorm | None) -> tuple[Array, Array, list[Array]]:
        """(router logits float32, the routed experts' input, the shared experts' gate and up): the
        maps that read the layer's input, together (``project``)."""
        if not self.cfg.latent_size:  # the routed experts read the (normed) input itself
            flat = materialize(flat)
            if norm is not None:
                flat, norm = norm(flat), None
        weights, dtypes = [self.gate.weight[...]], [jnp.float32]
        if self.cfg.latent_size:
            weights.append(self.routed_expert_down_proj.weight[...])
        if self.cfg.num_shared_experts:
            weights += [self.shared_experts.gate_proj.weight[...], self.shared_experts.up_proj.weight[...]]
        outs = project(flat, weights, dtypes + [flat.dtype] * (len(weights) - 1), norm)
        logits, rest = outs[0], outs[1:]
        if self.cfg.latent_size:
            return logits, rest[0], rest[1:]
        return logits, flat, rest

    def __call__(self, x: Array, norm: RMSNorm | None = None, residual: Array | None = None) -> Array:
        """x [B, T, D] (RMS-normed by ``norm`` first, when given) -> [B, T, D], plus ``residual`` when
        given: routed + shared + residual, each sum rounded (with a latent, added by the up projection's
        kernel on its kernel path: ``project``'s ``add``)."""
        B, T, D = x.shape
        cfg = self.cfg
        logits, z, shared = self._inputs(x.reshape(B * T, D), norm)
        w1, w3, w2 = (w.get_value() for w in (self.experts.w1, self.experts.w3, self.experts.w2))
        mesh = expert_mesh()
        sorted_dispatch = mesh is not None or self.dispatch == "sorted"  # a mesh always sorts
        bm = _tiled_bm(w1, z, B * T * cfg.experts_per_token) if sorted_dispatch else None
        # the fused kernels index the whole stacks: not under a mesh
        fused = mesh is None and self.dispatch == "sorted" and _fused_decode(w1, B * T, cfg.experts_per_token,
                                                                             tiled=bm is not None)
        # with a latent, the up projection's kernel rounds the fused MoE's float32 sums itself (``read_as``)
        fused_out = jnp.float32 if cfg.latent_size else None
        if fused and self._routes_in_kernel(B * T):
            from pallas_kernels import mx_matmul

            y = mx_matmul.routed_moe_mx_split(
                z, w1, w3, w2, logits, self.gate.e_score_correction_bias[...], self.act, k=cfg.experts_per_token,
                renormalize=cfg.renormalize, scaling_factor=cfg.routed_scaling_factor, out_dtype=fused_out)
        else:
            y = self._routed(z, w1, w3, w2, *self._select(logits), mesh, fused, fused_out, bm)
        add = [self.shared_experts.down(*shared)] if cfg.num_shared_experts else []
        add += [] if residual is None else [residual.reshape(B * T, D)]
        if cfg.latent_size:
            norm = self.routed_expert_norm if cfg.latent_norm else None
            y = project(y, [self.routed_expert_up_proj.weight[...]], norm=norm, read_as=z.dtype, add=add)[0]
        else:
            y = add_rounded(y, add)
        return y.reshape(B, T, D)

    def _routes_in_kernel(self, tokens: int) -> bool:
        """Whether the fused MoE's two kernels pick the experts themselves (``routed_moe_mx_split``, no
        selection kernel before them): at one token, where each pair's pick is made by its F / bn hidden
        programs only."""
        from pallas_kernels import mx_matmul

        return tokens == 1 and mx_matmul.SPLIT_MIN_TOKENS <= 1

    def _routed(self, z: Array, w1, w3, w2, weights: Array, experts: Array, mesh, fused: bool, fused_out,
                bm: int | None) -> Array:
        """The routed experts' sum for chosen (weights, experts): the fused MoE kernels, the sorted MoE
        (``_sorted_moe``), sharded over a mesh or not, or every expert on every token."""
        if fused:
            from pallas_kernels import mx_matmul

            # two kernels (no atomics) from SPLIT_MIN_TOKENS tokens, where the one kernel's atomic adds meet
            split = z.shape[0] >= mx_matmul.SPLIT_MIN_TOKENS
            kernels = mx_matmul.fused_moe_mx_split if split else mx_matmul.fused_moe_mx
            return kernels(z, w1, w3, w2, weights, experts, self.act, out_dtype=fused_out)
        if mesh is not None:
            return moe_expert_parallel(z, w1, w3, w2, weights, experts, self._sorted_moe(bm), mesh)
        if self.dispatch == "sorted":
            return self._sorted_moe(bm)(z, w1, w3, w2, weights, experts)
        w1, w3, w2 = (_dense(w, z.dtype) for w in (w1, w3, w2))
        return moe_dense(z, w1, w3, w2, weights, experts, self.act)

    def _sorted_moe(self, bm: int | None):
        """The routed experts over token copies grouped by expert, ``moe_sorted``'s contract: the tiled
        Mosaic GPU MoE in tiles of ``bm`` pairs (``_tiled_bm``), else the sorted dispatch."""
        if bm is not None:
            from pallas_kernels import mx_matmul

            return functools.partial(mx_matmul.tiled_moe_mx, act=self.act, bm=bm, interpret=pallas_interpret())
        return functools.partial(moe_sorted, act=self.act, matmul=_expert_matmul)


__all__ = ["MoE", "Router", "Experts", "Dispatch"]
