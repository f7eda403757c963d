"""Chunked KDA forward and decode step for Pallas' Mosaic TPU lowering (bounded gate, spec section 3).

Same maths and contracts as ``triton.py`` (the Triton kernels); README.md, section "TPU (Mosaic TPU)",
has the details. In short:

``forward``: one fused kernel, grid (B, H, T / chunk) with the chunk axis sequential ("arbitrary"),
the float32 state [K, V] in a VMEM scratch across chunks. The wrapper transposes q, k, v, g to
[B, H, T, *] so that a block is (chunk tokens on sublanes, K or V on lanes); beta goes in as
[B, H, T / chunk, chunk], one whole (batch, head) row block fetched once. Per chunk: the cumulative
log decay G (a triangular matmul; Pallas TPU has no cumsum), the decay-weighted Gram matrices A_kk,
A_qk [chunk, chunk], (I + A_kk)^-1, W and U, then the outputs and the next state. The decay
factorization stays per 16-token sub-tile as in ``triton.py``: exp(G_i - G_j) = exp(G_i - r)
exp(r - G_j), r the sub-tile midpoint on the diagonal blocks (both factors within e^+-40 when every
g >= -5) and the last token of the earlier sub-tile off the diagonal (both factors <= 1). Each
earlier sub-tile b gives one [chunk, K] x [K, chunk] product (rows: the later sub-tiles; columns: b's
tokens), so the MXU sees chunk-sized products rather than 16 x 16 blocks.

``decode_step``: grid (B, H / 8); a program takes 8 heads (whole (8, 128) tiles of q, k, g, v),
reads each head's [K, V] state once, applies decay, delta correction and output elementwise in float32
and writes the state back over its input buffer.

Matmuls: float32 at HIGHEST precision for what ``triton.py`` computes in float32 (G, the Gram matrices,
the triangular inverse, W, U); bf16 operands with float32 accumulation for the four state products
(``triton.py``'s ``inter_dtype`` bf16): W S, (q exp G) S, A_qk V', (k exp(G_C - G))^T V'.

Verified on CPU only: TPU interpret mode for the values, and lowering for the TPU platform
(``tests/kernels/kda/test_tpu.py``), which covers Pallas' Mosaic TPU lowering but not Mosaic's own layout
passes and compiler (in libtpu, on a real TPU). Not yet run on a TPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

TILE = 16
DEFAULT_CHUNK = 64  # four 16-token sub-tiles: [64, 128] x [128, 64] Gram products for the MXU
DECODE_HEADS = 8  # heads per decode program: [8, K] blocks of q, k, g, v (one f32 sublane tile)
_HI = jax.lax.Precision.HIGHEST
_F32 = jnp.float32
_BF16 = jnp.bfloat16
_A_B = (((1,), (0,)), ((), ()))  # a @ b
_A_BT = (((1,), (1,)), ((), ()))  # a @ b^T
_AT_B = (((0,), (0,)), ((), ()))  # a^T @ b (contracting the token axis)


def _sigmoid(x):
    return 1.0 / (1.0 + jnp.exp(-x))


def _l2_normalize(x, axis, eps=1e-6):
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=axis, keepdims=True) + eps)


def _matmul(a, b, contract=_A_B, *, precise):
    """a and b contracted as ``contract`` says, float32 accumulation: float32 operands at HIGHEST
    precision when ``precise``, else bf16 operands (one MXU pass)."""
    if precise:
        return jax.lax.dot_general(a, b, contract, precision=_HI, preferred_element_type=_F32)
    return jax.lax.dot_general(a.astype(_BF16), b.astype(_BF16), contract, preferred_element_type=_F32)


def _iota(shape, axis, block=1):
    """int32 index along ``axis`` of blocks of ``block`` elements (truncating ``lax.div``: ``//``'s sign
    fix-up lowers through a query of the TPU generation)."""
    return jax.lax.div(jax.lax.broadcasted_iota(jnp.int32, shape, axis), jnp.int32(block))


def _row(x, i):
    """Row i (static) of a [R, N] value as [1, N], by a masked sublane sum (no unaligned slicing)."""
    return jnp.sum(jnp.where(_iota(x.shape, 0) == i, x, 0.0), axis=0, keepdims=True)


def _row_to_column(x):
    """A [1, N] row as an [N, 1] column, by a masked lane sum over the diagonal (no relayout)."""
    n = x.shape[1]
    eye = _iota((n, n), 0) == _iota((n, n), 1)
    return jnp.sum(jnp.where(eye, jnp.broadcast_to(x, (n, n)), 0.0), axis=1, keepdims=True)


def _unit_lower_inverse(lower):
    """(I + L)^-1 for a strictly lower-triangular [C, C] L (float32), by doubling the diagonal blocks.

    With X the inverse of (I + L)'s block-diagonal part of block size s / 2, the inverse at block size
    s is X - X M X, M keeping the entries of L inside blocks of size s but outside those of size s / 2
    (the 2 x 2 block-triangular inverse; a last, shorter block is handled the same way). From
    X = I - M at s = 2, levels s = 4, 8, ... up to the first s >= C, two HIGHEST matmuls each.
    """
    n = lower.shape[0]
    rows, cols = _iota((n, n), 0), _iota((n, n), 1)

    def level_entries(s):
        same = lambda size: _iota((n, n), 0, size) == _iota((n, n), 1, size)
        return jnp.where(same(s) & ~same(s // 2), lower, 0.0)

    inv = jnp.where(rows == cols, 1.0, 0.0) - level_entries(2)
    s = 4
    while s // 2 < n:
        inv = inv - _matmul(_matmul(inv, level_entries(s), precise=True), inv, precise=True)
        s *= 2
    return inv


def _chunk_inputs(q_ref, k_ref, g_ref, beta_ref, gate_refs, c, *, seq_len, scale, lower_bound):
    """Chunk c's q (scaled), k, g [C, K] and beta [C, 1] in float32; tokens at or after ``seq_len`` get
    g = 0 and beta = 0. ``beta_ref`` holds the whole sequence's beta as [T / C, C] (row c is this chunk).
    With ``gate_refs`` (exp(A_log), dt_bias as [1, K]) the refs hold raw inputs: q, k are L2-normalized,
    g = lower_bound * sigmoid(exp(A_log) (z + dt_bias)) and beta = sigmoid(logits)."""
    q, k, g = q_ref[...].astype(_F32), k_ref[...].astype(_F32), g_ref[...].astype(_F32)
    beta = beta_ref[pl.ds(c, 1), :].astype(_F32)  # [1, C]
    if gate_refs:
        a_ref, dtb_ref = gate_refs
        q, k = _l2_normalize(q, axis=1), _l2_normalize(k, axis=1)
        g = lower_bound * _sigmoid(a_ref[...] * (g + dtb_ref[...]))
        beta = _sigmoid(beta)
    beta = _row_to_column(beta)
    valid = lambda x: c * x.shape[0] + _iota(x.shape, 0) < seq_len  # a mask of x's own shape
    return q * scale, k, jnp.where(valid(g), g, 0.0), jnp.where(valid(beta), beta, 0.0)


def _decayed_grams(q, k, G):
    """sum_d x_id k_jd exp(G_id - G_jd) [C, C] for x = k and x = q, for token pairs whose sub-tiles
    satisfy sub(j) <= sub(i) (whole diagonal blocks: the caller applies the causal mask); 0 elsewhere.

    Diagonal blocks factor around their sub-tile's midpoint (8th token); the later rows against an
    earlier sub-tile b around b's last token, by one [C, C] product per b.
    """
    C = G.shape[0]
    sub = _iota(G.shape, 0, TILE)  # sub-tile of each row, [C, K]
    same_tile = _iota((C, C), 0, TILE) == _iota((C, C), 1, TILE)
    mid = sum(jnp.where(sub == a, _row(G, a * TILE + TILE // 2 - 1), 0.0) for a in range(C // TILE))
    up, k_right = jnp.exp(G - mid), k * jnp.exp(mid - G)  # within e^+-40
    kk = jnp.where(same_tile, _matmul(k * up, k_right, _A_BT, precise=True), 0.0)
    qk = jnp.where(same_tile, _matmul(q * up, k_right, _A_BT, precise=True), 0.0)
    for b in range(C // TILE - 1):
        end = _row(G, b * TILE + TILE - 1)
        up = jnp.where(sub > b, jnp.exp(jnp.minimum(G - end, 0.0)), 0.0)  # rows after b: <= 1
        k_right = jnp.where(sub == b, k * jnp.exp(jnp.minimum(end - G, 0.0)), 0.0)  # b's rows: <= 1
        kk = kk + _matmul(k * up, k_right, _A_BT, precise=True)
        qk = qk + _matmul(q * up, k_right, _A_BT, precise=True)
    return kk, qk


def _intra_chunk(q, k, v, g, beta):
    """The state-independent part of one chunk (float32): decayed queries q exp(G), keys
    k exp(G_C - G), A_qk [C, C] (causal), W = (I + A_kk)^-1 Diag(beta) (exp(G) K),
    U = (I + A_kk)^-1 Diag(beta) V and the chunk decay exp(G_C) [1, K]."""
    C = g.shape[0]
    rows, cols = _iota((C, C), 0), _iota((C, C), 1)
    G = _matmul(jnp.where(rows >= cols, 1.0, 0.0), g, precise=True)  # cumulative log decay (no cumsum)
    G_end = _row(G, C - 1)
    kk, qk = _decayed_grams(q, k, G)
    inv = _unit_lower_inverse(jnp.where(rows > cols, kk, 0.0) * beta)
    w = _matmul(inv, beta * jnp.exp(G) * k, precise=True)
    u = _matmul(inv, beta * v, precise=True)
    return q * jnp.exp(G), k * jnp.exp(G_end - G), jnp.where(rows >= cols, qk, 0.0), w, u, jnp.exp(G_end)


def _chunk_kernel(*refs, seq_len, scale, lower_bound, fused):
    q_ref, k_ref, v_ref, g_ref, beta_ref, *refs = refs
    gate_refs, (h0_ref, o_ref, ht_ref, state_ref) = (refs[:2], refs[2:]) if fused else ((), refs)
    c = pl.program_id(2)

    @pl.when(c == 0)
    def _():
        state_ref[...] = h0_ref[...]

    q, k, g, beta = _chunk_inputs(q_ref, k_ref, g_ref, beta_ref, gate_refs, c, seq_len=seq_len, scale=scale,
                                  lower_bound=lower_bound)
    qg, kg, aqk, w, u, decay = _intra_chunk(q, k, v_ref[...].astype(_F32), g, beta)
    state = state_ref[...]  # [K, V] float32, entering this chunk
    v_new = u - _matmul(w, state, precise=False)  # corrected values
    o_ref[...] = _matmul(qg, state, precise=False) + _matmul(aqk, v_new, precise=False)
    state_ref[...] = _row_to_column(decay) * state + _matmul(kg, v_new, _AT_B, precise=False)

    @pl.when(c == pl.num_programs(2) - 1)
    def _():
        ht_ref[...] = state_ref[...]


def forward(q, k, v, g, beta, gate_params, initial_state, *, seq_len, scale, lower_bound, chunk, interpret):
    """Chunked KDA prefill. q, k, g [B, T, H, K]; v [B, T, H, V]; beta [B, T, H]; T a multiple of
    ``chunk`` (a multiple of 16; ``DEFAULT_CHUNK`` = 64); tokens at or after ``seq_len`` get g = 0 and
    beta = 0.
    gate_params None, or (exp(A_log) [H, K], dt_bias [H, K]) float32 for the fused gate (then g holds
    the raw z, beta the logits and q, k are not yet normalized). initial_state [B, H, K, V] float32.
    ``interpret``: False on a TPU, or a ``pltpu.InterpretParams()`` elsewhere.

    Returns (o float32 [B, T, H, V], final_state float32 [B, H, K, V]).
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    if chunk % TILE or T % chunk:
        raise ValueError(f"chunk {chunk} must be a multiple of {TILE} dividing T={T}")
    swap = lambda x: jnp.swapaxes(x, 1, 2)  # [B, T, H, ...] <-> [B, H, T, ...]
    tok = lambda width: pl.BlockSpec((None, None, chunk, width), lambda b, h, c: (b, h, c, 0))
    state_spec = pl.BlockSpec((None, None, K, V), lambda b, h, c: (b, h, 0, 0))
    beta_spec = pl.BlockSpec((None, None, T // chunk, chunk), lambda b, h, c: (b, h, 0, 0))  # fetched once
    in_specs = [tok(K), tok(K), tok(V), tok(K), beta_spec]
    args = [swap(q), swap(k), swap(v), swap(g), swap(beta).reshape(B, H, T // chunk, chunk)]
    if gate_params is not None:
        in_specs += [pl.BlockSpec((None, 1, K), lambda b, h, c: (h, 0, 0))] * 2
        args += [p.astype(_F32).reshape(H, 1, K) for p in gate_params]
    kernel = functools.partial(_chunk_kernel, seq_len=seq_len, scale=scale, lower_bound=lower_bound,
                               fused=gate_params is not None)
    o, state = pl.pallas_call(
        kernel, grid=(B, H, T // chunk),
        in_specs=in_specs + [state_spec], out_specs=[tok(V), state_spec],
        out_shape=[jax.ShapeDtypeStruct((B, H, T, V), _F32), jax.ShapeDtypeStruct((B, H, K, V), _F32)],
        scratch_shapes=[pltpu.VMEM((K, V), _F32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret, name="kda_chunk_tpu",
    )(*args, initial_state.astype(_F32))
    return swap(o), state


def _decode_head(j, q_ref, k_ref, v_ref, g_ref, beta_ref, gate_refs, s_ref, o_ref, s_out_ref, *, scale,
                 lower_bound):
    """Head j (static) of the program's block: rows j of q, k, g [heads, K], v [heads, V], beta
    [heads, 1] and state j [K, V]; the decay, delta correction and output elementwise in float32."""
    head = pl.ds(j, 1)
    q, k, g = (ref[head, :].astype(_F32) for ref in (q_ref, k_ref, g_ref))  # [1, K]
    beta = beta_ref[head, :].astype(_F32)  # [1, 1]
    if gate_refs:
        a_ref, dtb_ref = gate_refs
        q, k = _l2_normalize(q, axis=1), _l2_normalize(k, axis=1)
        g = lower_bound * _sigmoid(a_ref[head, :] * (g + dtb_ref[head, :]))
        beta = _sigmoid(beta)
    q, k, g = _row_to_column(q * scale), _row_to_column(k), _row_to_column(g)  # [K, 1]
    state = s_ref[j] * jnp.exp(g)  # [K, V]
    residual = v_ref[head, :].astype(_F32) - jnp.sum(state * k, axis=0, keepdims=True)  # [1, V]
    state = state + (k * beta) * residual
    o_ref[head, :] = jnp.sum(state * q, axis=0, keepdims=True)
    s_out_ref[j] = state


def _decode_kernel(*refs, scale, lower_bound, fused):
    q_ref, k_ref, v_ref, g_ref, beta_ref, *refs = refs
    gate_refs, (s_ref, o_ref, s_out_ref) = (refs[:2], refs[2:]) if fused else ((), refs)
    for j in range(q_ref.shape[0]):
        _decode_head(j, q_ref, k_ref, v_ref, g_ref, beta_ref, gate_refs, s_ref, o_ref, s_out_ref, scale=scale,
                     lower_bound=lower_bound)


def decode_step(q, k, v, g, beta, state, gate_params=None, *, scale, lower_bound=0.0, interpret):
    """One token per sequence: q, k, g [B, H, K]; v [B, H, V]; beta [B, H]; state [B, H, K, V] float32.
    gate_params as in ``forward`` (fused gate, norms and sigmoid). ``interpret`` as in ``forward``.

    Grid (B, H / heads): a program takes ``heads`` = 8 heads (all H when H is not a multiple of 8), so
    q, k, g, v come in as [heads, K] and [heads, V] blocks rather than single rows padded to 8 sublanes.
    Returns (o float32 [B, H, V], new state), the state written over the input state's buffer.
    """
    B, H, K = q.shape
    V = v.shape[-1]
    heads = DECODE_HEADS if H % DECODE_HEADS == 0 else H
    rows = lambda n: pl.BlockSpec((None, heads, n), lambda b, h: (b, h, 0))
    s_spec = pl.BlockSpec((None, heads, K, V), lambda b, h: (b, h, 0, 0))
    in_specs = [rows(K), rows(K), rows(V), rows(K), rows(1)]
    args = [q, k, v, g, beta[..., None]]
    if gate_params is not None:
        in_specs += [pl.BlockSpec((heads, K), lambda b, h: (h, 0))] * 2
        args += [p.astype(_F32) for p in gate_params]
    kernel = functools.partial(_decode_kernel, scale=scale, lower_bound=lower_bound,
                               fused=gate_params is not None)
    return pl.pallas_call(
        kernel, grid=(B, H // heads),
        in_specs=in_specs + [s_spec], out_specs=[rows(V), s_spec],
        out_shape=[jax.ShapeDtypeStruct((B, H, V), _F32), jax.ShapeDtypeStruct((B, H, K, V), _F32)],
        input_output_aliases={len(args): 1},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=interpret, name="kda_decode_step_tpu",
    )(*args, state.astype(_F32))


__all__ = ["TILE", "DEFAULT_CHUNK", "DECODE_HEADS", "forward", "decode_step"]
