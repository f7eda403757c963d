"""A Block AttnRes mix and the RMSNorm after it in one small kernel, one program per row.

``mix_norm(partial, blocks, count, mix_norm_weight, mix_proj_weight, mix_eps, norm)`` is
``rms_norm(attn_res_mix(blocks, count, partial, ...)[0].astype(partial.dtype), *norm)``
(``k3jax.functional.attn_res``, ``k3jax.functional.norms``): each source's score is its RMS-normed
value dotted with the query ``mix_norm_weight * mix_proj_weight``, a softmax over the sources (the
first ``count`` stored blocks, then the partial) weighs the raw sources, the sum is rounded to the
partial's dtype, then RMS-normed (float32 inside, rounded to the partial's dtype again).

XLA runs a mix as a fusion of 128 programs that each recompute the softmax over depth (about 3.9 us a
mix on the H200 at mini's D = 2048); done inside every program of the matvec kernel that reads it, the
recomputation cost more than it saved (benchmarks/HISTORY.md, 2026-12-01). Here one program per row
loads its sources once, whole (D padded to a power of two, masked), and writes the normed row that the
matvec kernel then reads without a norm of its own. Where the Pallas path takes it
(``KernelPolicy.mix_kernel_any_rows``) and why: README.md. Interpret mode on CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import _platform
from k3jax.typing import Array
from pallas_kernels._triton import triton_params

_F32 = jnp.float32


def _mix_norm_kernel(partial_ref, blocks_ref, count_ref, site_norm_ref, site_proj_ref, *refs, mix_eps: float,
                     eps: float | None):
    """Refs: partial [M, D], blocks [N, M, D], count [1] int32, the mix site's norm and projection
    weights [1, D] (their product is the query), the RMSNorm weight [1, D] when eps is given, out [M, D]."""
    norm_ref, out_ref = refs if eps is not None else (None, refs[0])
    row = pl.program_id(0)
    depth = partial_ref.shape[1]
    width = pl.next_power_of_2(depth)
    cols = jax.lax.broadcasted_iota(jnp.int32, (1, width), 1) < depth
    load = lambda ref, mask=cols: pltriton.load(ref, mask=mask, other=0).astype(_F32)
    sources = [load(blocks_ref.at[pl.ds(s, 1), pl.ds(row, 1), pl.ds(0, width)], cols[None]).reshape(1, width)
               for s in range(blocks_ref.shape[0])]
    sources.append(load(partial_ref.at[pl.ds(row, 1), pl.ds(0, width)]))
    query = load(site_norm_ref.at[:, pl.ds(0, width)]) * load(site_proj_ref.at[:, pl.ds(0, width)])
    count = pltriton.load(count_ref.at[pl.ds(0, 1)])[None, :]
    # loaded with the sources: a load written after the reductions below would wait for their barriers
    norm_weight = None if norm_ref is None else load(norm_ref.at[:, pl.ds(0, width)])
    scores = []
    for s, x in enumerate(sources):
        inverse_rms = jax.lax.rsqrt(jnp.sum(x * x, axis=1, keepdims=True) / depth + mix_eps)
        score = jnp.sum(x * query, axis=1, keepdims=True) * inverse_rms
        scores.append(score if s == len(sources) - 1 else jnp.where(s < count, score, -jnp.inf))
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
    m_rows, depth = partial.shape
    warps = min(16, max(4, (blocks.shape[0] + 1) * pl.next_power_of_2(depth) // 4096))
    params = triton_params(warps, 1, interpret)
    return pl.pallas_call(
        functools.partial(_mix_norm_kernel, mix_eps=mix_eps, eps=eps),
        out_shape=jax.ShapeDtypeStruct(partial.shape, partial.dtype),
        grid=(m_rows,),
        compiler_params=params,
        interpret=interpret,
        name="mix_norm",
    )(partial, blocks, count, site_norm.reshape(1, depth), site_proj.reshape(1, depth),
      *([] if eps is None else [norm_weight.reshape(1, depth)]))


def mix_norm(partial: Array, blocks: Array, count: Array | int, mix_norm_weight: Array, mix_proj_weight: Array,
             mix_eps: float, norm: tuple[Array, float] | None = None, *, interpret: bool | None = None) -> Array:
    """partial [M, D], blocks [N, M, D] (the first ``count`` valid; the rest are ignored), the mix
    site's weights [D] each -> the mix [M, D] in partial's dtype, RMS-normed by ``norm`` = (weight
    [D], eps) when given. bf16 or float32 inputs, float32 inside."""
    m_rows, depth = partial.shape if partial.ndim == 2 else (None, None)
    if m_rows is None or blocks.ndim != 3 or blocks.shape[1:] != partial.shape or blocks.shape[0] < 1:
        raise ValueError(f"partial must be [M, D] and blocks [N, M, D] with the same M, D; got {partial.shape} "
                         f"and {blocks.shape}")
    for name, w in (("mix_norm_weight", mix_norm_weight), ("mix_proj_weight", mix_proj_weight),
                    ("norm weight", None if norm is None else norm[0])):
        if w is not None and w.size != depth:
            raise ValueError(f"{name} must hold D = {depth} values, got shape {w.shape}")
    count = jnp.asarray(count, jnp.int32).reshape(1)
    interpret = _platform.interpret() if interpret is None else interpret
    norm_weight, eps = (None, None) if norm is None else (norm[0], float(norm[1]))
    return _mix_norm(partial, blocks, count, mix_norm_weight, mix_proj_weight, norm_weight, mix_eps=float(mix_eps),
                     eps=eps, interpret=interpret)


__all__ = ["mix_norm"]
