"""Pallas kernels for chunked KDA with the bounded gate (spec section 3), and the decode step.

Two kernels run a prefill; the README explains the maths and the tiling.

1. ``intra_chunk``, grid (B, H, chunks): everything inside one chunk of C = 16 * n tokens that does
   not depend on the state. The chunk is built of 16-token sub-tiles; a pair of sub-tiles (a, b)
   factors its decay exp(G_i - G_j) around a reference point r: the midpoint of the sub-tile on the
   diagonal (a == b; both factors within e^+-40 when every g >= -5), the last token of the earlier
   sub-tile off the diagonal (a > b; both factors <= 1). The (I + A_kk)^-1 solve inverts the 16x16
   diagonal blocks by recursive block doubling (matrix multiplies) and fills the off-diagonal blocks
   by block substitution.
   Writes W, U, A_qk, the decayed queries and keys and the chunk's total decay.
2. ``state_walk``, grid (B, H, V / block_v): walks the chunks in order with the state block
   [K, block_v] in registers; per chunk four matrix multiplies give the corrected values, the
   outputs and the next state.

Layouts: q, k, g [B, T, H, K]; v [B, T, H, V]; beta [B, T, H]; state [B, H, K, V] (float32).
T here is already padded to a whole number of chunks; ``seq_len`` masks the padding (g = 0,
beta = 0: padded tokens neither decay nor write).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._platform import interpret
from pallas_kernels._triton import triton_params

TILE = 16
LOWERINGS = ("auto", "triton", "mosaic_gpu", "mosaic_tpu")
_HI = jax.lax.Precision.HIGHEST
_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class KDABlocks:
    """Block sizes, dtypes and lowering of the KDA kernels.

    chunk:          tokens per step of the state walk, a multiple of 16 (built of 16-token sub-tiles)
    block_v:        value columns of the state per program of the state walk (divides V)
    inter_dtype:    dtype of W, U, A_qk, decayed q/k between the kernels and of the walk's matmul
                    operands ("bfloat16" or "float32"); the state itself stays float32
    warps_intra, warps_walk, stages_walk, warps_decode: Triton launch parameters (ignored off GPU)
    decode_block_v: value columns of the state per program of the decode step
    lowering:       "auto", "triton", "mosaic_gpu" or "mosaic_tpu" (``ops.resolve_lowering``); chunk and block
                    sizes above are the Triton kernels'; the Mosaic ones use their modules' own
    """

    chunk: int = 32
    block_v: int = 64
    inter_dtype: str = "bfloat16"
    warps_intra: int = 4
    warps_walk: int = 4
    stages_walk: int = 2
    decode_block_v: int = 64
    warps_decode: int = 4
    lowering: str = "auto"

    def __post_init__(self):
        if self.chunk % TILE or self.chunk <= 0:
            raise ValueError(f"chunk must be a positive multiple of {TILE}, got {self.chunk}")
        if self.lowering not in LOWERINGS:
            raise ValueError(f"lowering {self.lowering!r}; expected one of {LOWERINGS}")


def _sigmoid(x):
    return 1.0 / (1.0 + jnp.exp(-x))


def _l2_normalize(x, eps=1e-6):
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def _row(x, i):
    """Row i (static) of a [R, N] value as [N], by a masked sum (register tensors have no indexing)."""
    rows = jax.lax.broadcasted_iota(jnp.int32, x.shape, 0)
    return jnp.sum(jnp.where(rows == i, x, 0.0), axis=0)


def _unit_lower_inverse(lower):
    """(I + L)^-1 for a strictly lower-triangular [16, 16] L (float32), by doubling the diagonal blocks.

    With X the inverse of (I + L)'s block-diagonal part of block size s / 2, the inverse at block size s
    is X - X M X, where M keeps the entries of L inside a block of size s but outside the blocks of
    size s / 2. Starting from X = I - M at s = 2, three more levels (s = 4, 8, 16) need six matrix
    multiplies and no row extraction (as stable as forward substitution: each X is a true inverse).
    """
    n = lower.shape[0]
    rows = jax.lax.broadcasted_iota(jnp.int32, (n, n), 0)
    cols = jax.lax.broadcasted_iota(jnp.int32, (n, n), 1)
    level_entries = lambda s: jnp.where((rows // s == cols // s) & (rows // (s // 2) != cols // (s // 2)),
                                        lower, 0.0)
    inv = jnp.where(rows == cols, 1.0, 0.0) - level_entries(2)
    s = 4
    while s <= n:
        inv = inv - _dot(_dot(inv, level_entries(s), _HI), inv, _HI)
        s *= 2
    return inv


def _dot(a, b, precision=None):
    return jnp.dot(a, b, precision=precision, preferred_element_type=_F32)


def _dot_t(a, b):
    """a @ b^T with float32 accumulation."""
    return jnp.dot(a, b.T, preferred_element_type=_F32)


def _intra_chunk_kernel(*refs, seq_len, chunk, scale, fused, lower_bound):
    if fused:
        q_ref, k_ref, v_ref, g_ref, beta_ref, a_ref, dtb_ref, *outs = refs
    else:
        q_ref, k_ref, v_ref, g_ref, beta_ref, *outs = refs
    w_ref, u_ref, qg_ref, kg_ref, aqk_ref, gend_ref = outs
    n_sub = chunk // TILE
    chunk_start = pl.program_id(2) * chunk
    row = jax.lax.broadcasted_iota(jnp.int32, (TILE, TILE), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (TILE, TILE), 1)

    q, k, beta, G, mid, end = [], [], [], [], [], []
    before = jnp.zeros((g_ref.shape[-1],), _F32)  # G just before the sub-tile, from the chunk start
    for a in range(n_sub):
        rows = pl.ds(a * TILE, TILE)
        q_a, k_a = q_ref[rows, :].astype(_F32), k_ref[rows, :].astype(_F32)
        g_a, b_a = g_ref[rows, :].astype(_F32), beta_ref[rows].astype(_F32)
        if fused:  # raw inputs: L2-normalize q, k; bounded gate from z; sigmoid of the beta logits
            q_a, k_a = _l2_normalize(q_a), _l2_normalize(k_a)
            g_a = lower_bound * _sigmoid(a_ref[...][None, :] * (g_a + dtb_ref[...][None, :]))
            b_a = _sigmoid(b_a)
        valid = chunk_start + a * TILE + jax.lax.broadcasted_iota(jnp.int32, (TILE,), 0) < seq_len
        g_a = jnp.where(valid[:, None], g_a, 0.0)
        G_a = jnp.cumsum(g_a, axis=0) + before[None, :]  # [16, K] cumulative log decay
        q.append(q_a * scale)
        k.append(k_a)
        beta.append(jnp.where(valid, b_a, 0.0))
        G.append(G_a)
        mid.append(_row(G_a, TILE // 2 - 1))
        end.append(_row(G_a, TILE - 1))
        before = end[-1]
    G_chunk = end[-1]  # [K]

    # Outputs are written as soon as they are formed, so that their inputs die early (registers).
    out_dtype = w_ref.dtype
    for a in range(n_sub):
        rows = pl.ds(a * TILE, TILE)
        qg_ref[rows, :] = (q[a] * jnp.exp(G[a])).astype(out_dtype)
        kg_ref[rows, :] = (k[a] * jnp.exp(G_chunk[None, :] - G[a])).astype(out_dtype)

    # Decay-weighted Gram blocks A_kk (strictly lower, rows scaled by beta, kept) and A_qk (lower, written).
    k_before = [k[b] * jnp.exp(end[b][None, :] - G[b]) for b in range(n_sub)]  # factors <= 1
    zeros = jnp.zeros((TILE, TILE), out_dtype)
    akk = {}
    for a in range(n_sub):
        rows = pl.ds(a * TILE, TILE)
        for b in range(n_sub):
            if b > a:
                aqk_ref[rows, pl.ds(b * TILE, TILE)] = zeros
                continue
            if a == b:
                up, down = jnp.exp(G[a] - mid[a][None, :]), jnp.exp(mid[a][None, :] - G[a])
                k_right = k[a] * down
                kk = jnp.where(row > col, _dot_t(k[a] * up, k_right), 0.0)
                qk = jnp.where(row >= col, _dot_t(q[a] * up, k_right), 0.0)
            else:
                up = jnp.exp(G[a] - end[b][None, :])
                kk = _dot_t(k[a] * up, k_before[b])
                qk = _dot_t(q[a] * up, k_before[b])
            akk[a, b] = kk * beta[a][:, None]
            aqk_ref[rows, pl.ds(b * TILE, TILE)] = qk.astype(out_dtype)

    # (I + A_kk)^-1 by blocks: X_aa = inv(I + L_aa), X_ab = -X_aa sum_{c=b}^{a-1} L_ac X_cb.
    inv = {}
    for a in range(n_sub):
        inv[a, a] = _unit_lower_inverse(akk[a, a])
        for b in range(a):
            acc = _dot(akk[a, b], inv[b, b], _HI)
            for c in range(b + 1, a):
                acc = acc + _dot(akk[a, c], inv[c, b], _HI)
            inv[a, b] = -_dot(inv[a, a], acc, _HI)

    k_decayed = [beta[b][:, None] * jnp.exp(G[b]) * k[b] for b in range(n_sub)]
    v_beta = [beta[b][:, None] * v_ref[pl.ds(b * TILE, TILE), :].astype(_F32) for b in range(n_sub)]
    for a in range(n_sub):
        rows = pl.ds(a * TILE, TILE)
        w_ref[rows, :] = sum(_dot(inv[a, b], k_decayed[b]) for b in range(a + 1)).astype(out_dtype)
        u_ref[rows, :] = sum(_dot(inv[a, b], v_beta[b]) for b in range(a + 1)).astype(out_dtype)
    gend_ref[...] = jnp.exp(G_chunk)


def intra_chunk(q, k, v, g, beta, gate_params, *, seq_len, scale, blocks, lower_bound=0.0):
    """Per-chunk WY quantities. q, k, g [B, T, H, K] (T a multiple of the chunk); v [B, T, H, V];
    beta [B, T, H]; gate_params None, or (exp(A_log) [H, K], dt_bias [H, K]) float32 for the fused gate
    (then g holds the raw z, beta the logits and q, k are not yet normalized).

    Returns W, decayed q (scaled), decayed k [B, T, H, K]; U [B, T, H, V]; A_qk [B, T, H, C] (each row
    against its own chunk) in ``blocks.inter_dtype``; and the chunk decay exp(G_C) [B, T / C, H, K] f32.
    """
    B, T, H, K = q.shape
    V, C = v.shape[-1], blocks.chunk
    dtype = jnp.dtype(blocks.inter_dtype)
    fused = gate_params is not None
    tok = lambda width: pl.BlockSpec((None, C, None, width), lambda b, h, c: (b, c, h, 0))
    in_specs = [tok(K), tok(K), tok(V), tok(K), pl.BlockSpec((None, C, None), lambda b, h, c: (b, c, h))]
    args = [q, k, v, g, beta]
    if fused:
        in_specs += [pl.BlockSpec((None, K), lambda b, h, c: (h, 0))] * 2
        args += list(gate_params)
    out_shape = [
        jax.ShapeDtypeStruct((B, T, H, K), dtype),
        jax.ShapeDtypeStruct((B, T, H, V), dtype),
        jax.ShapeDtypeStruct((B, T, H, K), dtype),
        jax.ShapeDtypeStruct((B, T, H, K), dtype),
        jax.ShapeDtypeStruct((B, T, H, C), dtype),
        jax.ShapeDtypeStruct((B, T // C, H, K), _F32),
    ]
    out_specs = [tok(K), tok(V), tok(K), tok(K), tok(C),
                 pl.BlockSpec((None, None, None, K), lambda b, h, c: (b, c, h, 0))]
    kernel = functools.partial(_intra_chunk_kernel, seq_len=seq_len, chunk=C, scale=scale,
                               fused=fused, lower_bound=lower_bound)
    return pl.pallas_call(
        kernel, grid=(B, H, T // C), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        compiler_params=triton_params(blocks.warps_intra, 1, interpret()), interpret=interpret(),
        name="kda_intra_chunk",
    )(*args)


def _state_walk_kernel(*refs, chunk, n_chunks, has_initial_state):
    if has_initial_state:
        w_ref, u_ref, qg_ref, kg_ref, aqk_ref, gend_ref, h0_ref, o_ref, ht_ref = refs
        state = h0_ref[...].astype(_F32)
    else:
        w_ref, u_ref, qg_ref, kg_ref, aqk_ref, gend_ref, o_ref, ht_ref = refs
        state = jnp.zeros(ht_ref.shape, _F32)
    dtype = w_ref.dtype

    def step(c, state):  # state [K, block_v] float32, entering chunk c
        rows = pl.ds(c * chunk, chunk)
        s = state.astype(dtype)
        v_new = u_ref[rows, :].astype(_F32) - _dot(w_ref[rows, :], s)  # corrected values [C, bv]
        v_op = v_new.astype(dtype)
        o_ref[rows, :] = _dot(qg_ref[rows, :], s) + _dot(aqk_ref[rows, :], v_op)
        decay = gend_ref[c, :]  # [K]
        return decay[:, None] * state + _dot(kg_ref[rows, :].T, v_op)

    ht_ref[...] = jax.lax.fori_loop(0, n_chunks, step, state).astype(ht_ref.dtype)


def state_walk(w, u, qg, kg, aqk, gend, initial_state, *, blocks):
    """Sequential pass over chunks. Inputs from ``intra_chunk``; initial_state [B, H, K, V] or None.

    Returns o float32 [B, T, H, V] and the final state float32 [B, H, K, V].
    """
    B, T, H, K = w.shape
    V, C, bv = u.shape[-1], blocks.chunk, min(blocks.block_v, u.shape[-1])
    if V % bv:
        raise ValueError(f"block_v {bv} must divide V={V}")
    seq = lambda width: pl.BlockSpec((None, T, None, width), lambda b, h, j: (b, 0, h, 0))
    seq_v = pl.BlockSpec((None, T, None, bv), lambda b, h, j: (b, 0, h, j))
    state_spec = pl.BlockSpec((None, None, K, bv), lambda b, h, j: (b, h, 0, j))
    in_specs = [seq(K), seq_v, seq(K), seq(K), seq(C),
                pl.BlockSpec((None, T // C, None, K), lambda b, h, j: (b, 0, h, 0))]
    args = [w, u, qg, kg, aqk, gend]
    if initial_state is not None:
        in_specs.append(state_spec)
        args.append(initial_state.astype(_F32))
    kernel = functools.partial(_state_walk_kernel, chunk=C, n_chunks=T // C,
                               has_initial_state=initial_state is not None)
    return pl.pallas_call(
        kernel, grid=(B, H, V // bv), in_specs=in_specs, out_specs=[seq_v, state_spec],
        out_shape=[jax.ShapeDtypeStruct((B, T, H, V), _F32), jax.ShapeDtypeStruct((B, H, K, V), _F32)],
        compiler_params=triton_params(blocks.warps_walk, blocks.stages_walk, interpret()), interpret=interpret(),
        name="kda_state_walk",
    )(*args)


def _decode_update(q, k, v, g, beta, state, gate, *, scale, lower_bound):
    """One token's KDA update of a [K, bv] state block. q, k, g [K]; v [bv]; beta [1]; gate None, or
    (A_log [1], dt_bias [K]) for raw inputs. Returns (o [bv], new state [K, bv]), float32."""
    q, k, g, beta = (x.astype(_F32) for x in (q, k, g, beta))
    if gate is not None:  # raw inputs: L2-normalize q, k; bounded gate from z; sigmoid of the beta logit
        q, k = _l2_normalize(q), _l2_normalize(k)
        a_log, dt_bias = (x.astype(_F32) for x in gate)
        g = lower_bound * _sigmoid(jnp.exp(a_log) * (g + dt_bias))
        beta = _sigmoid(beta)
    state = state * jnp.exp(g)[:, None]  # decayed state
    # Both reductions read the decayed state, so they run together: with S' = S + (beta k) r^T,
    # o = S'^T q = S^T q + (beta k . q) r.
    sk, sq = jnp.sum(state * k[:, None], axis=0), jnp.sum(state * q[:, None], axis=0)  # [bv]
    residual = v.astype(_F32) - sk
    kb = k * beta
    return scale * (sq + jnp.sum(kb * q) * residual), state + kb[:, None] * residual[None, :]


def _decode_kernel(*refs, fused, **kw):
    """Blocked refs of one (batch, head, value block)."""
    if fused:
        q_ref, k_ref, v_ref, g_ref, beta_ref, a_ref, dtb_ref, s_ref, o_ref, s_out_ref = refs
        gate = (a_ref[...], dtb_ref[...])
    else:
        q_ref, k_ref, v_ref, g_ref, beta_ref, s_ref, o_ref, s_out_ref = refs
        gate = None
    o_ref[...], s_out_ref[...] = _decode_update(q_ref[...], k_ref[...], v_ref[...], g_ref[...], beta_ref[...],
                                                s_ref[...], gate, **kw)


def decode_step(q, k, v, g, beta, state, gate=None, *, scale, blocks, lower_bound=0.0):
    """One token per sequence: q, k, g [B, H, K]; v [B, H, V]; beta [B, H]; state [B, H, K, V] f32.
    gate None, or the layer's raw gate parameters (A_log [H], dt_bias [H, K]) for the fused gate (then
    g holds the raw z, beta the logits and q, k are not yet normalized). Inputs are read in their own
    dtypes (bf16 or float32) and converted in the kernel, and exp(A_log) is taken there too: at a
    batch-1 step each conversion in XLA would be a kernel launch of its own.

    Returns o float32 [B, H, V] and the new state (written over the input state's buffer).
    """
    B, H, K = q.shape
    V = v.shape[-1]
    bv = min(blocks.decode_block_v, V)
    fused = gate is not None
    args = [q, k, v, g, beta[..., None]] + ([gate[0].reshape(H, 1), gate[1]] if fused else [])
    vec = pl.BlockSpec((None, None, K), lambda b, h, j: (b, h, 0))
    v_spec = pl.BlockSpec((None, None, bv), lambda b, h, j: (b, h, j))
    s_spec = pl.BlockSpec((None, None, K, bv), lambda b, h, j: (b, h, 0, j))
    in_specs = [vec, vec, v_spec, vec, pl.BlockSpec((None, None, 1), lambda b, h, j: (b, h, 0))]
    if fused:
        in_specs += [pl.BlockSpec((None, 1), lambda b, h, j: (h, 0)), pl.BlockSpec((None, K), lambda b, h, j: (h, 0))]
    kernel = functools.partial(_decode_kernel, fused=fused, scale=scale, lower_bound=lower_bound)
    return pl.pallas_call(
        kernel, grid=(B, H, V // bv), in_specs=in_specs + [s_spec], out_specs=[v_spec, s_spec],
        out_shape=[jax.ShapeDtypeStruct((B, H, V), _F32), jax.ShapeDtypeStruct((B, H, K, V), _F32)],
        input_output_aliases={len(args): 1}, compiler_params=triton_params(blocks.warps_decode, 1, interpret()),
        interpret=interpret(),
        name="kda_decode_step",
    )(*args, state.astype(_F32))


__all__ = ["TILE", "KDABlocks", "intra_chunk", "state_walk", "decode_step"]
