"""Causal attention of a prefill chunk over MLA's expanded keys, as one flash-attention kernel.

A prefill chunk of T new tokens attends every cached position at or before its own. In the
absorbed form (``k3jax.functional.mla.absorbed_attention``, what a decode step runs) that costs a
512-wide latent product per (query, key, head) twice and materializes float32 scores [B, H, T, S];
for T in the thousands the expanded form is cheaper: the cache's latents are expanded once per
chunk into per-head keys and values (``mla_expand``), and this kernel runs causal softmax attention
over them without materializing scores (online softmax, FlashAttention-2's loop over key blocks).

``prefill_attention(q_nope, q_pe, k_nope, k_pe, v, positions, scale)``: query t of sequence b sits at
``positions[b, t]`` and sees keys s <= positions[b, t] (and s < S). Scores are
``q_nope . k_nope + q_pe . k_pe`` with the rotary-free key part ``k_pe`` [B, S, P] shared by all heads
(MLA's), so it is read per key block, never broadcast over heads. Products run on the matrix units in
the inputs' dtype with float32 accumulation; scores, softmax and output are float32, probabilities
are rounded to v's dtype for the second product (as ``causal_attention`` does).

One program per (block of ``block_q`` queries, sequence, head) walks the key blocks up to its last
query's position, masking only the blocks past its first query's; the longest programs start first.
Pallas' Triton lowering on GPUs, interpret mode on CPU. On a GPU the head widths must be powers of
two from 16 (Triton's dot); ``prefill_attention_runs`` says whether they are.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _platform
from k3jax.typing import Array
from pallas_kernels._triton import MIN_DOT, check_dot_widths, dot_width, online_softmax_step, triton_params

_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class AttentionBlocks:
    """block_q queries per program, block_k keys per loop step (powers of two from 16); Triton's
    num_warps and num_stages. Default: the best of six at `mini`'s shapes on the H200, 2048 queries
    over 2048 and 8192 keys (benchmarks/HISTORY.md, 2026-12-01)."""

    block_q: int = 128
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        check_dot_widths(self, "block_q", "block_k")


def _kernel(positions_ref, qn_ref, qp_ref, kn_ref, kp_ref, v_ref, o_ref, *, scale: float, keys: int,
            block_k: int):
    """Refs: positions [bq] int32; q_nope [bq, N], q_pe [bq, P]; k_nope [Sp, N], k_pe [Sp, P], v [Sp, V]
    (the program's sequence and head; Sp the keys padded to block_k); o [bq, V] float32. The key blocks
    that every query of the program sees in full run unmasked, then the blocks up to the last query's
    position masked. Key 0 is visible to every query (positions >= 0), so no row's maximum stays -inf."""
    pos = positions_ref[...]
    qn, qp = qn_ref[...], qp_ref[...]
    log2_scale = scale * math.log2(math.e)  # exp2 of scores in base 2
    unmasked = jax.lax.div(jnp.minimum(jnp.min(pos) + 1, keys), block_k)
    end = jax.lax.div(jnp.minimum(jnp.max(pos) + 1, keys) + block_k - 1, block_k)

    def step(j, carry, masked: bool):
        acc, m, l = carry
        rows = pl.ds(j * block_k, block_k)
        s = (jnp.dot(qn, kn_ref[rows, :].T, preferred_element_type=_F32)
             + jnp.dot(qp, kp_ref[rows, :].T, preferred_element_type=_F32)) * log2_scale
        if masked:
            key = j * block_k + jax.lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
            s = jnp.where((key <= pos[:, None]) & (key < keys), s, -jnp.inf)
        return online_softmax_step(acc, m, l, s, v_ref[rows, :])

    bq, width = o_ref.shape
    carry = (jnp.zeros((bq, width), _F32), jnp.full((bq,), -jnp.inf, _F32), jnp.zeros((bq,), _F32))
    carry = jax.lax.fori_loop(0, unmasked, functools.partial(step, masked=False), carry)
    acc, _, l = jax.lax.fori_loop(unmasked, end, functools.partial(step, masked=True), carry)
    o_ref[...] = acc / l[:, None]


@functools.partial(jax.jit, static_argnames=("scale", "keys", "blocks", "interpret"))
def _prefill_attention(q_nope, q_pe, k_nope, k_pe, v, positions, *, scale: float, keys: int,
                       blocks: AttentionBlocks, interpret: bool):
    B, Tp, H, N = q_nope.shape
    Sp, P, V = k_nope.shape[1], q_pe.shape[3], v.shape[3]
    bq = blocks.block_q
    blocks_q = Tp // bq
    # heads vary fastest and query blocks run last first: the first programs to start are the longest
    query = lambda d: pl.BlockSpec((None, bq, None, d), lambda h, b, i: (b, blocks_q - 1 - i, h, 0))
    key = lambda d: pl.BlockSpec((None, Sp, None, d), lambda h, b, i: (b, 0, h, 0))
    compiler_params = triton_params(blocks.num_warps, blocks.num_stages, interpret)
    return pl.pallas_call(
        functools.partial(_kernel, scale=scale, keys=keys, block_k=blocks.block_k),
        out_shape=jax.ShapeDtypeStruct((B, Tp, H, V), _F32),
        grid=(H, B, blocks_q),
        in_specs=[pl.BlockSpec((None, bq), lambda h, b, i: (b, blocks_q - 1 - i)), query(N), query(P), key(N),
                  pl.BlockSpec((None, Sp, P), lambda h, b, i: (b, 0, 0)), key(V)],
        out_specs=query(V),
        compiler_params=compiler_params,
        interpret=interpret,
        name="prefill_attention",
    )(positions, q_nope, q_pe, k_nope, k_pe, v)


def _pad(a: Array, axis: int, size: int, mode: str = "constant") -> Array:
    pad = [(0, 0)] * a.ndim
    pad[axis] = (0, size - a.shape[axis])
    return jnp.pad(a, pad, mode=mode)


def prefill_attention_runs(*widths: int) -> bool:
    """Whether head widths (nope, rope, value) suit the kernel off interpret mode: powers of two >= 16."""
    return all(map(dot_width, widths))


def prefill_attention(q_nope: Array, q_pe: Array, k_nope: Array, k_pe: Array, v: Array, positions: Array,
                      scale: float, *, blocks: AttentionBlocks = AttentionBlocks(),
                      interpret: bool | None = None) -> Array:
    """q_nope [B, T, H, N], q_pe [B, T, H, P], k_nope [B, S, H, N], k_pe [B, S, P] (shared by the
    heads), v [B, S, H, V], positions [B, T] integer (each query's position, >= 0) -> float32
    [B, T, H, V]: query t of sequence b attends keys s <= positions[b, t], s < S. block_q shrinks to
    T's next power of two (from 16); T and S are padded to the blocks inside."""
    B, T, H, N = q_nope.shape
    S = k_nope.shape[1]
    P, V = q_pe.shape[-1], v.shape[-1]
    expected = {"q_pe": (q_pe, (B, T, H, P)), "k_nope": (k_nope, (B, S, H, N)), "k_pe": (k_pe, (B, S, P)),
                "v": (v, (B, S, H, V)), "positions": (positions, (B, T))}
    for name, (a, shape) in expected.items():
        if a.shape != shape:
            raise ValueError(f"prefill_attention: {name} must be {list(shape)} (from q_nope {list(q_nope.shape)}, "
                             f"k_nope's S = {S}, q_pe's P = {P}, v's V = {V}), got {list(a.shape)}")
    if not jnp.issubdtype(positions.dtype, jnp.integer):
        raise ValueError(f"prefill_attention: positions must be integers, got {positions.dtype}")
    if T == 0 or S == 0:
        raise ValueError(f"prefill_attention: needs at least one query and one key, got T = {T}, S = {S}")
    interpret = _platform.interpret() if interpret is None else interpret
    if not interpret and not prefill_attention_runs(N, P, V):
        raise ValueError(f"prefill_attention: head widths (nope {N}, rope {P}, value {V}) must be powers of two "
                         f">= {MIN_DOT} on a GPU")
    bq = min(blocks.block_q, max(MIN_DOT, pl.next_power_of_2(T)))
    blocks = dataclasses.replace(blocks, block_q=bq)
    Tp, Sp = -(-T // bq) * bq, -(-S // blocks.block_k) * blocks.block_k
    q_nope, q_pe = _pad(q_nope, 1, Tp), _pad(q_pe, 1, Tp)
    positions = _pad(positions.astype(jnp.int32), 1, Tp, mode="edge")
    k_nope, k_pe, v = _pad(k_nope, 1, Sp), _pad(k_pe, 1, Sp), _pad(v, 1, Sp)
    out = _prefill_attention(q_nope, q_pe, k_nope, k_pe, v, positions, scale=float(scale), keys=S, blocks=blocks,
                             interpret=bool(interpret))
    return out[:, :T]


__all__ = ["AttentionBlocks", "prefill_attention", "prefill_attention_runs"]
