"""A decode step's write of MLA's new latents into the cache, in one small kernel.

``write_latents(c, norm_weight, eps, c_kv, k_pe, positions)`` is, for one new token per sequence,
what the MLA layer computes as

    c_kv.at[b, positions[b]].set(rms_norm(c[b, :R], norm_weight, eps).astype(c_kv.dtype), mode="drop")
    k_pe.at[b, positions[b]].set(c[b, R:].astype(k_pe.dtype), mode="drop")

(``k3jax.functional.mla.write_latents``; the norm in float32, rounded to c's dtype, then to the cache's).
XLA runs this as about six kernels a layer at a batch-1 step (two slices, the norm's reduction, a
bounds check, two scatters); here one program per sequence loads its row once and writes both
rows of the cache where they lie (the outputs alias the caches). A position at or past the cache's
end writes nothing, as ``mode="drop"``. Interpret mode on CPU.
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


def _write_kernel(c_ref, weight_ref, positions_ref, c_kv_in, k_pe_in, c_kv_ref, k_pe_ref, *, eps: float):
    """Refs: c [B, R + P], the norm weight [1, R], positions [B] int32, the caches' inputs (aliased
    to the outputs, unread), the caches [B, S, R] and [B, S, P]."""
    del c_kv_in, k_pe_in
    b = pl.program_id(0)
    rank, rope = c_kv_ref.shape[2], k_pe_ref.shape[2]
    position = pltriton.load(positions_ref.at[pl.ds(b, 1)])[0]
    width = pl.next_power_of_2(rank)
    cols = jax.lax.broadcasted_iota(jnp.int32, (1, width), 1) < rank
    x = pltriton.load(c_ref.at[pl.ds(b, 1), pl.ds(0, width)], mask=cols, other=0)
    x32 = x.astype(_F32)
    inverse = jax.lax.rsqrt(jnp.sum(x32 * x32, axis=1, keepdims=True) / rank + eps)
    weight = pltriton.load(weight_ref.at[:, pl.ds(0, width)], mask=cols, other=0).astype(_F32)
    normed = (x32 * inverse * weight).astype(x.dtype).astype(c_kv_ref.dtype)
    pe = pltriton.load(c_ref.at[pl.ds(b, 1), pl.ds(rank, rope)]).astype(k_pe_ref.dtype)

    @pl.when(position < c_kv_ref.shape[1])
    def _():
        pltriton.store(c_kv_ref.at[pl.ds(b, 1), pl.ds(position, 1), pl.ds(0, width)], normed[None], mask=cols[None])
        pltriton.store(k_pe_ref.at[pl.ds(b, 1), pl.ds(position, 1), pl.ds(0, rope)], pe[None])


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def _write_latents(c, norm_weight, positions, c_kv, k_pe, *, eps: float, interpret: bool):
    return pl.pallas_call(
        functools.partial(_write_kernel, eps=eps),
        out_shape=(jax.ShapeDtypeStruct(c_kv.shape, c_kv.dtype), jax.ShapeDtypeStruct(k_pe.shape, k_pe.dtype)),
        grid=(c.shape[0],),
        input_output_aliases={3: 0, 4: 1},
        compiler_params=triton_params(4, 1, interpret),
        interpret=interpret,
        name="write_latents",
    )(c, norm_weight.reshape(1, -1), positions, c_kv, k_pe)


def write_latents(c: Array, norm_weight: Array, eps: float, c_kv: Array, k_pe: Array, positions: Array, *,
                  interpret: bool | None = None) -> tuple[Array, Array]:
    """c [B, R + P] (kv_a_proj_with_mqa's output for one token per sequence), norm_weight [R]
    (kv_a_layernorm), the caches c_kv [B, S, R] and k_pe [B, S, P], positions [B] int32 -> the caches
    with row positions[b] of sequence b written (nothing where positions[b] >= S), over their buffers
    where the caller no longer needs them (a decode step with a donated cache). P a power of two."""
    B, S, R = c_kv.shape
    P = k_pe.shape[2]
    if c.ndim != 2 or c.shape != (B, R + P):
        raise ValueError(f"c must be [B, R + P] = [{B}, {R + P}] (the caches' B, R and P), got {c.shape}")
    if k_pe.shape[:2] != (B, S) or P & (P - 1):
        raise ValueError(f"k_pe must be [B, S, P] = [{B}, {S}, P] with P a power of two, got {k_pe.shape}")
    if norm_weight.shape != (R,):
        raise ValueError(f"norm_weight must be [R] = [{R}], got {norm_weight.shape}")
    if positions.shape != (B,) or not jnp.issubdtype(positions.dtype, jnp.integer):
        raise ValueError(f"positions must be integer [B] = [{B}], got {positions.dtype} {positions.shape}")
    interpret = _platform.interpret() if interpret is None else interpret
    return _write_latents(c, norm_weight, positions.astype(jnp.int32), c_kv, k_pe, eps=float(eps),
                          interpret=interpret)


__all__ = ["write_latents"]
