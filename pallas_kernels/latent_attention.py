"""MLA's decode attention over the latent cache, between its two absorbed products, as one kernel.

``latent_attention(q_lat, q_pe, c_kv, k_pe, positions, scale)`` is the middle of
``k3jax.functional.mla.absorbed_attention`` for one new token per sequence: with the query already
absorbed into the latent (q_lat = q_nope W_UK, [B, H, R]) it returns

    o_lat[b, h] = softmax_s(scale (q_lat[b, h] . c_kv[b, s] + q_pe[b, h] . k_pe[b, s])) c_kv[b, s]

over the keys s <= positions[b] (and s < ``keys``), float32 [B, H, R]; W_UV's product follows in the
caller. XLA runs this part of a decode step as six kernels (the score product, the mask, the softmax's
maximum and total, the normalization and the value product).

The heads are the query rows of a flash-attention program (MLA's latent keys and values are shared by
every head, as in multi-query attention): one program per (block of ``block_h`` heads, split of
``split_keys`` keys, sequence; a split's head blocks launch side by side, so all but the first can read its
keys from L2) walks its keys up to the sequence's position in blocks of ``block_k``, products on
the matrix units in the cache's dtype with float32 accumulation (q_lat and q_pe rounded to it, as the
reference rounds its operands), the softmax online in base 2 (``online_softmax_step``), its
probabilities rounded to the cache's dtype for the value product before their normalization (the
reference rounds them after it: outputs agree to about a rounding of the cache's dtype). With one split
the program writes o_lat; with several, each writes its partial sum, maximum and total, and XLA merges
them (flash decoding), so a long cache spreads over the SMs. The cache is read in place: ``keys`` bounds
it without a slice (no copy of the cache). Pallas' Triton lowering on GPUs, interpret mode on CPU; on a
GPU the widths R and P must be powers of two from 16 (``latent_attention_runs``).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from k3jax.implementation import pallas_interpret
from k3jax.typing import Array
from pallas_kernels._triton import MIN_DOT, check_dot_widths, dot_width, online_softmax_step, triton_params

_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class LatentBlocks:
    """block_h heads per program (the products' query rows), block_k keys per loop step (powers of two
    from 16), split_keys keys per program (a multiple of block_k); Triton's num_warps and num_stages.
    Unmeasured defaults: 8 warps hold a [block_k, 512] cache tile and a [block_h, 512] float32 sum."""

    block_h: int = 16
    block_k: int = 32
    split_keys: int = 2048
    num_warps: int = 8
    num_stages: int = 2

    def __post_init__(self):
        check_dot_widths(self, "block_h", "block_k")
        if self.split_keys < self.block_k or self.split_keys % self.block_k:
            raise ValueError(f"LatentBlocks.split_keys must be a multiple of block_k = {self.block_k}, got "
                             f"{self.split_keys}")


def _kernel(positions_ref, q_ref, qp_ref, c_ref, kp_ref, *out_refs, scale_log2: float, keys: int, block_h: int,
            block_k: int, split_keys: int):
    """Refs: positions [B] int32; q_lat [B, H, R], q_pe [B, H, P] in the cache's dtype; c_kv [B, S, R],
    k_pe [B, S, P]; then o_lat [B, H, R] float32 (one split), or the partial sums [B, n, H, R], maxima and
    totals [B, n, H] (n splits; the maxima in log2 units). A split past the position writes a zero sum, a
    -inf maximum and a zero total. Every key block a program walks holds a visible key (its first), so no
    row's maximum stays -inf once a block is done."""
    block, split, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    H = q_ref.shape[1]
    heads = pl.ds(block * block_h, block_h)
    head_mask = block * block_h + jax.lax.broadcasted_iota(jnp.int32, (block_h,), 0) < H
    load_rows = lambda ref: pltriton.load(ref.at[pl.ds(b, 1), heads, :], mask=head_mask[None, :, None],
                                          other=0).reshape(block_h, ref.shape[2])
    q, qp = load_rows(q_ref), load_rows(qp_ref)
    start = split * split_keys
    end = jnp.minimum(jnp.minimum(positions_ref[b] + 1, keys), start + split_keys)
    steps = jax.lax.div(jnp.maximum(end - start, 0) + block_k - 1, block_k)

    def step(j, carry):
        first = start + j * block_k
        key = first + jax.lax.broadcasted_iota(jnp.int32, (block_k,), 0)
        seen = key < end
        load_keys = lambda ref: pltriton.load(ref.at[pl.ds(b, 1), pl.ds(first, block_k), :],
                                              mask=seen[None, :, None], other=0).reshape(block_k, ref.shape[2])
        c, kp = load_keys(c_ref), load_keys(kp_ref)
        s = (jnp.dot(q, c.T, preferred_element_type=_F32) + jnp.dot(qp, kp.T, preferred_element_type=_F32))
        s = jnp.where(seen[None, :], s * scale_log2, -jnp.inf)
        return online_softmax_step(*carry, s, c)

    R = c_ref.shape[2]
    carry = (jnp.zeros((block_h, R), _F32), jnp.full((block_h,), -jnp.inf, _F32), jnp.zeros((block_h,), _F32))
    acc, m, l = jax.lax.fori_loop(0, steps, step, carry)
    if len(out_refs) == 1:
        pltriton.store(out_refs[0].at[pl.ds(b, 1), heads, :], (acc / l[:, None])[None], mask=head_mask[None, :, None])
        return
    sum_ref, max_ref, total_ref = out_refs
    at = (pl.ds(b, 1), pl.ds(split, 1), heads)
    pltriton.store(sum_ref.at[(*at, slice(None))], acc[None, None], mask=head_mask[None, None, :, None])
    pltriton.store(max_ref.at[at], m[None, None], mask=head_mask[None, None, :])
    pltriton.store(total_ref.at[at], l[None, None], mask=head_mask[None, None, :])


@functools.partial(jax.jit, static_argnames=("scale", "keys", "blocks", "interpret"))
def _latent_attention(q_lat, q_pe, c_kv, k_pe, positions, *, scale: float, keys: int, blocks: LatentBlocks,
                      interpret: bool):
    B, H, R = q_lat.shape
    splits = -(-keys // blocks.split_keys)
    kernel = functools.partial(_kernel, scale_log2=scale * math.log2(math.e), keys=keys, block_h=blocks.block_h,
                               block_k=blocks.block_k, split_keys=blocks.split_keys)
    partial = [jax.ShapeDtypeStruct((B, splits, H, R), _F32), jax.ShapeDtypeStruct((B, splits, H), _F32),
               jax.ShapeDtypeStruct((B, splits, H), _F32)]
    outs = pl.pallas_call(
        kernel,
        out_shape=[jax.ShapeDtypeStruct((B, H, R), _F32)] if splits == 1 else partial,
        grid=(-(-H // blocks.block_h), splits, B),  # axis 0 launches fastest: a split's head blocks side by side
        compiler_params=triton_params(blocks.num_warps, blocks.num_stages, interpret),
        interpret=interpret,
        name="latent_attention",
    )(positions, q_lat.astype(c_kv.dtype), q_pe.astype(c_kv.dtype), c_kv, k_pe)
    if splits == 1:
        return outs[0]
    sums, maxima, totals = outs
    weight = jnp.exp2(maxima - jnp.max(maxima, axis=1, keepdims=True))  # [B, n, H]; split 0 always sees key 0
    return jnp.einsum("bnh,bnhr->bhr", weight, sums) / jnp.sum(weight * totals, axis=1)[..., None]


def latent_attention_runs(latent: int, rope: int) -> bool:
    """Whether the widths R and P suit the kernel off interpret mode: powers of two >= 16."""
    return dot_width(latent) and dot_width(rope)


def latent_attention(q_lat: Array, q_pe: Array, c_kv: Array, k_pe: Array, positions: Array, scale: float, *,
                     keys: int | None = None, blocks: LatentBlocks = LatentBlocks(),
                     interpret: bool | None = None) -> Array:
    """q_lat [B, H, R] (float32, the absorbed query), q_pe [B, H, P], the cache c_kv [B, S, R] (after
    kv_a_layernorm) and k_pe [B, S, P], positions [B] integer (each new token's position, >= 0) -> o_lat
    float32 [B, H, R]: head h of sequence b attends the keys s <= positions[b], s < keys (static, at most S;
    default S). The products run in the cache's dtype."""
    B, H, R = q_lat.shape if q_lat.ndim == 3 else (None,) * 3
    if B is None:
        raise ValueError(f"latent_attention: q_lat must be [B, H, R], got {list(q_lat.shape)}")
    S, P = c_kv.shape[1] if c_kv.ndim == 3 else None, q_pe.shape[-1]
    expected = {"q_pe": (q_pe, (B, H, P)), "c_kv": (c_kv, (B, S, R)), "k_pe": (k_pe, (B, S, P)),
                "positions": (positions, (B,))}
    for name, (a, shape) in expected.items():
        if a.shape != shape:
            raise ValueError(f"latent_attention: {name} must be {list(shape)} (from q_lat {list(q_lat.shape)}, "
                             f"q_pe's P = {P}, c_kv's S), got {list(a.shape)}")
    if not jnp.issubdtype(positions.dtype, jnp.integer):
        raise ValueError(f"latent_attention: positions must be integers, got {positions.dtype}")
    keys = S if keys is None else int(keys)
    if not 1 <= keys <= S:
        raise ValueError(f"latent_attention: keys must be in [1, S = {S}], got {keys}")
    interpret = pallas_interpret() if interpret is None else interpret
    if not interpret and not latent_attention_runs(R, P):
        raise ValueError(f"latent_attention: widths (latent {R}, rope {P}) must be powers of two >= {MIN_DOT} on a GPU")
    return _latent_attention(q_lat, q_pe, c_kv, k_pe, positions.astype(jnp.int32), scale=float(scale), keys=keys,
                             blocks=blocks, interpret=bool(interpret))


__all__ = ["LatentBlocks", "latent_attention", "latent_attention_runs"]
