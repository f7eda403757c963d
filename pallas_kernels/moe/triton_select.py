"""The router's selection in one kernel: sigmoid, bias-picked top-k, renormalization, scaling.

``select_experts(logits, correction_bias, k, renormalize, scaling_factor)`` is
``k3jax.functional.moe.select_experts`` (the router after its matmul): scores = sigmoid(logits);
the k experts with the largest ``scores + correction_bias`` (ties to the lower index, as
``lax.top_k``), weighted by their scores (not the bias), renormalized to sum 1 if asked, times the
scaling factor. XLA runs this as
about ten small kernels (top-k alone is three); at decode sizes each costs more than its work, so
here one kernel does it all: k rounds of argmax over each token's E scores, for a block of tokens per
program (``SELECT_BLOCK_LOGITS``). Triton needs power-of-two widths: E and k are padded (-inf logits,
unused slots dropped), and the tokens to whole blocks.

``expert_ranks``, ``slot_expert`` and ``slot_weight`` make one slot's choice inside another kernel (the
batch-1 routed MoE's hidden kernel, ``pallas_kernels.moe.triton_split``, which needs the expert before
its weight loads and the weight only at its end): each expert's rank is the number of experts ahead of it
(a larger score + bias, or an equal one at a lower index), so one [E, E] comparison and three sums replace
the k rounds of three reductions each.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _platform
from k3jax.typing import Array
from pallas_kernels._triton import triton_params


def _scores_and_choice(logits: Array, bias: Array) -> tuple[Array, Array]:
    """float32 logits (padding lanes -inf) and bias -> (sigmoid scores, what picks: score + bias, -inf on
    padding lanes)."""
    scores = jax.nn.sigmoid(logits)
    return scores, jnp.where(jnp.isneginf(logits), -jnp.inf, scores + bias)


# Router logits per program of ``select_experts``: a block of this many over E' (at least one token). 0: one token
# per program. On the H200 (benchmarks/HISTORY.md, 2026-12-03) `mini`'s 2048 and 8192-token
# prefill chunks took 8.1 us against 17.2 and 56.2 a token a program; at K3's 896 experts a block is one token.
SELECT_BLOCK_LOGITS = 1024


def _select_kernel(logits_ref, bias_ref, weights_ref, experts_ref, *, k: int, renormalize: bool, scaling: float):
    """Refs: logits [R, E'] float32 (padding -inf), bias [1, E'], weights [R, k'] float32, experts
    [R, k'] int32 (k' >= k; slots past k are left zero), R tokens."""
    scores, choice = _scores_and_choice(logits_ref[...], bias_ref[...])
    lanes = jax.lax.broadcasted_iota(jnp.int32, choice.shape, 1)
    slots = jax.lax.broadcasted_iota(jnp.int32, weights_ref.shape, 1)
    width = choice.shape[1]
    weights, experts = jnp.zeros(weights_ref.shape, jnp.float32), jnp.zeros(experts_ref.shape, jnp.int32)
    for i in range(k):
        best = jnp.max(choice, axis=1, keepdims=True)
        index = jnp.min(jnp.where(choice == best, lanes, width), axis=1, keepdims=True)  # lowest index of the max
        picked = lanes == index
        weights = jnp.where(slots == i, jnp.sum(jnp.where(picked, scores, 0.0), axis=1, keepdims=True), weights)
        experts = jnp.where(slots == i, index, experts)
        choice = jnp.where(picked, -jnp.inf, choice)
    if renormalize:
        weights = weights / (jnp.sum(weights, axis=1, keepdims=True) + 1e-20)
    weights_ref[...] = weights * scaling
    experts_ref[...] = experts


def check_router_inputs(logits: Array, correction_bias: Array, k: int) -> None:
    """logits [T, E] and correction_bias [E] agree, and 1 <= k <= E (a ValueError naming them if not)."""
    if logits.ndim != 2 or correction_bias.shape != logits.shape[1:]:
        raise ValueError(f"logits [T, E] = {logits.shape} and correction_bias [E] = {correction_bias.shape} disagree")
    if not 1 <= k <= logits.shape[1]:
        raise ValueError(f"k = {k}: must be between 1 and the {logits.shape[1]} experts")


def padded_router_inputs(logits: Array, correction_bias: Array) -> tuple[Array, Array]:
    """logits [T, E], correction_bias [E] -> float32 logits [T, E'] and bias [1, E'], E' the next power
    of two (Triton's widths): padding lanes get -inf logits, so they are never picked."""
    E = logits.shape[1]
    width = pl.next_power_of_2(E)
    logits = jnp.pad(logits.astype(jnp.float32), ((0, 0), (0, width - E)), constant_values=-jnp.inf)
    return logits, jnp.pad(correction_bias.astype(jnp.float32), (0, width - E))[None]


def expert_ranks(logits: Array, bias: Array) -> tuple[Array, Array]:
    """One token's router logits and correction bias, float32 [E'] (lanes past the experts: -inf logits)
    -> (sigmoid scores [E'], each expert's selection rank [E'] int32: 0 for the largest score + bias), as
    ``select_experts`` orders them."""
    scores, choice = _scores_and_choice(logits, bias)
    width = choice.shape[0]
    mine, theirs = choice[:, None], choice[None, :]  # [i, j]: expert i's choice value, expert j's
    lanes = jax.lax.broadcasted_iota(jnp.int32, (width, width), 0)
    others = jax.lax.broadcasted_iota(jnp.int32, (width, width), 1)
    ahead = (theirs > mine) | ((theirs == mine) & (others < lanes))
    return scores, jnp.sum(ahead.astype(jnp.int32), axis=1)


def slot_expert(rank: Array, slot) -> Array:
    """The expert in selection slot ``slot`` (int32), from ``expert_ranks``' ranks."""
    return jnp.sum(jnp.where(rank == slot, jax.lax.broadcasted_iota(jnp.int32, rank.shape, 0), 0))


def slot_weight(scores: Array, rank: Array, slot, k: int, renormalize: bool, scaling: float) -> Array:
    """Slot ``slot``'s routing weight (float32): its expert's score, renormalized over the k chosen and
    scaled, as ``select_experts``."""
    weight = jnp.sum(jnp.where(rank == slot, scores, 0.0))
    if renormalize:
        weight = weight / (jnp.sum(jnp.where(rank < k, scores, 0.0)) + 1e-20)
    return weight * scaling


@functools.partial(jax.jit, static_argnames=("k", "renormalize", "scaling_factor", "block_logits", "interpret"))
def _select(logits, correction_bias, *, k, renormalize, scaling_factor, block_logits, interpret):
    T = logits.shape[0]
    logits, bias = padded_router_inputs(logits, correction_bias)
    width, slots = logits.shape[1], pl.next_power_of_2(k)
    fit = max(block_logits // width, 1)
    rows = min(1 << (fit.bit_length() - 1), pl.next_power_of_2(T))  # a power of two, as Triton's blocks are
    padded = -(-T // rows) * rows
    logits = jnp.pad(logits, ((0, padded - T), (0, 0)))  # padding tokens pick from zero logits; dropped below
    block = lambda n: pl.BlockSpec((rows, n), lambda t: (t, 0))
    weights, experts = pl.pallas_call(
        functools.partial(_select_kernel, k=k, renormalize=renormalize, scaling=scaling_factor),
        out_shape=(jax.ShapeDtypeStruct((padded, slots), jnp.float32),
                   jax.ShapeDtypeStruct((padded, slots), jnp.int32)),
        grid=(padded // rows,),
        in_specs=[block(width), pl.BlockSpec((1, width), lambda t: (0, 0))],
        out_specs=(block(slots), block(slots)),
        compiler_params=triton_params(4, 1, interpret),
        interpret=interpret,
        name="select_experts",
    )(logits, bias)
    return weights[:T, :k], experts[:T, :k]


def select_experts(logits: Array, correction_bias: Array, k: int, renormalize: bool, scaling_factor: float, *,
                   block_logits: int = SELECT_BLOCK_LOGITS, interpret: bool | None = None) -> tuple[Array, Array]:
    """logits [T, E] (the router's x . gate_weight^T, float32), correction_bias [E] -> (weights
    [T, k] float32, experts [T, k] int32), as ``k3jax.functional.moe.select_experts``; blocks of tokens per
    program: as many as make ``block_logits`` logits (at least one token)."""
    check_router_inputs(logits, correction_bias, k)
    interpret = _platform.interpret() if interpret is None else interpret
    return _select(logits, correction_bias, k=k, renormalize=renormalize, scaling_factor=float(scaling_factor),
                   block_logits=block_logits, interpret=interpret)


__all__ = ["check_router_inputs", "expert_ranks", "padded_router_inputs", "select_experts", "slot_expert",
           "slot_weight"]
