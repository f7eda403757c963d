"""MLA's absorbed attention core for a few query tokens (decode), all heads of a sequence in one kernel.

``decode_latent_attention(q_lat, q_pe, c_kv, k_pe, pos, scale)`` is
``k3jax.functional.mla.latent_attention``: per sequence b, query token t and head h,
scores = (q_lat . c_kv + q_pe . k_pe) * scale over the cache positions s <= pos[b, t], softmax, and
o_lat = p c_kv [B, T, H, R] float32. The projections around it (q_lat = q_nope W_UK before, o = o_lat
W_UV after) stay XLA einsums: they read kv_b, which is wide work for the whole chip.

Design: one program per (sequence, query token, split of the cache) holds ALL H heads as the rows of
the matrix-unit operand: each step loads one block of ``block_s`` cache positions ([block_s, R] of
c_kv and [block_s, P] of k_pe) once for every head, scores it as [H, R] x [R, block_s] plus
[H, P] x [P, block_s] (``jax.lax.dot_general`` -> ``tl.dot``), and folds it into an online
(running max) softmax and the [H, R] float32 accumulator p c_kv (flash-decoding). The loop stops at
the sequence's last visible position (its bound comes from pos), so a short sequence in a long cache
reads only its own part. With ``splits`` > 1 each split of the cache writes its normalized output,
running max and sum, and XLA combines the splits (``combine_splits``, a few tiny ops); the automatic
count keeps one split for short caches (no combine), more for long ones.

Arithmetic as the reference's: matmul operands (q_lat, q_pe, the caches, the probabilities) in the
cache's dtype (bf16 caches run on the matrix units), scores, softmax and accumulation in float32
(float32 caches: full float32 products, ``Precision.HIGHEST``). The probabilities rounded are
exp(s - running max) rather than the normalized softmax, so bf16 results differ from the reference
by bf16 rounding.

Widths: heads padded to at least 16 rows, R and P to powers of two of at least 16 (Triton's dot
minimum; padding is masked loads, never read from memory); S any size. On GPU the kernel lowers
through Pallas' Triton backend; on CPU it runs in interpret mode
(``k3jax.implementation.pallas_interpret``).

Unmeasured on the GPU: it is correct on the CPU (interpret mode) and its CUDA lowering traces; the
lead times it in the whole decode step (``benchmarks/decode_variants.py``, "MLA attention by XLA").
The one-kernel attempt before it (RESULTS.md, "Sixth session: MLA absorbed decode kernel") ran one
program per head and re-read every cache block once per head; this one reads each block once.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from k3jax.implementation import pallas_interpret
from k3jax.typing import Array

DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
MIN_DOT = 16  # Triton's smallest dot dimension
TARGET_PROGRAMS = 128  # programs the automatic split count aims for (about one per H200 multiprocessor)
MIN_SPLIT = 512  # fewest cache positions per split, for the automatic split count
_F32 = jnp.float32
_HI = jax.lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class AttentionBlocks:
    """block_s: cache positions per step (a power of two, at least 16); splits: programs per (sequence,
    query token) over the cache, None for ``auto_splits``; num_warps, num_stages: Triton launch and
    pipelining depth (ignored in interpret mode)."""

    block_s: int = 32
    splits: int | None = None
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        if self.block_s < MIN_DOT or self.block_s & (self.block_s - 1):
            raise ValueError(f"AttentionBlocks.block_s = {self.block_s}: must be a power of two >= {MIN_DOT}")
        if self.splits is not None and self.splits < 1:
            raise ValueError(f"AttentionBlocks.splits = {self.splits}: must be >= 1")


DEFAULT_BLOCKS = AttentionBlocks()  # read at each call: a benchmark may set other blocks before tracing


def auto_splits(programs: int, window: int) -> int:
    """Splits per (sequence, query token) for ``programs`` of them over ``window`` cache positions:
    enough programs to fill the GPU (TARGET_PROGRAMS), each split at least MIN_SPLIT positions."""
    return max(1, min(pl.cdiv(window, MIN_SPLIT), pl.cdiv(TARGET_PROGRAMS, programs)))


def _padded(n: int) -> int:
    """A block width holding n: a power of two, at least Triton's smallest dot dimension."""
    return max(MIN_DOT, pl.next_power_of_2(n))


def _contract_last(a: Array, b: Array) -> Array:
    """a [M, K] . b [N, K] -> [M, N] float32 (``tl.dot`` with b transposed)."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=_HI, preferred_element_type=_F32)


def _attention_kernel(pos_ref, q_lat_ref, q_pe_ref, c_kv_ref, k_pe_ref, o_ref, *stat_refs, scale: float,
                      window: int, chunk: int, block_s: int, dtype):
    """Refs: pos [B * T] int32, q_lat [B, T, H, R], q_pe [B, T, H, P], c_kv [B, S, R], k_pe [B, S, P];
    outputs: o [B, T, splits, H, R] float32 (this split's normalized output) and, with more than one
    split, m and l [B, T, splits, H] float32 (its running max and sum of exp(score - max); -inf and 0
    where the split holds no visible position)."""
    b, t, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    T, H, R = q_lat_ref.shape[1:]
    P = q_pe_ref.shape[3]
    rows, width, rope = _padded(H), _padded(R), _padded(P)
    row_ok = jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0) < H
    lanes = lambda n: jax.lax.broadcasted_iota(jnp.int32, (1, n), 1)
    r_ok, p_ok = lanes(width) < R, lanes(rope) < P

    def load(ref, mask, padded: bool):
        return pltriton.load(ref, mask=mask, other=0) if padded else pltriton.load(ref)

    q_mask = row_ok & r_ok
    q = load(q_lat_ref.at[b, t, pl.ds(0, rows), pl.ds(0, width)], q_mask, (rows, width) != (H, R)).astype(dtype)
    q_pe = load(q_pe_ref.at[b, t, pl.ds(0, rows), pl.ds(0, rope)], row_ok & p_ok, (rows, rope) != (H, P)).astype(dtype)
    lo = j * chunk
    hi = jnp.minimum(jnp.minimum(pos_ref[b * T + t] + 1, window), lo + chunk)  # past this split's last visible key

    def step(i, carry):
        m, l, acc = carry
        s0 = lo + i * block_s
        key_ok = s0 + jax.lax.broadcasted_iota(jnp.int32, (block_s, 1), 0) < hi  # [block_s, 1]
        c = pltriton.load(c_kv_ref.at[b, pl.ds(s0, block_s), pl.ds(0, width)], mask=key_ok & r_ok, other=0)
        k = pltriton.load(k_pe_ref.at[b, pl.ds(s0, block_s), pl.ds(0, rope)], mask=key_ok & p_ok, other=0)
        scores = (_contract_last(q, c) + _contract_last(q_pe, k)) * scale  # [rows, block_s]
        scores = jnp.where(s0 + lanes(block_s) < hi, scores, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(scores, axis=1))  # finite: each step sees a visible key
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(scores - m_new[:, None])
        pv = jax.lax.dot_general(p.astype(dtype), c, (((1,), (0,)), ((), ())), precision=_HI,
                                 preferred_element_type=_F32)  # [rows, width]
        return m_new, l * alpha + jnp.sum(p, axis=1), acc * alpha[:, None] + pv

    steps = pl.cdiv(jnp.maximum(hi - lo, 0), block_s)
    init = (jnp.full((rows,), -jnp.inf, _F32), jnp.zeros((rows,), _F32), jnp.zeros((rows, width), _F32))
    m, l, acc = jax.lax.fori_loop(0, steps, step, init)
    o = acc / jnp.where(l > 0, l, 1.0)[:, None]  # an empty split's acc is 0
    out = o_ref.at[b, t, j, pl.ds(0, rows), pl.ds(0, width)]
    if (rows, width) != (H, R):
        pltriton.store(out, o, mask=q_mask)
    else:
        pltriton.store(out, o)
    for ref, value in zip(stat_refs, (m, l)):
        mask = jax.lax.broadcasted_iota(jnp.int32, (rows,), 0) < H if rows != H else None
        pltriton.store(ref.at[b, t, j, pl.ds(0, rows)], value, mask=mask)


def combine_splits(o: Array, m: Array, l: Array) -> Array:
    """Per-split outputs o [B, T, splits, H, R] (each normalized over its split), running maxima m and
    sums l [B, T, splits, H] -> the softmax over all splits' positions [B, T, H, R]."""
    weight = jnp.exp(m - jnp.max(m, axis=2, keepdims=True)) * l  # empty splits: exp(-inf) * 0 = 0
    return jnp.sum(weight[..., None] * o, axis=2) / jnp.sum(weight, axis=2)[..., None]


@functools.partial(jax.jit, static_argnames=("scale", "window", "blocks", "interpret"))
def _attention(q_lat, q_pe, c_kv, k_pe, pos, *, scale: float, window: int, blocks: AttentionBlocks,
               interpret: bool):
    B, T, H, R = q_lat.shape
    splits = blocks.splits or auto_splits(B * T, window)
    chunk = pl.cdiv(pl.cdiv(window, splits), blocks.block_s) * blocks.block_s
    splits = pl.cdiv(window, chunk)
    out_shape = [jax.ShapeDtypeStruct((B, T, splits, H, R), _F32)]
    if splits > 1:
        out_shape += [jax.ShapeDtypeStruct((B, T, splits, H), _F32)] * 2
    params = None if interpret else pltriton.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages)
    outs = pl.pallas_call(
        functools.partial(_attention_kernel, scale=scale, window=window, chunk=chunk, block_s=blocks.block_s,
                          dtype=c_kv.dtype),
        out_shape=tuple(out_shape),
        grid=(B, T, splits),
        compiler_params=params,
        interpret=interpret,
        name="mla_latent_attention",
    )(pos.reshape(-1).astype(jnp.int32), q_lat, q_pe, c_kv, k_pe)
    return outs[0][:, :, 0] if splits == 1 else combine_splits(*outs)


def check_inputs(q_lat: Array, q_pe: Array, c_kv: Array, k_pe: Array, pos: Array, window: int | None) -> None:
    """Raises ValueError unless the shapes, dtypes and window fit ``decode_latent_attention``."""
    if q_lat.ndim != 4 or q_pe.ndim != 4 or q_pe.shape[:3] != q_lat.shape[:3]:
        raise ValueError(f"q_lat [B, T, H, R] = {q_lat.shape} and q_pe [B, T, H, P] = {q_pe.shape} disagree")
    B, T, H, R = q_lat.shape
    P = q_pe.shape[3]
    if c_kv.ndim != 3 or c_kv.shape[0] != B or c_kv.shape[2] != R:
        raise ValueError(f"c_kv must be [B, S, R] with B = {B}, R = {R}, got {c_kv.shape}")
    S = c_kv.shape[1]
    if k_pe.shape != (B, S, P):
        raise ValueError(f"k_pe must be [B, S, P] = {(B, S, P)}, got {k_pe.shape}")
    if c_kv.dtype != k_pe.dtype or jnp.dtype(c_kv.dtype) not in DTYPES:
        raise ValueError(f"c_kv and k_pe must share a dtype, bfloat16 or float32: {c_kv.dtype}, {k_pe.dtype}")
    if pos.shape != (B, T) or not jnp.issubdtype(pos.dtype, jnp.integer):
        raise ValueError(f"pos must be integer [B, T] = [{B}, {T}], got {pos.dtype} {pos.shape}")
    if window is not None and not 1 <= window <= S:
        raise ValueError(f"window = {window}: must be between 1 and the cache's {S} positions")


def decode_latent_attention(q_lat: Array, q_pe: Array, c_kv: Array, k_pe: Array, pos: Array, scale: float, *,
                            window: int | None = None, blocks: AttentionBlocks | None = None,
                            interpret: bool | None = None) -> Array:
    """q_lat [B, T, H, R] (q_nope W_UK), q_pe [B, T, H, P], the latent cache c_kv [B, S, R] (after
    kv_a_layernorm) and k_pe [B, S, P] (bf16 or float32), pos [B, T] (cache positions <= pos[b, t]
    are visible to query t), of which only the first ``window`` (static, default S) are read ->
    o_lat [B, T, H, R] float32: ``k3jax.functional.mla.latent_attention`` over the first ``window``
    positions. For few query tokens: each token's program walks the cache on its own. ``blocks``:
    None for DEFAULT_BLOCKS."""
    check_inputs(q_lat, q_pe, c_kv, k_pe, pos, window)
    interpret = pallas_interpret() if interpret is None else interpret
    window = c_kv.shape[1] if window is None else int(window)
    return _attention(q_lat, q_pe, c_kv, k_pe, pos, scale=float(scale), window=window,
                      blocks=DEFAULT_BLOCKS if blocks is None else blocks, interpret=interpret)


__all__ = ["AttentionBlocks", "DEFAULT_BLOCKS", "auto_splits", "check_inputs", "combine_splits",
           "decode_latent_attention"]
