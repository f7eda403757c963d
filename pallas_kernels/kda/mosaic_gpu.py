"""Chunked KDA forward with its state walk lowered through Mosaic GPU (Hopper wgmma, TMA).

``forward`` runs two kernels:

1. ``triton.intra_chunk`` (Pallas' Triton lowering on the GPU, as in ``ops``) at ``CHUNK`` = 32 tokens:
   W, U, A_qk, the decayed queries and keys and exp(G_C) of every chunk.
2. ``state_walk`` (this module, Mosaic GPU): grid (V / BLOCK_V, H, B), one warpgroup per program walks
   the chunks in order with the state block S [K, BLOCK_V] float32 in registers. Per chunk, with the
   chunk's tiles brought into shared memory by TMA one chunk ahead (two slots):
   ``V' = U - W S``, ``O = (q exp G) S + A_qk V'``, ``S <- exp(G_C) S + (k exp(G_C - G))^T V'``,
   four wgmma products with bf16 operands in shared memory and float32 accumulators.

wgmma multiplies 64 rows per warpgroup; a chunk has 32 tokens (the intra kernel's fastest chunk,
README), so the W, U, q and A_qk tiles sit in the top half of 64-row buffers; the bottom half is never
written, and since each row of a product depends only on the same row of its left operand, only the
top 32 rows of V' and O are read. The Kg^T V' product reads the decayed keys' [C, K] tile transposed
in shared memory (wgmma's transposed left operand; swizzles of 64 bytes, A_qk's and V''s). The
interpreter's wgmma (JAX 0.10) takes no transposed operand: in interpret mode that one product is a
plain matrix product of the loaded tiles, everything else is the same kernel.

Layouts: q, k, g [B, T, H, K]; v [B, T, H, V]; beta [B, T, H]; state [B, H, K, V] float32; T a
multiple of ``CHUNK``, ``seq_len`` the unpadded length (padded tokens get g = 0, beta = 0).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._mosaic_gpu import interpret_params, swizzled
from pallas_kernels.kda.triton import KDABlocks, intra_chunk

CHUNK = 32
BLOCK_V = 64
WGMMA_ROWS = 64  # rows of a wgmma product per warpgroup
_F32, _BF16 = jnp.float32, jnp.bfloat16
_N_LOADS = 6  # tiles brought in per chunk: W, U, decayed q, A_qk, decayed k, exp(G_C)
_INTRA_BLOCKS = KDABlocks(chunk=CHUNK, inter_dtype="bfloat16")


def _load(ref, layout, interpret):
    """The whole ref into registers in a wgmma register layout. The interpreter keeps no layouts (and
    has no CPU rule for ``layout_cast``), so there the plain load gives the same values."""
    value = ref[...]
    return value if interpret else plgpu.layout_cast(value, layout)


def wgmma_sum(shape, pairs):
    """sum(lhs @ rhs) over (lhs, rhs) shared-memory pairs, wgmma with a float32 accumulator."""
    def body(acc):
        for lhs, rhs in pairs:
            plgpu.wgmma(acc, lhs, rhs)
        return acc[...]

    return pl.run_scoped(body, plgpu.ACC(shape, _F32))


def _keys_t_times(kg_ref, v_ref, interpret):
    """kg_ref^T @ v_ref in float32 for a [C, K] keys tile: wgmma with the tile transposed in shared
    memory; in interpret mode (whose wgmma takes no transposed operand) the product of the loaded
    values."""
    if interpret:
        return jnp.dot(kg_ref[...].T, v_ref[...], preferred_element_type=_F32)
    K = kg_ref.shape[1]
    return wgmma_sum((K, v_ref.shape[1]), [(plgpu.transpose_ref(kg_ref, (1, 0)), v_ref)])


def _walk_kernel(w_g, u_g, qg_g, kg_g, aqk_g, gend_g, h0_g, o_g, ht_g,
                 w_s, u_s, qg_s, aqk_s, kg_s, gend_s, state_s, vnew_s, o_s, f32_s, bars, *,
                 n_chunks, interpret):
    """One (value block, head, batch) program: the whole sequence, chunk by chunk."""
    vb, h, b = jax.lax.axis_index("v_block"), jax.lax.axis_index("head"), jax.lax.axis_index("batch")
    K, bv = state_s.shape
    cols = pl.ds(vb * bv, bv)
    top = pl.ds(0, CHUNK)

    def fetch(c, slot):
        rows = pl.ds(c * CHUNK, CHUNK)
        sources = [w_g.at[b, rows, h], u_g.at[b, rows, h, cols], qg_g.at[b, rows, h],
                   aqk_g.at[b, rows, h], kg_g.at[b, rows, h], gend_g.at[b, c, h]]
        targets = [w_s.at[slot, top], u_s.at[slot, top], qg_s.at[slot, top], aqk_s.at[slot, top],
                   kg_s.at[slot], gend_s.at[slot]]
        for i, (src, dst) in enumerate(zip(sources, targets)):
            plgpu.copy_gmem_to_smem(src, dst, bars.at[i * 2 + slot])

    fetch(0, 0)
    plgpu.copy_gmem_to_smem(h0_g.at[b, h, :, cols], f32_s, bars.at[_N_LOADS * 2])
    plgpu.barrier_wait(bars.at[_N_LOADS * 2])
    state = _load(f32_s, plgpu.Layout.WGMMA, interpret)

    def step(c, state):
        slot = jax.lax.rem(c, 2)

        @pl.when(c + 1 < n_chunks)
        def _prefetch():
            fetch(c + 1, 1 - slot)

        for i in range(_N_LOADS):
            plgpu.barrier_wait(bars.at[i * 2 + slot])
        state_s[...] = state.astype(_BF16)
        plgpu.commit_smem()
        w_s_state = wgmma_sum((WGMMA_ROWS, bv), [(w_s.at[slot], state_s)])
        v_new = u_s[slot].astype(_F32) - w_s_state
        vnew_s[...] = v_new.astype(_BF16)
        plgpu.commit_smem()
        o = wgmma_sum((WGMMA_ROWS, bv), [(qg_s.at[slot], state_s), (aqk_s.at[slot], vnew_s.at[top])])
        plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # the copy out of this slot two chunks ago
        o_s[slot] = o
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_s.at[slot, top], o_g.at[b, pl.ds(c * CHUNK, CHUNK), h, cols])
        decay = _load(gend_s.at[slot], plgpu.Layout.WGMMA.reduce(1), interpret)  # [K], one per state row
        decayed = state * jax.lax.broadcast_in_dim(decay, (K, bv), [0])
        return decayed + _keys_t_times(kg_s.at[slot], vnew_s.at[top], interpret)

    state = jax.lax.fori_loop(0, n_chunks, step, state)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    f32_s[...] = state
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(f32_s, ht_g.at[b, h, :, cols])
    plgpu.wait_smem_to_gmem(0)


def state_walk(w, u, qg, kg, aqk, gend, initial_state, *, interpret=False):
    """Sequential pass over chunks (Mosaic GPU). w, qg, kg [B, T, H, K], u [B, T, H, V], aqk [B, T, H, C]
    (bf16, from ``intra_chunk`` at ``CHUNK``);
    gend [B, T / C, H, K] float32; initial_state [B, H, K, V] float32. ``interpret``: False on the
    GPU, or ``interpret_params()`` on a CPU. BLOCK_V = 128 would need 297 KB of shared memory (the
    H200 gives a block 227 KB).

    Returns o float32 [B, T, H, V] and the final state float32 [B, H, K, V].
    """
    B, T, H, K = w.shape
    V = u.shape[-1]
    bv = min(BLOCK_V, V)
    if V % bv or K % WGMMA_ROWS:
        raise ValueError(f"K={K} must be a multiple of {WGMMA_ROWS} and BLOCK_V={bv} divide V={V}")
    slots = 2
    scratch = [
        plgpu.SMEM((slots, WGMMA_ROWS, K), _BF16, transforms=swizzled(K)),  # W
        plgpu.SMEM((slots, WGMMA_ROWS, bv), _BF16, transforms=swizzled(bv)),  # U
        plgpu.SMEM((slots, WGMMA_ROWS, K), _BF16, transforms=swizzled(K)),  # decayed q
        plgpu.SMEM((slots, WGMMA_ROWS, CHUNK), _BF16, transforms=swizzled(CHUNK)),  # A_qk
        plgpu.SMEM((slots, CHUNK, K), _BF16, transforms=swizzled(CHUNK)),  # decayed k (64-byte swizzle)
        plgpu.SMEM((slots, K), _F32),  # exp(G_C)
        plgpu.SMEM((K, bv), _BF16, transforms=swizzled(bv)),  # the state as a wgmma operand
        # V': the right operand after A_qk and k^T, whose 64-byte rows set its swizzle
        plgpu.SMEM((WGMMA_ROWS, bv), _BF16, transforms=swizzled(CHUNK)),
        plgpu.SMEM((slots, WGMMA_ROWS, bv), _F32, transforms=swizzled(bv, _F32)),  # O on its way out
        plgpu.SMEM((K, bv), _F32, transforms=swizzled(bv, _F32)),  # initial / final state
        plgpu.Barrier(num_barriers=_N_LOADS * slots + 1),
    ]
    kernel = functools.partial(_walk_kernel, n_chunks=T // CHUNK, interpret=bool(interpret))
    return plgpu.kernel(
        kernel,
        out_type=[jax.ShapeDtypeStruct((B, T, H, V), _F32), jax.ShapeDtypeStruct((B, H, K, V), _F32)],
        scratch_types=scratch, grid=(V // bv, H, B), grid_names=("v_block", "head", "batch"),
        compiler_params=plgpu.CompilerParams(), interpret=interpret or None,
    )(w, u, qg, kg, aqk, gend, initial_state.astype(_F32))


def forward(q, k, v, g, beta, gate_params, initial_state, *, seq_len, scale, lower_bound, interpret):
    """Chunked KDA forward: the intra kernel at ``CHUNK`` tokens, then the Mosaic GPU state walk.

    q, k, g [B, T, H, K]; v [B, T, H, V]; beta [B, T, H]; T a multiple of ``CHUNK``; gate_params None
    or (exp(A_log) [H, K], dt_bias [H, K]) float32 (then g holds the raw z, beta the logits and q, k
    are not normalized); initial_state [B, H, K, V] float32. ``interpret``: False on the GPU, or
    ``interpret_params()`` on a CPU. Returns (o float32 [B, T, H, V], final_state float32 [B, H, K, V]).
    """
    if q.shape[1] % CHUNK:
        raise ValueError(f"T={q.shape[1]} must be a multiple of CHUNK={CHUNK}")
    w, u, qg, kg, aqk, gend = intra_chunk(q, k, v, g, beta, gate_params, seq_len=seq_len, scale=scale,
                                          blocks=_INTRA_BLOCKS, lower_bound=lower_bound)
    return state_walk(w, u, qg, kg, aqk, gend, initial_state, interpret=interpret)


__all__ = ["CHUNK", "BLOCK_V", "forward", "interpret_params", "state_walk", "wgmma_sum"]
