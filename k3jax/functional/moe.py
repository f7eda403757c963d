"""Router, expert activations and the two MoE dispatches (spec section 5).

Routed expert weights use the PyTorch layout: w1 (gate) and w3 (up) [E, F, R], w2 (down) [E, R, F],
where R is the width the experts read (the 3584 latent for K3, the model width for Kimi Linear).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from k3jax.mx import MXTensor
from k3jax.typing import Array

_HI = jax.lax.Precision.HIGHEST
Activation = Callable[[Array, Array], Array]
_GROUPED = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0]
)


def expert_order(experts: Array) -> Array:
    """experts int [P] -> int32 [P]: the pairs' stable order by expert (``jnp.argsort`` with ``stable=True``).
    The keys stay int32: uint8 / uint16 keys (which XLA sorts by CUB's radix sort on Hopper) measured no
    faster in `mini`'s 8K prefill and 6% slower in its B=64 decode step (benchmarks/HISTORY.md,
    2026-12-02)."""
    return jnp.argsort(experts, stable=True).astype(jnp.int32)


def select_experts(
    logits: Array, correction_bias: Array, k: int, renormalize: bool, scaling_factor: float
) -> tuple[Array, Array]:
    """The sigmoid router's noaux_tc selection: the bias picks experts but does not weight them.

    logits [T, E], correction_bias [E]. Returns (weights [T, k] float32, experts [T, k] int32).
    """
    scores = jax.nn.sigmoid(logits)
    _, experts = jax.lax.top_k(scores + correction_bias.astype(jnp.float32), k)
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if renormalize:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return weights * scaling_factor, experts.astype(jnp.int32)


def situ(a: Array, b: Array, beta: float = 4.0, linear_beta: float = 25.0) -> Array:
    """SiTU(a, b) = [beta tanh(a/beta) sigmoid(a)] * [linear_beta tanh(b/linear_beta)], float32 inside."""
    a32, b32 = a.astype(jnp.float32), b.astype(jnp.float32)
    out = beta * jnp.tanh(a32 / beta) * jax.nn.sigmoid(a32) * (linear_beta * jnp.tanh(b32 / linear_beta))
    return out.astype(a.dtype)


def swiglu(a: Array, b: Array) -> Array:
    """SwiGLU(a, b) = silu(a) * b."""
    return jax.nn.silu(a) * b


def grouped_matmul(x: Array, w: Array, group_sizes: Array) -> Array:
    """Rows of x sorted by group times their group's weight: x [M, K], w [G, N, K] -> [M, N]."""
    return jax.lax.ragged_dot_general(x, w.astype(x.dtype), group_sizes, _GROUPED, precision=_HI)


def moe_dense(
    x: Array, w1: Array, w3: Array, w2: Array, weights: Array, experts: Array, act: Activation
) -> Array:
    """Reference dispatch: every expert on every token, combined by a dense [T, E] weight matrix.

    x [T, R]; weights, experts [T, k]. Returns [T, R] in x.dtype.
    """
    T, E = x.shape[0], w1.shape[0]
    combine = jnp.zeros((T, E), jnp.float32).at[jnp.arange(T)[:, None], experts].add(weights)
    h = act(jnp.einsum("tr,efr->tef", x, w1, precision=_HI), jnp.einsum("tr,efr->tef", x, w3, precision=_HI))
    y = jnp.einsum("tef,erf->ter", h, w2, precision=_HI)
    return jnp.einsum("te,ter->tr", combine, y.astype(jnp.float32), precision=_HI).astype(x.dtype)


def moe_sorted(
    x: Array, w1: Array, w3: Array, w2: Array, weights: Array, experts: Array, act: Activation,
    matmul: Callable[[Array, Array, Array], Array] = grouped_matmul,
) -> Array:
    """Sorted dispatch: token copies sorted by expert, grouped matmuls, each token's k weighted outputs gathered back
    and summed in pair order (no scatter-add, whose atomics sum in varying order on a GPU: a call repeats bitwise).

    Same contract as ``moe_dense``; ``matmul(x_sorted, w, group_sizes)`` does the grouped products
    (``jax.lax.ragged_dot`` by default; an MX kernel on the Pallas path; rows past the groups must come
    out zero). Experts that receive no tokens are empty groups; pairs whose expert is E or more sort past
    the last group and add nothing (expert parallelism's pairs for other devices, ``k3jax.sharding``).
    """
    T, k = experts.shape
    E = w1.shape[0]
    flat = experts.reshape(-1)  # [T*k]
    order = expert_order(flat)
    token = order // k
    group_sizes = jnp.bincount(flat, length=E).astype(jnp.int32)
    xs = x[token]  # [T*k, R]
    h = act(matmul(xs, w1, group_sizes), matmul(xs, w3, group_sizes))
    y = matmul(h, w2, group_sizes).astype(jnp.float32) * weights.reshape(-1)[order][:, None]
    slot = jnp.zeros_like(order).at[order].set(jnp.arange(T * k, dtype=order.dtype), unique_indices=True)
    return jnp.sum(y[slot].reshape(T, k, -1), axis=1).astype(x.dtype)


def stored_grouped_matmul(x: Array, w: "Array | MXTensor", group_sizes: Array) -> Array:
    """``grouped_matmul`` of a stack as stored: an MXFP4 ``MXTensor`` decoded to x's dtype first."""
    return grouped_matmul(x, w.decode(x.dtype) if isinstance(w, MXTensor) else w, group_sizes)


def routed_experts(
    x: Array, logits: Array, correction_bias: Array, w1, w3, w2, act: Activation, k: int, renormalize: bool,
    scaling_factor: float, dispatch: str = "sorted",
) -> Array:
    """The routed experts' weighted sum for x [T, R] from the router's logits [T, E] (``select_experts``):
    the sorted dispatch (``moe_sorted``) or, with ``dispatch="dense"``, every expert on every token
    (``moe_dense``). Stacks w1, w3 [E, F, R], w2 [E, R, F] are arrays or MXFP4 ``MXTensor`` (decoded to x's
    dtype). Returns [T, R] in x's dtype."""
    weights, experts = select_experts(logits, correction_bias, k, renormalize, scaling_factor)
    if dispatch == "sorted":
        return moe_sorted(x, w1, w3, w2, weights, experts, act, matmul=stored_grouped_matmul)
    if dispatch != "dense":
        raise ValueError(f"dispatch: {dispatch!r}; expected 'sorted' or 'dense'")
    w1, w3, w2 = (w.decode(x.dtype) if isinstance(w, MXTensor) else w for w in (w1, w3, w2))
    return moe_dense(x, w1, w3, w2, weights, experts, act)


__all__ = ["routed_experts", "stored_grouped_matmul", "expert_order", "select_experts", "situ", "swiglu", "grouped_matmul", "moe_dense", "moe_sorted"]
