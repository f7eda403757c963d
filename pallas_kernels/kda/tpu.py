"""Chunked KDA forward and decode step for Pallas' Mosaic TPU lowering (bounded gate, spec section 3).

Same maths and contracts as ``kernel.py`` (the Triton kernels); README.md, section "TPU (Mosaic TPU)",
explains the tiling. In short:

``forward``: one fused kernel, grid (B, H, T / chunk), the chunk axis sequential ("arbitrary"). The
wrapper transposes the inputs to [B, H, T, K] so that a block is (chunk tokens on sublanes, K on
lanes). Each program forms the chunk's cumulative log decay G (a triangular matmul: Mosaic has no
cumsum), the decay-weighted Gram matrices A_kk, A_qk [chunk, chunk], the inverse (I + A_kk)^-1 (float32,
HIGHEST), W and U, and then, with the float32 state [K, V] kept in a VMEM scratch across chunks, the
outputs and the next state. The decay factorization stays per 16-token sub-tile as in ``kernel.py``:
exp(G_i - G_j) = exp(G_i - r) exp(r - G_j) with r the sub-tile midpoint on the diagonal blocks (both
factors within e^+-40 when every g >= -5) and r the last token of the earlier sub-tile off the
diagonal (both factors <= 1). Off the diagonal each earlier sub-tile b gives one [chunk, chunk] product
whose rows are the later sub-tiles and whose columns are b's tokens, so every matmul is chunk x K x
chunk rather than 16 x K x 16.

``decode_step``: grid (B, H); each program reads the [K, V] state once, applies decay, delta correction
and output elementwise in float32 (q, k, g as [K, 1] columns, so no relayout is needed), and writes
the state back over its input buffer.

Matmul precision: bf16 operands with float32 accumulation for the Gram matrices, W, U and the state
products (``kernel.py``'s ``inter_dtype`` bf16); float32 HIGHEST for the cumulative sum and the
triangular inverse. The state and all accumulators are float32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

TILE = 16
DEFAULT_CHUNK = 64  # four 16-token sub-tiles: [64, 128] x [128, 64] Gram products for the MXU
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


def _chunk_inputs(q_ref, k_ref, g_ref, beta_ref, gate_refs, first_token, *, seq_len, scale, lower_bound):
    """q (scaled), k, g [C, K] and beta [C, 1] in float32; tokens at or after ``seq_len`` get g = 0 and
    beta = 0. With ``gate_refs`` (exp(A_log), dt_bias as [1, K]) the refs hold raw inputs: q, k are
    L2-normalized, g = lower_bound * sigmoid(exp(A_log) (z + dt_bias)) and beta = sigmoid(logits)."""
    q, k = q_ref[...].astype(_F32), k_ref[...].astype(_F32)
    g, beta = g_ref[...].astype(_F32), beta_ref[...].astype(_F32)
    if gate_refs:
        a_ref, dtb_ref = gate_refs
        q, k = _l2_normalize(q, axis=1), _l2_normalize(k, axis=1)
        g = lower_bound * _sigmoid(a_ref[...] * (g + dtb_ref[...]))
        beta = _sigmoid(beta)
    valid = lambda x: first_token + _iota(x.shape, 0) < seq_len  # a mask of x's own shape
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
    C = q_ref.shape[0]
    c = pl.program_id(2)

    @pl.when(c == 0)
    def _():
        state_ref[...] = h0_ref[...]

    q, k, g, beta = _chunk_inputs(q_ref, k_ref, g_ref, beta_ref, gate_refs, c * C, seq_len=seq_len,
                                  scale=scale, lower_bound=lower_bound)
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
    ``chunk`` (a multiple of 16); tokens at or after ``seq_len`` get g = 0 and beta = 0.
    gate_params None, or (exp(A_log) [H, K], dt_bias [H, K]) float32 for the fused gate (then g holds
    the raw z, beta the logits and q, k are not yet normalized). initial_state [B, H, K, V] float32.
    ``interpret``: False on a TPU, or a ``pltpu.InterpretParams()`` elsewhere.

    Returns (o float32 [B, T, H, V], final_state float32 [B, H, K, V]).
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    if chunk % TILE or T % chunk:
        raise ValueError(f"chunk {chunk} must be a multiple of {TILE} dividing T={T}")
    heads_first = lambda x: jnp.swapaxes(x, 1, 2)  # [B, T, H, ...] -> [B, H, T, ...]
    tok = lambda width: pl.BlockSpec((None, None, chunk, width), lambda b, h, c: (b, h, c, 0))
    state_spec = pl.BlockSpec((None, None, K, V), lambda b, h, c: (b, h, 0, 0))
    in_specs = [tok(K), tok(K), tok(V), tok(K), tok(1)]
    args = [heads_first(q), heads_first(k), heads_first(v), heads_first(g), heads_first(beta)[..., None]]
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
    return heads_first(o), state


def _decode_kernel(*refs, scale, lower_bound, fused):
    q_ref, k_ref, v_ref, g_ref, beta_ref, *refs = refs
    gate_refs, (s_ref, o_ref, s_out_ref) = (refs[:2], refs[2:]) if fused else ((), refs)
    q, k, g = q_ref[...].astype(_F32), k_ref[...].astype(_F32), g_ref[...].astype(_F32)  # [K, 1]
    beta = beta_ref[...].astype(_F32)  # [1, 1]
    if fused:
        a_ref, dtb_ref = gate_refs
        q, k = _l2_normalize(q, axis=0), _l2_normalize(k, axis=0)
        g = lower_bound * _sigmoid(a_ref[...] * (g + dtb_ref[...]))
        beta = _sigmoid(beta)
    state = s_ref[...] * jnp.exp(g)  # [K, V]
    residual = v_ref[...].astype(_F32) - jnp.sum(state * k, axis=0, keepdims=True)  # [1, V]
    state = state + (k * beta) * residual
    o_ref[...] = jnp.sum(state * (q * scale), axis=0, keepdims=True)
    s_out_ref[...] = state


def decode_step(q, k, v, g, beta, state, gate_params=None, *, scale, lower_bound=0.0, interpret):
    """One token per sequence: q, k, g [B, H, K]; v [B, H, V]; beta [B, H]; state [B, H, K, V] float32.
    gate_params as in ``forward`` (fused gate, norms and sigmoid). ``interpret`` as in ``forward``.

    Returns (o float32 [B, H, V], new state), the state written over the input state's buffer.
    """
    B, H, K = q.shape
    V = v.shape[-1]
    column = lambda n: pl.BlockSpec((None, None, n, 1), lambda b, h: (b, h, 0, 0))
    v_spec = pl.BlockSpec((None, None, 1, V), lambda b, h: (b, h, 0, 0))
    s_spec = pl.BlockSpec((None, None, K, V), lambda b, h: (b, h, 0, 0))
    in_specs = [column(K), column(K), v_spec, column(K), column(1)]
    args = [q[..., None], k[..., None], v[:, :, None], g[..., None], beta[..., None, None]]
    if gate_params is not None:
        in_specs += [pl.BlockSpec((None, K, 1), lambda b, h: (h, 0, 0))] * 2
        args += [p.astype(_F32)[..., None] for p in gate_params]
    kernel = functools.partial(_decode_kernel, scale=scale, lower_bound=lower_bound,
                               fused=gate_params is not None)
    o, state = pl.pallas_call(
        kernel, grid=(B, H),
        in_specs=in_specs + [s_spec], out_specs=[v_spec, s_spec],
        out_shape=[jax.ShapeDtypeStruct((B, H, 1, V), _F32), jax.ShapeDtypeStruct((B, H, K, V), _F32)],
        input_output_aliases={len(args): 1},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=interpret, name="kda_decode_step_tpu",
    )(*args, state.astype(_F32))
    return o[:, :, 0], state


__all__ = ["TILE", "DEFAULT_CHUNK", "forward", "decode_step"]
