"""A decode step's MLA attention over the latent cache in one pass (split over the keys).

In the absorbed form (``k3jax.functional.mla.absorbed_attention``) a decode token's query, absorbed into
the latent (q_lat [H, R] = q_nope W_UK), scores every cached latent and rope key, then weighs the latents:

    s[h, t] = q_lat[h] . c_kv[t] + q_pe[h] . k_pe[t]    (t < length),   o_lat[h] = softmax(scale s[h]) . c_kv

XLA runs it as about ten small kernels that read the cache twice (scores, then the weighted sum) and write
the scores between them. ``latent_attention`` reads each cache row once, for every head at once (the
latent is shared by the heads): program (sequence b, group g of up to 32 heads, split j) walks its share
of the keys in blocks of ``block`` rows with an online softmax (FlashAttention-2's loop, in base 2),
keeping the float32 [heads, R] sum and each head's running maximum and total, and writes its output
normalized over its keys; ``combine_splits`` merges the splits' outputs (one split needs no merge).
Products run on the matrix units in the cache's dtype (q_lat and the unnormalized probabilities are
rounded to it) with float32 accumulation; scores and softmax are float32. The splits give a long cache
(K3's million tokens) many programs; a short one few.

A candidate of issue 4 (``k3jax.layers.mla.DECODE_ATTENTION_KERNEL``), timed by
``benchmarks/decode_variants.py``. Pallas' Triton lowering on GPUs (R and P powers of two from 16, Triton's
dot; the heads padded to a multiple of their group), interpret mode on CPU.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from k3jax.implementation import pallas_interpret
from k3jax.typing import Array
from pallas_kernels._triton import MIN_DOT, dot_width, online_softmax_step, triton_params

_F32 = jnp.float32
BLOCK = 64  # cache rows per loop step
HEAD_BLOCK = 32  # heads per program at most: a float32 [32, 512] sum is 128 registers a thread at 4 warps
TARGET_PROGRAMS = 128  # splits are chosen so that batch x splits reaches about this many programs


def latent_attention_runs(latent: int, rope: int) -> bool:
    """Whether the kernel takes these widths off interpret mode: R and P powers of two from 16 (the heads
    are padded inside, the cache is not)."""
    return dot_width(latent) and dot_width(rope)


def _head_block(heads: int) -> int:
    """Heads per program: a power of two from 16 (Triton's dot) up to ``HEAD_BLOCK``."""
    return min(HEAD_BLOCK, max(MIN_DOT, pl.next_power_of_2(heads)))


def _kernel(lengths_ref, q_ref, qp_ref, c_ref, kp_ref, acc_ref, m_ref, l_ref, *, scale: float, keys: int,
            per_split: int, block: int):
    """Refs: lengths [B] int32; q_lat [hb, R], q_pe [hb, P] (sequence b's head group g); c_kv [B, S, R],
    k_pe [B, S, P] (whole; rows from ``keys`` on are never read); out: split j's output [hb, R] float32
    (normalized over its keys), its maximum m and total l [hb] (base-2 units)."""
    b, j = pl.program_id(0), pl.program_id(2)
    start = j * per_split
    end = jnp.minimum(jnp.minimum(lengths_ref[b], keys), start + per_split)
    dtype = c_ref.dtype
    q, qp = q_ref[...].astype(dtype), qp_ref[...].astype(dtype)
    log2_scale = scale * math.log2(math.e)

    def rows(ref, row0, width):
        valid = row0 + jax.lax.broadcasted_iota(jnp.int32, (block, width), 0) < end
        tile = pltriton.load(ref.at[pl.ds(b, 1), pl.ds(row0, block), pl.ds(0, width)], mask=valid[None], other=0)
        return tile.reshape(block, width)

    def step(i, carry):
        acc, m, l = carry
        row0 = start + i * block
        c, kp = rows(c_ref, row0, c_ref.shape[2]), rows(kp_ref, row0, kp_ref.shape[2])
        s = (jnp.dot(q, c.T, preferred_element_type=_F32) + jnp.dot(qp, kp.T, preferred_element_type=_F32)) * log2_scale
        key = row0 + jax.lax.broadcasted_iota(jnp.int32, (1, block), 1)
        s = jnp.where(key < end, s, -jnp.inf)  # every step holds a visible key, so the maximum stays finite
        return online_softmax_step(acc, m, l, s, c)

    heads, width = acc_ref.shape
    carry = (jnp.zeros((heads, width), _F32), jnp.full((heads,), -jnp.inf, _F32), jnp.zeros((heads,), _F32))
    steps = jax.lax.div(jnp.maximum(end - start, 0) + block - 1, block)
    acc, m, l = jax.lax.fori_loop(0, steps, step, carry)
    acc_ref[...] = jnp.where(l[:, None] > 0, acc / l[:, None], 0.0)  # a split past the sequence sees no key
    m_ref[...], l_ref[...] = m, l


@functools.partial(jax.jit, static_argnames=("scale", "keys", "splits", "block", "warps", "interpret"))
def _latent_attention(q_lat, q_pe, c_kv, k_pe, lengths, *, scale: float, keys: int, splits: int, block: int,
                      warps: int, interpret: bool):
    B, Hp, R = q_lat.shape
    P = k_pe.shape[2]
    hb = _head_block(Hp)
    per_split = pl.cdiv(pl.cdiv(keys, splits), block) * block
    query = lambda d: pl.BlockSpec((None, hb, d), lambda b, g, j: (b, g, 0))
    per_split_out = lambda *d: pl.BlockSpec((None, None, hb, *d), lambda b, g, j: (b, j, g, *(0 for _ in d)))
    whole = pl.BlockSpec()
    return pl.pallas_call(
        functools.partial(_kernel, scale=scale, keys=keys, per_split=per_split, block=block),
        out_shape=(jax.ShapeDtypeStruct((B, splits, Hp, R), _F32), jax.ShapeDtypeStruct((B, splits, Hp), _F32),
                   jax.ShapeDtypeStruct((B, splits, Hp), _F32)),
        grid=(B, Hp // hb, splits),
        in_specs=[whole, query(R), query(P), whole, whole],
        out_specs=(per_split_out(R), per_split_out(), per_split_out()),
        compiler_params=triton_params(warps, 2, interpret),
        interpret=interpret,
        name="latent_attention",
    )(lengths, q_lat, q_pe, c_kv, k_pe)


def combine_splits(out: Array, m: Array, l: Array) -> Array:
    """The splits' outputs out [B, J, H, R] (each normalized over its own keys), maxima m and totals l
    [B, J, H] (base 2) -> the output over all keys [B, H, R] float32: each split weighs 2^(m - max) l. A
    split with no visible key (m = -inf, l = 0) weighs 0."""
    weight = jnp.where(jnp.isneginf(m), 0.0, jnp.exp2(m - jnp.max(m, axis=1, keepdims=True))) * l
    return jnp.sum(weight[..., None] * out, axis=1) / jnp.sum(weight, axis=1)[..., None]


def default_splits(batch: int, keys: int, block: int = BLOCK) -> int:
    """Splits per sequence: about ``TARGET_PROGRAMS`` programs in all, at least one block of keys each."""
    return max(1, min(pl.cdiv(keys, block), pl.cdiv(TARGET_PROGRAMS, batch)))


def latent_attention(q_lat: Array, q_pe: Array, c_kv: Array, k_pe: Array, lengths: Array, scale: float, *,
                     window: int | None = None, splits: int | None = None, block: int = BLOCK, warps: int = 4,
                     interpret: bool | None = None) -> Array:
    """One query per sequence: q_lat [B, H, R] (q_nope absorbed through W_UK), q_pe [B, H, P], the cache's
    c_kv [B, S, R] (after kv_a_layernorm) and k_pe [B, S, P], lengths [B] (sequence b sees cache rows
    t < lengths[b]; at least 1) -> o_lat [B, H, R] float32 (before W_UV). Products in c_kv's dtype.
    ``window`` (static): only the first ``window`` rows are read (the cache is not sliced, so not copied);
    None reads all S. ``splits`` (default ``default_splits``) divides each sequence's keys between
    programs; ``block``: cache rows per step (a power of two from 16)."""
    B, H, R = q_lat.shape
    S, P = c_kv.shape[1], k_pe.shape[-1]
    expected = {"q_pe": (q_pe.shape, (B, H, P)), "c_kv": (c_kv.shape, (B, S, R)), "k_pe": (k_pe.shape, (B, S, P)),
                "lengths": (lengths.shape, (B,))}
    wrong = {name: got for name, (got, want) in expected.items() if tuple(got) != want}
    if wrong:
        raise ValueError(f"latent_attention: shapes disagree with q_lat [B, H, R] = {list(q_lat.shape)}, c_kv's "
                         f"S = {S} and k_pe's P = {P}: {wrong}")
    keys = S if window is None else min(window, S)
    if keys < 1 or not dot_width(block):
        raise ValueError(f"latent_attention: needs cache rows to read (S = {S}, window = {window}) and a block "
                         f"that is a power of two >= {MIN_DOT} (got {block})")
    interpret = pallas_interpret() if interpret is None else interpret
    if not interpret and not latent_attention_runs(R, P):
        raise ValueError(f"latent_attention: R = {R} and P = {P} must be powers of two >= {MIN_DOT} on a GPU")
    splits = default_splits(B, keys, block) if splits is None else splits
    Hp = pl.cdiv(H, _head_block(H)) * _head_block(H)
    pad = lambda a: jnp.pad(a, ((0, 0), (0, Hp - H), (0, 0))) if Hp > H else a
    acc, m, l = _latent_attention(pad(q_lat), pad(q_pe), c_kv, k_pe, lengths.astype(jnp.int32), scale=float(scale),
                                  keys=keys, splits=int(splits), block=block, warps=warps, interpret=bool(interpret))
    return (acc[:, 0] if splits == 1 else combine_splits(acc, m, l))[:, :H]


__all__ = ["BLOCK", "HEAD_BLOCK", "TARGET_PROGRAMS", "combine_splits", "default_splits", "latent_attention",
           "latent_attention_runs"]
