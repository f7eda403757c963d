"""Block AttnRes's mix over depth in one kernel (``k3jax.functional.attn_res.attn_res_mix``).

Each source (the first ``n_blocks`` stored blocks, then the partial sum) gets the score
``rsqrt(mean(x**2) + eps) * (x . query)`` with ``query = norm_weight * proj_weight``; a softmax over
the sources weights the raw sources. XLA runs a mix site as three kernels (the block scores, the
partial's score, the weighted sum), and a decode step has two sites per layer; at one token each
kernel is mostly launch. Here one program per token row reads its sources twice (scores, then the
sum) in power-of-two chunks of D (Triton's block sizes), all in float32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from k3jax.implementation import pallas_interpret
from k3jax.typing import Array


def _mix_kernel(n_ref, blocks_ref, partial_ref, norm_ref, proj_ref, out_ref, weights_ref, *, chunk: int, eps: float):
    """Refs: n_blocks [1] int32; blocks [N, M, D]; partial [M, D]; norm, proj weights [D]; out [M, D]
    float32; weights [M, W] float32 (W >= N + 1 a power of two; slots past N + 1 zero). Program m."""
    m = pl.program_id(0)
    N, _, D = blocks_ref.shape
    steps = D // chunk
    cols = lambda c: pl.ds(pl.multiple_of(c * chunk, chunk), chunk)

    def score(load):
        def step(c, carry):
            x = load(cols(c)).astype(jnp.float32)
            query = norm_ref[cols(c)].astype(jnp.float32) * proj_ref[cols(c)].astype(jnp.float32)
            return carry[0] + jnp.sum(x * x), carry[1] + jnp.sum(x * query)

        squares, dot = jax.lax.fori_loop(0, steps, step, (jnp.float32(0), jnp.float32(0)))
        return dot * jax.lax.rsqrt(squares / D + eps)

    n = n_ref[0]
    scores = [jnp.where(j < n, score(lambda c, j=j: blocks_ref[j, m, c]), -jnp.inf) for j in range(N)]
    scores.append(score(lambda c: partial_ref[m, c]))
    top = functools.reduce(jnp.maximum, scores)
    exps = [jnp.exp(s - top) for s in scores]
    total = functools.reduce(jnp.add, exps)
    weights = [e / total for e in exps]

    def mix(c, carry):
        acc = weights[N] * partial_ref[m, cols(c)].astype(jnp.float32)
        for j in range(N):
            acc = acc + weights[j] * blocks_ref[j, m, cols(c)].astype(jnp.float32)
        out_ref[m, cols(c)] = acc
        return carry

    jax.lax.fori_loop(0, steps, mix, 0)
    slots = jax.lax.broadcasted_iota(jnp.int32, (weights_ref.shape[1],), 0)
    row = jnp.zeros((weights_ref.shape[1],), jnp.float32)
    for j, w in enumerate(weights):
        row = jnp.where(slots == j, w, row)
    weights_ref[m, :] = row


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def _mix(blocks, n_blocks, partial, norm_weight, proj_weight, *, eps, interpret):
    N, M, D = blocks.shape
    slots = pl.next_power_of_2(N + 1)
    out, weights = pl.pallas_call(
        functools.partial(_mix_kernel, chunk=min(D & -D, 1024), eps=eps),  # D & -D: largest power of two dividing D
        out_shape=(jax.ShapeDtypeStruct((M, D), jnp.float32), jax.ShapeDtypeStruct((M, slots), jnp.float32)),
        grid=(M,),
        interpret=interpret,
        name="attn_res_mix",
    )(jnp.reshape(n_blocks, (1,)).astype(jnp.int32), blocks, partial, norm_weight, proj_weight)
    return out, weights[:, : N + 1].T


def attn_res_mix(
    blocks: Array, n_blocks: Array | int, partial: Array, norm_weight: Array, proj_weight: Array, eps: float,
    *, interpret: bool | None = None,
) -> tuple[Array, Array]:
    """Same contract as ``k3jax.functional.attn_res.attn_res_mix``: blocks [N, B, T, D] (rows at or
    beyond ``n_blocks`` ignored), partial [B, T, D], norm_weight, proj_weight [D] -> (out [B, T, D]
    float32, weights [N + 1, B, T] float32)."""
    N, B, T, D = blocks.shape
    if partial.shape != (B, T, D) or norm_weight.shape != (D,) or proj_weight.shape != (D,):
        raise ValueError(f"blocks [N, B, T, D] = {blocks.shape}, partial {partial.shape}, norm_weight "
                         f"{norm_weight.shape} and proj_weight {proj_weight.shape} disagree")
    interpret = pallas_interpret() if interpret is None else interpret
    out, weights = _mix(blocks.reshape(N, B * T, D), jnp.asarray(n_blocks), partial.reshape(B * T, D),
                        norm_weight, proj_weight, eps=float(eps), interpret=interpret)
    return out.reshape(B, T, D), weights.reshape(N + 1, B, T)


__all__ = ["attn_res_mix"]
