"""A Block AttnRes mix and the RMSNorm after it in one small kernel, one program per row.

``mix_norm(partial, blocks, count, mix_norm_weight, mix_proj_weight, mix_eps, norm)`` is
``rms_norm(attn_res_mix(blocks, count, partial, ...)[0].astype(partial.dtype), *norm)``
(``k3jax.functional.attn_res``, ``k3jax.functional.norms``): each source's score is its RMS-normed
value dotted with the query ``mix_norm_weight * mix_proj_weight``, a softmax over the sources (the
first ``count`` stored blocks, then the partial) weighs the raw sources, the sum is rounded to the
partial's dtype, then RMS-normed (float32 inside, rounded to the partial's dtype again).

XLA runs a mix as a fusion of 128 programs that each recompute the softmax over depth (about
3.9 us a mix on the H200 at mini's D = 2048); done inside every program of the matvec kernel that
reads it, the recomputation cost more than it saved (sixth session, benchmarks/RESULTS.md). Here
one program per row loads its sources once, whole (D padded to a power of two, masked), and writes
the normed row that the matvec kernel then reads without a norm of its own. The Pallas path takes it
at every row count (``k3jax.layers.basic.MIX_KERNEL_ANY_ROWS``): on the H200 the batched decode steps
were faster with it (B=64 2.26 against 2.40 ms, best of 8 rounds), an 8K prefill chunk no different (twenty-ninth
and thirtieth sessions): there each kernel's block stack is a concatenation XLA writes out first (``mix_norm``).
Interpret mode on CPU.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from k3jax.implementation import pallas_interpret
from k3jax.typing import Array
from pallas_kernels._triton import triton_params

_F32 = jnp.float32


def _mix_norm_kernel(partial_ref, *refs, n_blocks: int, stacked: bool, mix_eps: float, eps: float | None):
    """Refs: partial [M, D]; the stored blocks: with ``stacked`` one [N, M, D] and count [1] int32 (the first
    count valid), else ``n_blocks`` arrays [M, D], all valid; the mix site's norm and projection weights [1, D]
    (their product is the query); the RMSNorm weight [1, D] when eps is given; out [M, D]."""
    if stacked:
        blocks_ref, count_ref, *refs = refs
    else:
        block_refs, refs = refs[:n_blocks], refs[n_blocks:]
    site_norm_ref, site_proj_ref, *refs = refs
    norm_ref, out_ref = refs if eps is not None else (None, refs[0])
    row = pl.program_id(0)
    depth = partial_ref.shape[1]
    width = pl.next_power_of_2(depth)
    cols = jax.lax.broadcasted_iota(jnp.int32, (1, width), 1) < depth
    load = lambda ref, mask=cols: pltriton.load(ref, mask=mask, other=0).astype(_F32)
    if stacked:
        sources = [load(blocks_ref.at[pl.ds(s, 1), pl.ds(row, 1), pl.ds(0, width)], cols[None]).reshape(1, width)
                   for s in range(n_blocks)]
    else:
        sources = [load(ref.at[pl.ds(row, 1), pl.ds(0, width)]) for ref in block_refs]
    sources.append(load(partial_ref.at[pl.ds(row, 1), pl.ds(0, width)]))
    query = load(site_norm_ref.at[:, pl.ds(0, width)]) * load(site_proj_ref.at[:, pl.ds(0, width)])
    count = pltriton.load(count_ref.at[pl.ds(0, 1)])[None, :] if stacked else None
    # loaded with the sources: a load written after the reductions below would wait for their barriers
    norm_weight = None if norm_ref is None else load(norm_ref.at[:, pl.ds(0, width)])
    scores = []
    for s, x in enumerate(sources):
        inverse_rms = jax.lax.rsqrt(jnp.sum(x * x, axis=1, keepdims=True) / depth + mix_eps)
        score = jnp.sum(x * query, axis=1, keepdims=True) * inverse_rms
        scores.append(jnp.where(s < count, score, -jnp.inf) if stacked and s < n_blocks else score)
    top = functools.reduce(jnp.maximum, scores)
    e = [jnp.exp(score - top) for score in scores]
    total = functools.reduce(jnp.add, e)
    mixed = functools.reduce(jnp.add, [w / total * x for w, x in zip(e, sources)]).astype(out_ref.dtype)
    if norm_weight is not None:
        m = mixed.astype(_F32)
        inverse = jax.lax.rsqrt(jnp.sum(m * m, axis=1, keepdims=True) / depth + eps)
        mixed = (m * inverse * norm_weight).astype(out_ref.dtype)
    pltriton.store(out_ref.at[pl.ds(row, 1), pl.ds(0, width)], mixed, mask=cols)


@functools.partial(jax.jit, static_argnames=("mix_eps", "eps", "interpret"))
def _mix_norm(partial, blocks, count, site_norm, site_proj, norm_weight, *, mix_eps, eps, interpret):
    """blocks: a tuple of [M, D] arrays, all valid (count None), or [N, M, D] with the first count valid."""
    m_rows, depth = partial.shape
    stacked = count is not None
    n_blocks = blocks.shape[0] if stacked else len(blocks)
    warps = min(16, max(4, (n_blocks + 1) * pl.next_power_of_2(depth) // 4096))
    operands = [blocks, count.reshape(1)] if stacked else list(blocks)
    return pl.pallas_call(
        functools.partial(_mix_norm_kernel, n_blocks=n_blocks, stacked=stacked, mix_eps=mix_eps, eps=eps),
        out_shape=jax.ShapeDtypeStruct(partial.shape, partial.dtype),
        grid=(m_rows,),
        compiler_params=triton_params(warps, 1, interpret),
        interpret=interpret,
        name="mix_norm",
    )(partial, *operands, site_norm.reshape(1, depth), site_proj.reshape(1, depth),
      *([] if eps is None else [norm_weight.reshape(1, depth)]))


def mix_norm(partial: Array, blocks: "Array | Sequence[Array]", count: Array | int | None,
             mix_norm_weight: Array, mix_proj_weight: Array, mix_eps: float, norm: tuple[Array, float] | None = None,
             *, interpret: bool | None = None) -> Array:
    """partial [M, D]; the stored blocks: [N, M, D] with the first ``count`` valid (the rest are ignored), or a
    sequence of [M, D] arrays, all valid (count None); the mix site's weights [D] each -> the mix [M, D] in
    partial's dtype, RMS-normed by ``norm`` = (weight [D], eps) when given. bf16 or float32 inputs, float32 inside.

    A stack is one operand, read whole; a sequence's blocks are operands of their own. Where the stack is a buffer
    the layers wrote block by block, XLA writes it out (a concatenation) before every mix kernel that takes it: on
    the H200, 33 of them in a 2048-token `mini` prefill chunk, 6-25 us each (benchmarks/RESULTS.md, issue 4,
    thirtieth session); the candidate ``k3jax.model.MIX_STORED_BLOCKS`` hands the stored arrays instead."""
    if partial.ndim != 2:
        raise ValueError(f"partial must be [M, D], got {partial.shape}")
    if isinstance(blocks, (list, tuple)):
        if count is not None:
            raise ValueError("count: give None with a sequence of blocks (every block is valid)")
        if any(b.shape != partial.shape for b in blocks):
            raise ValueError(f"blocks must each be [M, D] = {partial.shape}, got {[b.shape for b in blocks]}")
        blocks = tuple(blocks)
    else:
        if blocks.ndim != 3 or blocks.shape[1:] != partial.shape or blocks.shape[0] < 1:
            raise ValueError(f"blocks [N, M, D] must have partial's M, D = {partial.shape}, got {blocks.shape}")
        if count is None:
            raise ValueError("count: give the number of valid blocks of a stack [N, M, D]")
        count = jnp.asarray(count, jnp.int32)
    depth = partial.shape[1]
    for name, w in (("mix_norm_weight", mix_norm_weight), ("mix_proj_weight", mix_proj_weight),
                    ("norm weight", None if norm is None else norm[0])):
        if w is not None and w.size != depth:
            raise ValueError(f"{name} must hold D = {depth} values, got shape {w.shape}")
    interpret = pallas_interpret() if interpret is None else interpret
    norm_weight, eps = (None, None) if norm is None else (norm[0], float(norm[1]))
    return _mix_norm(partial, blocks, count, mix_norm_weight, mix_proj_weight, norm_weight, mix_eps=float(mix_eps),
                     eps=eps, interpret=interpret)


__all__ = ["mix_norm"]
