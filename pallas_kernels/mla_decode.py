"""MLA's absorbed attention for one new token per sequence (decode) in one kernel.

``absorbed_decode(q_nope, q_pe, c_kv, k_pe, kv_b, positions, scale)`` is
``k3jax.functional.mla.absorbed_attention`` at T = 1 with the cache positions <= positions[b]
visible: per head, q_lat = q_nope W_UK, scores = (q_lat . c_kv + q_pe . k_pe) * scale, softmax,
o_lat = p c_kv, o = o_lat W_UV (W_UK, W_UV: the head's N key rows and V value rows of kv_b). XLA
runs these as about 18 small kernels per layer; here one ``pallas_call`` does all of it. One program
per (head, cache split, sequence): it forms q_lat from its [N, R] key block (block_n rows a step),
walks its split's cache positions in blocks of block_s with an online (running max) softmax, only up
to the sequence's position (positions past it are never read), and multiplies its o_lat by the [V, R]
value block. With more than one split per sequence (flash-decoding, for long caches), each split
writes its normalized output, running max and sum, and XLA combines the splits (a few tiny fused ops).

Arithmetic as the reference's: matmul operands (q_nope, kv_b, q_lat, q_pe, the probabilities, o_lat)
rounded to the cache's dtype, products and sums in float32 (on the CUDA cores: at one query per head
the kernel reads bytes, it has no matrix to multiply). The probabilities rounded are exp(s - running
max) rather than the normalized softmax, so bf16 results differ from the reference by bf16 rounding.

Measured (H200, 2026-11-30, benchmarks/RESULTS.md, issue 4, sixth session; mini's H 16, bf16): correct
(rel err 5e-4 to 3e-3 against the XLA reference with bf16 operands, 4e-7 with float32 caches) but
slower than XLA's ~18 kernels everywhere: 35 us against 19.5 at B 1, S 192 (the decode benchmark's
window); 65 against 25 at B 1, S 4096 (16 splits); 396 against 53 at B 8, S 4096 (8 splits). Each
program walks its weight blocks and cache blocks in a chain of dependent loads on one multiprocessor
(16 programs at B 1 for 4 MB of kv_b), while XLA spreads every stage over the whole chip. So
``MLA.extend`` does not call it; a faster form needs the weight work spread over more programs
(q_lat and o as their own wide stages) and the heads of a sequence sharing each cache block.

Limits: N, P, V, R powers of two (Triton's block widths; mini and K3 have 128, 64, 128, 512); S any
size. Each program reads its split of the cache once per head, so long caches with many heads re-read
c_kv H times (from L2 where it fits). On GPU the kernel lowers through Pallas' Triton backend; on CPU
it runs in interpret mode (``k3jax.implementation.pallas_interpret``).
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
TARGET_PROGRAMS = 1024  # programs the automatic split count aims for (H200, S 4096: 16 splits at B 1, 8 at B 8)
MIN_SPLIT = 256  # fewest cache positions per split, for the automatic split count


@dataclasses.dataclass(frozen=True)
class DecodeBlocks:
    """block_s: cache positions per step; block_n: rows of W_UK / W_UV per step (both powers of two);
    splits: programs per (sequence, head) over the cache, None for ``auto_splits``; num_warps,
    num_stages: Triton launch and pipelining depth (ignored in interpret mode)."""

    block_s: int = 32
    block_n: int = 16
    splits: int | None = None
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        for name in ("block_s", "block_n"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"DecodeBlocks.{name} = {value}: must be a power of two")
        if self.splits is not None and self.splits < 1:
            raise ValueError(f"DecodeBlocks.splits = {self.splits}: must be >= 1")


def auto_splits(batch: int, heads: int, window: int) -> int:
    """Splits per (sequence, head): enough programs to fill the GPU (TARGET_PROGRAMS), each split at
    least MIN_SPLIT positions."""
    return max(1, min(pl.cdiv(window, MIN_SPLIT), pl.cdiv(TARGET_PROGRAMS, batch * heads)))


def _load(ref, mask: Array | None = None) -> Array:
    """ref's block as float32, zeros where mask (if any) is False."""
    return pltriton.load(ref, mask=mask, other=None if mask is None else 0).astype(jnp.float32)


def _decode_kernel(pos_ref, qn_ref, qp_ref, c_ref, kpe_ref, w_ref, o_ref, m_ref, l_ref, *, scale: float,
                   window: int, chunk: int, block_s: int, block_n: int, dtype):
    """Refs: positions [B] int32, q_nope [B, H, N], q_pe [B, H, P], c_kv [B, S, R], k_pe [B, S, P],
    kv_b [H*(N+V), R]; outputs: o [B, H, splits, V] float32 (this split's normalized output), m and l
    [B, H, splits] float32 (its running max and sum of exp(score - max); -inf and 0 if empty)."""
    h, j, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    N, P, R, V = qn_ref.shape[2], qp_ref.shape[2], c_ref.shape[2], o_ref.shape[3]
    rnd = lambda x: x.astype(dtype).astype(jnp.float32)  # a matmul operand, as the reference rounds it
    row0 = h * (N + V)

    def key_step(i, acc):
        n0 = pl.multiple_of(i * block_n, block_n)
        q = rnd(_load(qn_ref.at[b, h, pl.ds(n0, block_n)]))
        w = rnd(_load(w_ref.at[pl.ds(row0 + n0, block_n), :]))
        return acc + jnp.sum(q[:, None] * w, axis=0)

    q_lat = rnd(jax.lax.fori_loop(0, N // block_n, key_step, jnp.zeros((R,), jnp.float32)))
    q_pe = rnd(_load(qp_ref.at[b, h, :]))
    lo = j * chunk
    hi = jnp.minimum(jnp.minimum(pos_ref[b] + 1, window), lo + chunk)

    def cache_step(i, carry):
        m, l, acc = carry
        s0 = lo + i * block_s
        valid = s0 + jax.lax.broadcasted_iota(jnp.int32, (block_s,), 0) < hi
        c = _load(c_ref.at[b, pl.ds(s0, block_s), :], valid[:, None] & jnp.ones((block_s, R), bool))
        k = _load(kpe_ref.at[b, pl.ds(s0, block_s), :], valid[:, None] & jnp.ones((block_s, P), bool))
        s = (jnp.sum(q_lat[None, :] * c, axis=1) + jnp.sum(q_pe[None, :] * k, axis=1)) * scale
        s = jnp.where(valid, s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s))  # finite: every step has a valid position
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new)
        return m_new, l * alpha + jnp.sum(p), acc * alpha + jnp.sum(rnd(p)[:, None] * c, axis=0)

    steps = pl.cdiv(jnp.maximum(hi - lo, 0), block_s)
    init = (jnp.float32(-jnp.inf), jnp.float32(0), jnp.zeros((R,), jnp.float32))
    m, l, acc = jax.lax.fori_loop(0, steps, cache_step, init)
    o_lat = rnd(jnp.where(l > 0, acc / l, 0.0))

    def value_step(i, _):
        v0 = pl.multiple_of(i * block_n, block_n)
        w = rnd(_load(w_ref.at[pl.ds(row0 + N + v0, block_n), :]))
        pltriton.store(o_ref.at[b, h, j, pl.ds(v0, block_n)], jnp.sum(w * o_lat[None, :], axis=1))
        return 0

    jax.lax.fori_loop(0, V // block_n, value_step, 0)
    pltriton.store(m_ref.at[b, h, pl.ds(j, 1)], jnp.full((1,), m, jnp.float32))
    pltriton.store(l_ref.at[b, h, pl.ds(j, 1)], jnp.full((1,), l, jnp.float32))


def combine_splits(o: Array, m: Array, l: Array) -> Array:
    """Per-split outputs o [B, H, splits, V] (each normalized over its split), running maxima m and sums
    l [B, H, splits] -> the softmax over all splits' positions [B, H, V]."""
    weight = jnp.exp(m - jnp.max(m, axis=2, keepdims=True)) * l  # empty splits: exp(-inf) * 0 = 0
    return jnp.sum(weight[..., None] * o, axis=2) / jnp.sum(weight, axis=2)[..., None]


@functools.partial(jax.jit, static_argnames=("scale", "window", "blocks", "interpret"))
def _decode(q_nope, q_pe, c_kv, k_pe, kv_b, positions, *, scale: float, window: int, blocks: DecodeBlocks,
            interpret: bool):
    B, H, N = q_nope.shape
    V = kv_b.shape[0] // H - N
    splits = blocks.splits or auto_splits(B, H, window)
    chunk = pl.cdiv(pl.cdiv(window, splits), blocks.block_s) * blocks.block_s
    splits = pl.cdiv(window, chunk)
    block_n = min(blocks.block_n, N, V)
    params = None if interpret else pltriton.CompilerParams(num_warps=blocks.num_warps,
                                                             num_stages=blocks.num_stages)
    stat = jax.ShapeDtypeStruct((B, H, splits), jnp.float32)
    o, m, l = pl.pallas_call(
        functools.partial(_decode_kernel, scale=scale, window=window, chunk=chunk, block_s=blocks.block_s,
                          block_n=block_n, dtype=c_kv.dtype),
        out_shape=(jax.ShapeDtypeStruct((B, H, splits, V), jnp.float32), stat, stat),
        grid=(H, splits, B),
        compiler_params=params,
        interpret=interpret,
        name="mla_absorbed_decode",
    )(positions.astype(jnp.int32), q_nope, q_pe, c_kv, k_pe, kv_b)
    return o[:, :, 0] if splits == 1 else combine_splits(o, m, l)


def _power_of_two(n: int) -> bool:
    return n >= 1 and not n & (n - 1)


def check_decode(q_nope: Array, q_pe: Array, c_kv: Array, k_pe: Array, kv_b: Array, positions: Array,
                 window: int | None) -> None:
    """Raises ValueError unless the shapes, dtypes and window fit ``absorbed_decode``."""
    if q_nope.ndim != 3 or q_pe.ndim != 3 or q_pe.shape[:2] != q_nope.shape[:2]:
        raise ValueError(f"q_nope [B, H, N] = {q_nope.shape} and q_pe [B, H, P] = {q_pe.shape} disagree")
    B, H, N = q_nope.shape
    P = q_pe.shape[2]
    if c_kv.ndim != 3 or c_kv.shape[0] != B:
        raise ValueError(f"c_kv must be [B, S, R] with B = {B}, got {c_kv.shape}")
    S, R = c_kv.shape[1:]
    if k_pe.shape != (B, S, P):
        raise ValueError(f"k_pe must be [B, S, P] = {(B, S, P)}, got {k_pe.shape}")
    if kv_b.ndim != 2 or kv_b.shape[1] != R or kv_b.shape[0] % H or kv_b.shape[0] // H <= N:
        raise ValueError(f"kv_b must be [H*(N+V), R] with H = {H}, N = {N}, R = {R}, got {kv_b.shape}")
    V = kv_b.shape[0] // H - N
    if positions.shape != (B,) or not jnp.issubdtype(positions.dtype, jnp.integer):
        raise ValueError(f"positions must be integer [B] = [{B}], got {positions.shape} {positions.dtype}")
    for name, n in (("N", N), ("P", P), ("V", V), ("R", R)):
        if not _power_of_two(n):
            raise ValueError(f"{name} = {n}: must be a power of two")
    if c_kv.dtype != k_pe.dtype or jnp.dtype(c_kv.dtype) not in DTYPES:
        raise ValueError(f"c_kv and k_pe must share a dtype, bfloat16 or float32: {c_kv.dtype}, {k_pe.dtype}")
    if window is not None and not 1 <= window <= S:
        raise ValueError(f"window = {window}: must be between 1 and the cache's {S} positions")


def absorbed_decode(q_nope: Array, q_pe: Array, c_kv: Array, k_pe: Array, kv_b: Array, positions: Array,
                    scale: float, *, window: int | None = None, blocks: DecodeBlocks = DecodeBlocks(),
                    interpret: bool | None = None) -> Array:
    """One new token per sequence: q_nope [B, H, N], q_pe [B, H, P], the latent cache c_kv [B, S, R]
    (after kv_a_layernorm) and k_pe [B, S, P], kv_b [H*(N+V), R] (per head: N key rows, V value rows),
    positions [B] (cache positions <= positions[b] are visible), the first ``window`` (static, default
    S) cache positions read -> [B, H, V] float32: ``absorbed_attention`` at T = 1."""
    check_decode(q_nope, q_pe, c_kv, k_pe, kv_b, positions, window)
    interpret = pallas_interpret() if interpret is None else interpret
    window = c_kv.shape[1] if window is None else int(window)
    return _decode(q_nope, q_pe, c_kv, k_pe, kv_b, positions, scale=float(scale), window=window, blocks=blocks,
                   interpret=interpret)


__all__ = ["DecodeBlocks", "absorbed_decode", "auto_splits", "check_decode", "combine_splits"]
