"""KDA intra-chunk kernel lowered through Mosaic GPU (Hopper wgmma, TMA): correct on the H200, and
about 5x slower there than the Triton intra kernel (8.65 against 1.74 ms at B1 T8192 H96 K=V=128;
benchmarks/RESULTS.md, issue 5, run 5), so ``ops`` does not use it.

``intra_chunk`` has the contract of ``kernel.intra_chunk`` at chunk ``CHUNK`` = 32 (two 16-token
sub-tiles) with bf16 outputs, so ``mosaic_gpu.state_walk(*intra_chunk(...), initial_state, ...)`` is
a whole Mosaic GPU forward. Grid (T / 32, H, B), one warpgroup per chunk; the maths is kernel.py's:

- Tiles: wgmma multiplies 64 rows per warpgroup and a chunk has 32 tokens, so the 64-row register
  tiles stack two 32-row halves. The token tile holds the keys on top (rows 0-31) and the scaled
  queries below (rows 32-63); g is brought in twice, so G and every per-token value exist on both
  halves, and one product gives A_kk (top) and A_qk (bottom). The normalized, scaled token tile
  waits in float32 shared memory and is loaded where it is used (fewer live registers).
- G: a product of a 0/1 selection matrix ([64, 32], bf16, exact; token i sums tokens m <= i) with g
  split into three bf16 pieces (hi + mid + lo = g to float32 precision), float32 accumulation. The
  sub-tile references (G at the midpoint of each sub-tile, G at the last token of sub-tile 0) and G_C
  are rows of G, taken by masked column sums.
- Gram blocks: (x exp(G - r)) (k exp(r - G))^T per reference as kernel.py, the diagonal blocks
  around the sub-tile midpoint, the (1, 0) block around the last token of sub-tile 0; operands split
  into two bf16 pieces (hi hi + hi lo + lo hi: about 16 significant bits, more than the 11 of TF32,
  which the Triton kernel's default-precision float32 products use on a GPU), the keys' tile read
  transposed.
- (I + A_kk)^-1: the 16x16 diagonal blocks by the same block doubling as kernel.py (levels 2 to 16),
  then the (1, 0) block by substitution, X_10 = -X_11 (L_10 X_00); every product by wgmma on two
  bf16 pieces of each factor (hi hi + hi lo + lo hi). A float32 loop on the CUDA cores (one row
  reduction and one shared-memory row per inner index) took 15.0 ms where this takes 8.9.
- W = (X Diag(beta)) (exp(G) k) and U = (X Diag(beta)) v by wgmma, X Diag(beta) and exp(G) k in two
  bf16 pieces each, v as it comes (bf16).

In interpret mode (``mosaic_gpu.interpret_params()``, CPU) the kernel is the same except that register
layouts are not cast (the interpreter keeps no layouts) and the transposed products are plain matrix
products of the loaded tiles (JAX 0.10's interpreted wgmma takes no transposed operand).

Layouts: q, k, g [B, T, H, K]; v [B, T, H, V]; beta [B, T, H]; T a multiple of ``CHUNK``; ``seq_len``
the unpadded length (tokens at or after it get g = 0, beta = 0). beta goes to the kernel as float32
[B, H, T] (one XLA transpose) so that a chunk's betas are contiguous for TMA (Pallas' Mosaic GPU
copies move multiples of 128 bytes: 32 float32 values, where 32 bf16 logits would be 64 bytes).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.kda.mosaic_gpu import CHUNK, WGMMA_ROWS, wgmma_sum

SUB = 16  # tokens per sub-tile
_F32, _BF16 = jnp.float32, jnp.bfloat16
_N_LOADS = 9  # k, q, g twice, v, beta twice, exp(A_log), dt_bias


def _tile(shape, dtype=_BF16):
    """A swizzled shared-memory tile. bf16: 64-byte swizzle rows (32 values), the swizzle of every
    wgmma operand here (a product's operands share one, and the 32-token contractions fix it at 64
    bytes); float32 (g): 128-byte rows."""
    row_bytes = 64 if jnp.dtype(dtype) == _BF16 else 128
    transforms = (plgpu.TilingTransform((8, row_bytes // jnp.dtype(dtype).itemsize)),
                  plgpu.SwizzleTransform(row_bytes))
    return plgpu.SMEM(shape, dtype, transforms=transforms)


def _cast(x, layout, interpret):
    """x in a Mosaic GPU register layout; the interpreter keeps no layouts (no ``layout_cast`` rule)."""
    return x if interpret else plgpu.layout_cast(x, layout)


def _load(ref, layout, interpret):
    return _cast(ref[...], layout, interpret)


def _iota(shape, dim, layout, interpret):
    return _cast(jax.lax.broadcasted_iota(jnp.int32, shape, dim), layout, interpret)


def _per_row(vector, shape):
    """A [rows] vector broadcast along the columns of a [rows, cols] tile."""
    return jax.lax.broadcast_in_dim(vector, shape, [0])


def _per_col(vector, shape):
    """A [cols] vector broadcast along the rows of a [rows, cols] tile."""
    return jax.lax.broadcast_in_dim(vector, shape, [1])


def _sigmoid(x):
    return 1.0 / (1.0 + jnp.exp(-x))


def _store_pieces(refs, x):
    """x (float32) as len(refs) bf16 pieces whose sum is x to 8 * len(refs) significant bits."""
    rest = x
    for ref in refs:
        piece = rest.astype(_BF16)
        ref[...] = piece
        rest = rest - piece.astype(_F32)


def _product_t(shape, pairs, interpret):
    """sum(lhs @ rhs^T): wgmma with rhs transposed in shared memory; in interpret mode (whose wgmma
    takes no transposed operand) the products of the loaded tiles."""
    if interpret:
        return sum(jnp.dot(lhs[...], rhs[...].T, preferred_element_type=_F32) for lhs, rhs in pairs)
    return wgmma_sum(shape, [(lhs, plgpu.transpose_ref(rhs, (1, 0))) for lhs, rhs in pairs])


def _matmul_pieces(a, b, a_s, b_s):
    """a @ b for [64, 32] tiles holding 32x32 matrices in rows 0-31 (rows 32-63 zero) by wgmma: two
    bf16 pieces of each factor in ``a_s`` and ``b_s`` ([2, 64, 32]), hi hi + hi lo + lo hi."""
    _store_pieces([a_s.at[0], a_s.at[1]], a)
    _store_pieces([b_s.at[0], b_s.at[1]], b)
    plgpu.commit_smem()
    top = pl.ds(0, CHUNK)
    return wgmma_sum((WGMMA_ROWS, CHUNK), [(a_s.at[0], b_s.at[0, top]), (a_s.at[0], b_s.at[1, top]),
                                           (a_s.at[1], b_s.at[0, top])])


def _intra_kernel(*refs, seq_len, scale, lower_bound, fused, interpret):
    """One (chunk, head, batch) program."""
    (q_g, k_g, v_g, g_g, beta_g), rest = refs[:5], refs[5:]
    if fused:
        (a_g, dtb_g), rest = rest[:2], rest[2:]
    (w_g, u_g, qg_g, kg_g, aqk_g, gend_g, x_s, xf_s, g_s, v_s, beta_s, gate_s, sel_s, lhs_s, pool_s, mat_s,
     u_s, aqk_s, gend_s, bars) = rest
    c, h, b = jax.lax.axis_index("chunk"), jax.lax.axis_index("head"), jax.lax.axis_index("batch")
    K, V = x_s.shape[1], v_s.shape[1]
    C = CHUNK
    top, bottom = pl.ds(0, C), pl.ds(C, C)
    tokens = pl.ds(c * C, C)
    wgmma, row_vec, col_vec = plgpu.Layout.WGMMA, plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0)

    copies = [(k_g.at[b, tokens, h], x_s.at[top]), (q_g.at[b, tokens, h], x_s.at[bottom]),
              (g_g.at[b, tokens, h], g_s.at[top]), (g_g.at[b, tokens, h], g_s.at[bottom]),
              (v_g.at[b, tokens, h], v_s.at[top]), (beta_g.at[b, h, tokens], beta_s.at[top]),
              (beta_g.at[b, h, tokens], beta_s.at[bottom])]
    if fused:
        copies += [(a_g.at[h], gate_s.at[0]), (dtb_g.at[h], gate_s.at[1])]
    for i, (src, dst) in enumerate(copies):
        plgpu.copy_gmem_to_smem(src, dst, bars.at[i])
    for i in range(len(copies)):
        plgpu.barrier_wait(bars.at[i])

    row_ids = _iota((WGMMA_ROWS,), 0, row_vec, interpret)
    token_row = jax.lax.rem(row_ids, C)  # token of each row on both halves
    rows = _iota((WGMMA_ROWS, C), 0, wgmma, interpret)
    cols = _iota((WGMMA_ROWS, C), 1, wgmma, interpret)
    token = jax.lax.rem(rows, C)
    start = c * C
    tile = (WGMMA_ROWS, K)
    on_rows = lambda cond: _per_row(jnp.where(cond, 1.0, 0.0), tile)  # 0/1 per row of a [64, K] tile

    # The token tile (keys on top, scaled queries below) to float32 shared memory; g masked past seq_len.
    x = _load(x_s, wgmma, interpret).astype(_F32)
    g = _load(g_s, wgmma, interpret).astype(_F32)
    if fused:
        x = x * _per_row(jax.lax.rsqrt(jnp.sum(x * x, axis=1) + 1e-6), tile)
        a, dtb = _load(gate_s.at[0], col_vec, interpret), _load(gate_s.at[1], col_vec, interpret)
        g = lower_bound * _sigmoid(_per_col(a, tile) * (g + _per_col(dtb, tile)))
    xf_s[...] = x * _per_row(jnp.where(row_ids >= C, scale, 1.0), tile)
    g = g * on_rows(start + token_row < seq_len)

    def beta_vector(ref, layout):
        beta = _load(ref, layout, interpret).astype(_F32)
        beta = _sigmoid(beta) if fused else beta
        index = _iota(ref.shape, 0, layout, interpret)
        return jnp.where(start + jax.lax.rem(index, C) < seq_len, beta, 0.0)

    beta_rows = beta_vector(beta_s, row_vec)  # [64], one per row of a token tile
    beta_cols = beta_vector(beta_s.at[top], col_vec)  # [32], one per column of a [64, 32] tile

    # G: a 0/1 selection matrix @ g (three bf16 pieces of g, exact), float32 accumulation.
    _store_pieces([pool_s.at[i] for i in range(3)], g)
    sel_s[...] = jnp.where(cols <= token, 1.0, 0.0).astype(_BF16)
    plgpu.commit_smem()
    G = wgmma_sum(tile, [(sel_s, pool_s.at[i, top]) for i in range(3)])

    def G_at(i):
        """[K]: G at token i (row i of G)."""
        return jnp.sum(G * on_rows(row_ids == i), axis=0)

    # Decayed keys (top: exp(G_C - G)) and queries (bottom: exp(G)), the chunk decay exp(G_C).
    G_chunk = G_at(C - 1)
    gend_s[...] = jnp.exp(G_chunk)
    keys = on_rows(row_ids < C)
    decay = jnp.exp(keys * (_per_col(G_chunk, tile) - G) + (1.0 - keys) * G)
    x_s[...] = (_load(xf_s, wgmma, interpret) * decay).astype(_BF16)

    # Gram blocks: kk (top rows) and qk (bottom rows) against the chunk's keys.
    def gram(exponent, left_rows=None, right_rows=None):
        """(x exp(exponent)) (x exp(-exponent))^T, the rows outside ``left_rows`` / ``right_rows``
        (boolean [64, K]) of the two factors zero."""
        def factor(e, kept):
            x = _load(xf_s, wgmma, interpret)
            if kept is None:
                return x * jnp.exp(e)
            return jnp.where(kept, x * jnp.exp(jnp.where(kept, e, 0.0)), 0.0)

        _store_pieces([pool_s.at[0], pool_s.at[1]], factor(exponent, left_rows))
        _store_pieces([pool_s.at[2], pool_s.at[3]], factor(-exponent, right_rows))
        plgpu.commit_smem()
        hi_l, lo_l, hi_r, lo_r = pool_s.at[0], pool_s.at[1], pool_s.at[2, top], pool_s.at[3, top]
        return _product_t((WGMMA_ROWS, C), [(hi_l, hi_r), (hi_l, lo_r), (lo_l, hi_r)], interpret)

    # Diagonal blocks around the sub-tile midpoints; the (1, 0) block around the last token of
    # sub-tile 0, rows of sub-tile 1 against the keys of sub-tile 0.
    first = on_rows(token_row < SUB)
    midpoint = (first * _per_col(G_at(SUB // 2 - 1), tile)
                + (1.0 - first) * _per_col(G_at(SUB + SUB // 2 - 1), tile))
    diag = gram(G - midpoint)
    off = gram(G - _per_col(G_at(SUB - 1), tile), left_rows=first < 0.5, right_rows=first > 0.5)
    causal = jnp.where(rows < C, cols < token, cols <= token)  # A_kk strictly lower, A_qk lower
    off_block = (token >= SUB) & (cols < SUB)
    A = jnp.where((token // SUB == cols // SUB) & causal, diag, jnp.where(off_block, off, 0.0))
    aqk_s[...] = A.astype(_BF16)
    L = jnp.where(rows < C, A * _per_row(beta_rows, A.shape), 0.0)  # A_kk, rows scaled by beta

    # (I + L)^-1: block doubling inside the 16x16 diagonal blocks, then the (1, 0) block.
    matmul = functools.partial(_matmul_pieces, a_s=lhs_s, b_s=mat_s)
    level = lambda n: jnp.where((rows // n == cols // n) & (rows // (n // 2) != cols // (n // 2)), L, 0.0)
    inv = jnp.where(rows == cols, 1.0, 0.0) - level(2)
    size = 4
    while size <= SUB:
        inv = inv - matmul(matmul(inv, level(size)), inv)
        size *= 2
    inv = inv - matmul(inv, matmul(jnp.where((rows >= SUB) & (cols < SUB), L, 0.0), inv))

    # W = (X Diag(beta)) (exp(G) k), U = (X Diag(beta)) v.
    _store_pieces([lhs_s.at[0], lhs_s.at[1]], inv * _per_col(beta_cols, inv.shape))
    _store_pieces([pool_s.at[0], pool_s.at[1]], _load(xf_s, wgmma, interpret) * jnp.exp(G))
    plgpu.commit_smem()
    hi, lo = lhs_s.at[0], lhs_s.at[1]
    pool_s[2] = wgmma_sum(tile, [(hi, pool_s.at[0, top]), (hi, pool_s.at[1, top]),
                                 (lo, pool_s.at[0, top])]).astype(_BF16)
    u_s[...] = wgmma_sum((WGMMA_ROWS, V), [(hi, v_s.at[top]), (lo, v_s.at[top])]).astype(_BF16)
    plgpu.commit_smem()

    for src, dst in [(pool_s.at[2, top], w_g.at[b, tokens, h]), (u_s.at[top], u_g.at[b, tokens, h]),
                     (x_s.at[bottom], qg_g.at[b, tokens, h]), (x_s.at[top], kg_g.at[b, tokens, h]),
                     (aqk_s.at[bottom], aqk_g.at[b, tokens, h]), (gend_s, gend_g.at[b, c, h])]:
        plgpu.copy_smem_to_gmem(src, dst)
    plgpu.wait_smem_to_gmem(0)


def intra_chunk(q, k, v, g, beta, gate_params, *, seq_len, scale, lower_bound, interpret):
    """Per-chunk WY quantities at ``CHUNK`` = 32 (Mosaic GPU), as ``kernel.intra_chunk``.

    q, k, g [B, T, H, K] (T a multiple of ``CHUNK``; K a multiple of 64); v [B, T, H, V] (V a multiple
    of 64); beta [B, T, H]; gate_params None, or (exp(A_log) [H, K], dt_bias [H, K]) float32 for the
    fused gate (then g holds the raw z, beta the logits and q, k are not yet normalized).
    ``interpret``: False on the GPU, or ``mosaic_gpu.interpret_params()`` on a CPU.

    Returns W, decayed q (scaled), decayed k [B, T, H, K]; U [B, T, H, V]; A_qk [B, T, H, C] (each row
    against its own chunk) in bfloat16; and the chunk decay exp(G_C) [B, T / C, H, K] float32.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    if T % CHUNK or K % WGMMA_ROWS or V % WGMMA_ROWS:
        raise ValueError(f"T={T} must be a multiple of {CHUNK}, K={K} and V={V} of {WGMMA_ROWS}")
    fused = gate_params is not None
    args = [q, k, v, g, jnp.swapaxes(beta, 1, 2).astype(_F32)]
    args += [p.astype(_F32) for p in gate_params] if fused else []
    rows = WGMMA_ROWS
    scratch = [
        _tile((rows, K)),  # keys over queries; later the decayed keys over the decayed queries
        _tile((rows, K), _F32),  # normalized keys over scaled normalized queries, float32
        _tile((rows, K), g.dtype),  # g on both halves
        _tile((rows, V)),  # v (top half)
        plgpu.SMEM((rows,), _F32),  # beta on both halves
        plgpu.SMEM((2, K), _F32),  # exp(A_log), dt_bias
        _tile((rows, CHUNK)),  # a 0/1 selection matrix
        _tile((2, rows, CHUNK)),  # X Diag(beta), two pieces
        _tile((4, rows, K)),  # bf16 pieces of g, of the Gram and of the W operands; W
        _tile((2, rows, CHUNK)),  # right factor of a product in the inverse, two pieces
        _tile((rows, V)),  # U
        _tile((rows, CHUNK)),  # A_kk over A_qk
        plgpu.SMEM((K,), _F32),  # exp(G_C)
        plgpu.Barrier(num_barriers=_N_LOADS),
    ]
    kernel = functools.partial(_intra_kernel, seq_len=seq_len, scale=scale, lower_bound=lower_bound,
                               fused=fused, interpret=bool(interpret))
    tokens = lambda width: jax.ShapeDtypeStruct((B, T, H, width), _BF16)
    out_type = [tokens(K), tokens(V), tokens(K), tokens(K), tokens(CHUNK),
                jax.ShapeDtypeStruct((B, T // CHUNK, H, K), _F32)]
    return plgpu.kernel(
        kernel, out_type=out_type, scratch_types=scratch, grid=(T // CHUNK, H, B),
        grid_names=("chunk", "head", "batch"), compiler_params=plgpu.CompilerParams(),
        interpret=interpret or None,
    )(*args)


__all__ = ["intra_chunk"]
