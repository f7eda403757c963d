"""Gated MLPs: the dense layer-0 MLP and the shared experts (SiTU for K3, SwiGLU for Kimi Linear)."""

from __future__ import annotations

from functools import partial

import jax.numpy as jnp
from flax import nnx

from k3jax.functional.moe import Activation, situ, swiglu
from k3jax.functional.linear import Activated
from k3jax.layers.basic import Linear, RMSNorm, Rngs, norm_params
from k3jax.typing import Array
from pallas_kernels.matvec.ops import project


def activation(name: str, situ_beta: float = 4.0, situ_linear_beta: float = 25.0) -> Activation:
    """The gated activation act(gate, up) named by the config's ``hidden_act``."""
    if name == "situ":
        return partial(situ, beta=situ_beta, linear_beta=situ_linear_beta)
    if name == "silu":
        return swiglu
    raise ValueError(f"hidden_act: unsupported activation {name!r}; expected 'situ' or 'silu'")


class DenseMLP(nnx.Module):
    """down_proj(act(gate_proj x, up_proj x)); weights gate/up [F, D], down [D, F]."""

    def __init__(self, dim: int, width: int, act: Activation, *, rngs: Rngs, param_dtype=jnp.float32):
        self.act = act
        self.gate_proj = Linear(dim, width, rngs=rngs, param_dtype=param_dtype)
        self.up_proj = Linear(dim, width, rngs=rngs, param_dtype=param_dtype)
        self.down_proj = Linear(width, dim, rngs=rngs, param_dtype=param_dtype)

    def __call__(self, x: Array, norm: RMSNorm | None = None, residual: Array | None = None) -> Array:
        """x [..., D] (RMS-normed by ``norm`` first, when given) -> [..., D], plus ``residual`` when given."""
        gate, up = project(x, [self.gate_proj.weight[...], self.up_proj.weight[...]], norm=norm_params(norm))
        return self.down(gate, up, () if residual is None else (residual,))

    def down(self, gate: Array, up: Array, add: tuple[Array, ...] = ()) -> Array:
        """The output from the gate and up projections: down_proj(act(gate, up)) through ``project`` (which
        may compute the activation inside its kernel), plus ``add`` (project's epilogue)."""
        return project(Activated(self.act, gate, up), [self.down_proj.weight[...]], add=add)[0]


__all__ = ["DenseMLP", "activation"]
