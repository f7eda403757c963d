"""The router's selection in one kernel: sigmoid, bias-picked top-k, renormalization, scaling.

``select_experts(logits, correction_bias, k, renormalize, scaling_factor)`` is
``k3jax.functional.moe.select_experts`` (the router after its matmul): scores = sigmoid(logits);
the k experts with the largest ``scores + correction_bias`` (ties to the lower index, as
``lax.top_k``), weighted by their scores (not the bias), renormalized to sum 1 if asked, times the
scaling factor. XLA runs this as
about ten small kernels (top-k alone is three); at decode sizes each costs more than its work, so
here one program per token does it all: k rounds of argmax over the token's E scores. Triton needs
power-of-two widths: E and k are padded (-inf logits, unused slots dropped). ``pick_experts`` is that
body on one token's values, for other kernels to route inside themselves (the fused decode MoE).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from k3jax.implementation import pallas_interpret
from k3jax.typing import Array


def padded_router(logits: Array, correction_bias: Array) -> tuple[Array, Array]:
    """logits [T, E] and correction_bias [E] -> float32 logits [T, E'] and bias [1, E'], E' the next power
    of two (Triton's widths): padding logits -inf (never picked), padding bias 0."""
    E = logits.shape[1]
    width = pl.next_power_of_2(E)
    logits, bias = logits.astype(jnp.float32), correction_bias.astype(jnp.float32)[None]
    if width == E:
        return logits, bias
    return (jnp.pad(logits, ((0, 0), (0, width - E)), constant_values=-jnp.inf),
            jnp.pad(bias, ((0, 0), (0, width - E))))


def pick_experts(logits: Array, bias: Array, *, k: int, renormalize: bool, scaling: float,
                 slots: int) -> tuple[Array, Array]:
    """The selection of one token inside a kernel: logits [1, E'] float32 (padding -inf) and bias [1, E']
    -> (weights [1, slots] float32, experts [1, slots] int32), slots >= k; slots past k are zero."""
    scores = jax.nn.sigmoid(logits)
    choice = jnp.where(jnp.isneginf(logits), -jnp.inf, scores + bias)
    lanes = jax.lax.broadcasted_iota(jnp.int32, choice.shape, 1)
    slot = jax.lax.broadcasted_iota(jnp.int32, (1, slots), 1)
    width = choice.shape[1]
    weights, experts = jnp.zeros((1, slots), jnp.float32), jnp.zeros((1, slots), jnp.int32)
    for i in range(k):
        best = jnp.max(choice, axis=1, keepdims=True)
        index = jnp.min(jnp.where(choice == best, lanes, width), axis=1, keepdims=True)  # lowest index of the max
        picked = lanes == index
        weights = jnp.where(slot == i, jnp.sum(jnp.where(picked, scores, 0.0), axis=1, keepdims=True), weights)
        experts = jnp.where(slot == i, index, experts)
        choice = jnp.where(picked, -jnp.inf, choice)
    if renormalize:
        weights = weights / (jnp.sum(weights, axis=1, keepdims=True) + 1e-20)
    return weights * scaling, experts


def _select_kernel(logits_ref, bias_ref, weights_ref, experts_ref, *, k: int, renormalize: bool, scaling: float):
    """Refs: logits [1, E'] float32 (padding -inf), bias [1, E'], weights [1, k'] float32, experts
    [1, k'] int32 (k' >= k; slots past k are left zero)."""
    weights_ref[...], experts_ref[...] = pick_experts(logits_ref[...], bias_ref[...], k=k, renormalize=renormalize,
                                                      scaling=scaling, slots=weights_ref.shape[1])


@functools.partial(jax.jit, static_argnames=("k", "renormalize", "scaling_factor", "interpret"))
def _select(logits, correction_bias, *, k, renormalize, scaling_factor, interpret):
    T = logits.shape[0]
    logits, bias = padded_router(logits, correction_bias)
    width, slots = logits.shape[1], pl.next_power_of_2(k)
    row = lambda n: pl.BlockSpec((1, n), lambda t: (t, 0))
    weights, experts = pl.pallas_call(
        functools.partial(_select_kernel, k=k, renormalize=renormalize, scaling=scaling_factor),
        out_shape=(jax.ShapeDtypeStruct((T, slots), jnp.float32), jax.ShapeDtypeStruct((T, slots), jnp.int32)),
        grid=(T,),
        in_specs=[row(width), pl.BlockSpec((1, width), lambda t: (0, 0))],
        out_specs=(row(slots), row(slots)),
        interpret=interpret,
        name="select_experts",
    )(logits, bias)
    return weights[:, :k], experts[:, :k]


def check_router(logits: Array, correction_bias: Array, k: int) -> None:
    """Raises ValueError unless logits are [T, E], correction_bias [E] and 1 <= k <= E."""
    if logits.ndim != 2 or correction_bias.shape != logits.shape[1:]:
        raise ValueError(f"logits [T, E] = {logits.shape} and correction_bias [E] = {correction_bias.shape} disagree")
    if not 1 <= k <= logits.shape[1]:
        raise ValueError(f"k = {k}: must be between 1 and the {logits.shape[1]} experts")


def select_experts(logits: Array, correction_bias: Array, k: int, renormalize: bool, scaling_factor: float, *,
                   interpret: bool | None = None) -> tuple[Array, Array]:
    """logits [T, E] (the router's x . gate_weight^T, float32), correction_bias [E] -> (weights
    [T, k] float32, experts [T, k] int32), as ``k3jax.functional.moe.select_experts``."""
    check_router(logits, correction_bias, k)
    interpret = pallas_interpret() if interpret is None else interpret
    return _select(logits, correction_bias, k=k, renormalize=renormalize, scaling_factor=float(scaling_factor),
                   interpret=interpret)


__all__ = ["check_router", "padded_router", "pick_experts", "select_experts"]
