"""KDA decode step lowered through Mosaic GPU (Hopper TMA): one token per sequence, state updated in place.

``decode_step`` has the contract of ``triton.decode_step`` (plain, or the fused gates with
``gate_params``). Per (batch, head) and state block S [K, block_v] (float32), with q, k, g [K], v
[block_v] and beta (the README's decode section): S' = Diag(exp g) S, r = v - S'^T k,
o = scale (S'^T q + (beta k . q) r), S <- S' + beta k r^T.

The state is streamed, not computed on: 805 MB of read + write at B=64, H=96, K=V=128 against a few
FLOPs a value. So the kernel is a persistent copy loop that computes in registers on the way:

- Tiles: (batch, head, value block) triples, ``B * H * V / block_v`` of them, in that order. Program
  p of P takes tiles p, p + P, p + 2P, ... (neighbouring programs read neighbouring tiles together).
  P is ``programs_per_sm`` (2) times the SMs: each program is one warpgroup, and two per SM overlap
  one's arithmetic with the other's (one program per SM with 6 slots measured slower, 3.55-3.58
  against 3.61-3.65 TB/s: the per-tile reductions of a lone warpgroup are latency-bound).
- Slots: each program has ``slots`` shared-memory slots, each holding one tile's state block and its
  vectors (q, k, g, the whole row of v, a window of beta; with the fused gates exp(A_log) and dt_bias
  rows too), all filled by TMA copies that complete on the slot's one barrier. While tile i is
  computed, the loads of tiles i + 1 .. i + slots - 2 are in flight, and the store of tile i - 1.
- Per tile: wait for its slot; registers: the state block in the wgmma register layout (rows over
  warps and lanes), the per-row vectors (q, k, exp g) and per-column vectors (v, r, o) in its row
  and column reductions; the two column sums S'^T k and S'^T q and the scalar k . q are register
  reductions (the column sums cross warps through a little shared memory). Then the slot that tile
  i - 1 used is refilled with tile i + slots - 1 (once the store out of it has read it), and tile i's
  new state and output are written into its own slot and copied out by TMA, the state over the
  input's buffer (the kernel writes a ``jax.new_ref`` of the state, which ``pl.kernel`` aliases in
  and out: donate the state under ``jit``).
- beta is one float per (batch, head), below TMA's and Pallas' 128-byte copy size: each tile brings in
  the aligned window of 128 bytes of the flattened [B * H] beta (or beta logits) holding its value and
  reads that one value from shared memory.

The fused variant shares the body: the q/k L2 norms, K3's bounded gate and the beta sigmoid are a few
vector operations before the same update. In interpret mode (``mosaic_gpu.interpret_params()``, CPU)
register layouts are not cast (the interpreter keeps none) and, as JAX 0.10's interpreter takes no
mutable refs, the kernel runs through ``plgpu.kernel`` and writes the new state to a new buffer;
everything else is the same kernel.

Layouts: q, k, g [B, H, K] (g: float32, or with the fused gates the raw z); v [B, H, V]; beta [B, H];
state [B, H, K, V] float32; K a multiple of 64 (wgmma row tiles), block_v a multiple of 32 dividing V.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

# Measured fastest on the H200 (benchmarks/HISTORY.md, 2026-11-30): two programs per SM, three slots of 64 columns.
BLOCK_V = 64
SLOTS = 3
PROGRAMS_PER_SM = 2
ROWS = 64  # K must be a multiple of this (the wgmma register layout's row tile)
COPY_BYTES = 128  # Pallas' Mosaic GPU copies move a multiple of 128 bytes (one warpgroup's worth)
_F32 = jnp.float32
# Lane semantics (explicit register layouts; JAX 0.11 defaults to Warpgroup semantics, 0.10 to Lane);
# 4 KB of reduction scratch (two rounds of 1 KB registers per 64-column sum), so that two programs'
# shared memory fits an SM: 2 x (3 x 34.4 KB + 4 KB) plus 1 KB a block, of 228 KB.
COMPILER_PARAMS = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane,
                                       reduction_scratch_bytes=4096)
_STATE = plgpu.Layout.WGMMA  # [K, block_v]: rows over warps and lanes, pairs of columns per thread
_PER_ROW = plgpu.Layout.WGMMA.reduce(1)  # [K], one value per state row
_PER_COL = plgpu.Layout.WGMMA.reduce(0)  # [block_v], one value per state column


def _sigmoid(x):
    return 1.0 / (1.0 + jnp.exp(-x))


def _l2_normalize(x, eps=1e-6):
    """x / sqrt(sum x^2 + eps) for a [K] vector (the reference's ``l2_normalize``)."""
    return x * jax.lax.rsqrt(jnp.sum(x * x) + eps)


def _cast(x, layout, interpret):
    """x in a Mosaic GPU register layout; the interpreter keeps no layouts."""
    return x if interpret else plgpu.layout_cast(x, layout)


def _update(q, k, v, g, beta, state, *, scale):
    """One token's update of a [K, bv] state block: q, k, g [K], v [bv], beta scalar, all float32.
    Returns (o [bv], new state [K, bv])."""
    shape = state.shape
    per_row = lambda x: jax.lax.broadcast_in_dim(x, shape, [0])
    state = state * per_row(jnp.exp(g))  # the decayed state S'
    # Both reductions read S', so they run together: S_new^T q = S'^T q + (beta k . q) r.
    sk = jnp.sum(state * per_row(k), axis=0)
    sq = jnp.sum(state * per_row(q), axis=0)
    residual = v - sk
    kb = k * beta
    o = scale * (sq + jnp.sum(kb * q) * residual)
    return o, state + per_row(kb) * jax.lax.broadcast_in_dim(residual, shape, [1])


def _decode_kernel(*refs, fused, n_tiles, n_programs, heads, v_blocks, beta_window, slots, scale,
                   lower_bound, interpret):
    """One program (grid axis "program"): its tiles in order, ``slots`` shared-memory slots deep.
    refs: the GMEM inputs (the state last), the outputs (o, the state: the input's ref on the GPU), then
    the shared-memory scratch and the slots' barriers (from ``run_scoped``)."""
    if fused:
        q_g, k_g, v_g, g_g, beta_g, a_g, dtb_g, s_in_g, o_g, s_g, *scratch = refs
        gate_g = (a_g, dtb_g)
    else:
        q_g, k_g, v_g, g_g, beta_g, s_in_g, o_g, s_g, *scratch = refs
        gate_g = ()
    s_s, q_s, k_s, g_s, v_s, beta_s, o_s, *gate_s, bars = scratch
    K, bv = s_s.shape[1:]
    p = jax.lax.axis_index("program")
    n_mine = (n_tiles - p + n_programs - 1) // n_programs

    def coords(i):
        """(batch, head, flat batch-head index, value columns) of this program's i-th tile."""
        t = p + i * n_programs
        bh = t // v_blocks
        return bh // heads, bh % heads, bh, pl.ds((t % v_blocks) * bv, bv)

    def fetch(i, slot):
        b, h, bh, cols = coords(i)
        sources = [s_in_g.at[b, h, :, cols], q_g.at[b, h], k_g.at[b, h], g_g.at[b, h], v_g.at[b, h],
                   beta_g.at[pl.ds((bh // beta_window) * beta_window, beta_window)]]
        sources += [x.at[h] for x in gate_g]
        targets = [s_s, q_s, k_s, g_s, v_s, beta_s, *gate_s]
        for src, dst in zip(sources, targets):
            plgpu.copy_gmem_to_smem(src, dst.at[slot], bars.at[slot])

    for i in range(slots - 1):  # the first tiles in flight before the loop
        @pl.when(i < n_mine)
        def _prologue():
            fetch(i, i)

    def step(i, carry):
        slot = jax.lax.rem(i, slots)
        b, h, bh, cols = coords(i)
        plgpu.barrier_wait(bars.at[slot])
        row = lambda ref: _cast(ref[slot], _PER_ROW, interpret).astype(_F32)
        q, k, g = row(q_s), row(k_s), row(g_s)
        v = _cast(v_s[slot, cols], _PER_COL, interpret).astype(_F32)
        beta = beta_s[slot, jax.lax.rem(bh, beta_window)].astype(_F32)
        if fused:  # raw inputs: L2-normalize q, k; bounded gate from z; sigmoid of the beta logit
            a, dtb = (row(ref) for ref in gate_s)
            q, k = _l2_normalize(q), _l2_normalize(k)
            g = lower_bound * _sigmoid(a * (g + dtb))
            beta = _sigmoid(beta)
        o, state = _update(q, k, v, g, beta, _cast(s_s[slot], _STATE, interpret), scale=scale)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # tile i - 1's slot is read out

        @pl.when(i + slots - 1 < n_mine)
        def _refill():
            fetch(i + slots - 1, jax.lax.rem(i + slots - 1, slots))

        s_s[slot] = state
        o_s[slot] = o
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_s.at[slot], o_g.at[b, h, cols], commit_group=False)
        plgpu.copy_smem_to_gmem(s_s.at[slot], s_g.at[b, h, :, cols])
        return carry

    jax.lax.fori_loop(0, n_mine, step, 0)
    plgpu.wait_smem_to_gmem(0)


# The state blocks in shared memory: 8-row tiles of 128-byte rows (32 floats), swizzled, so that
# loads and stores of the wgmma register layout are free of bank conflicts.
_STATE_TRANSFORMS = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))


def _num_programs(n_tiles, programs_per_sm, interpret):
    if interpret:
        return min(n_tiles, 3)  # few programs, several tiles each, unequal counts: the loop is exercised
    sms = getattr(jax.devices()[0], "core_count", 132)
    return min(n_tiles, sms * programs_per_sm)


def decode_step(q, k, v, g, beta, state, gate_params=None, *, scale, lower_bound=0.0, block_v=BLOCK_V,
                slots=SLOTS, programs_per_sm=PROGRAMS_PER_SM, num_programs=None, compiler_params=None,
                interpret=False):
    """One token per sequence: q, k, g [B, H, K]; v [B, H, V]; beta [B, H]; state [B, H, K, V] float32.
    gate_params None, or (exp(A_log) [H, K], dt_bias [H, K]) float32 for the fused gates (then g holds
    the raw z, beta the logits and q, k are not yet normalized), as ``triton.decode_step``.

    block_v: state columns per tile; slots: tiles in shared memory per program (>= 2); programs:
    ``num_programs``, or ``programs_per_sm`` per SM of the GPU; compiler_params: ``COMPILER_PARAMS``
    unless given. ``interpret``: False on the GPU, or
    ``mosaic_gpu.interpret_params()`` on a CPU.

    Returns o float32 [B, H, V] and the new state (written over the input state's buffer).
    """
    B, H, K = q.shape
    V = v.shape[-1]
    bv = min(block_v, V)
    if K % ROWS or V % bv or bv % 32 or (V * v.dtype.itemsize) % COPY_BYTES or slots < 2:
        raise ValueError(f"K={K} must be a multiple of {ROWS}; block_v={bv} a multiple of 32 dividing "
                         f"V={V}; v's rows a multiple of {COPY_BYTES} bytes; slots={slots} >= 2")
    fused = gate_params is not None
    n_tiles = B * H * (V // bv)
    P = num_programs or _num_programs(n_tiles, programs_per_sm, bool(interpret))
    beta_window = COPY_BYTES // jnp.dtype(beta.dtype).itemsize
    beta_flat = beta.reshape(B * H)
    if (B * H) % beta_window:  # whole windows only (no XLA op at shapes where B * H fills them)
        beta_flat = jnp.pad(beta_flat, (0, -(B * H) % beta_window))
    vec = lambda n, dtype: plgpu.SMEM((slots, n), dtype)
    scratch = [
        plgpu.SMEM((slots, K, bv), _F32, transforms=_STATE_TRANSFORMS),  # state blocks, in and out
        vec(K, q.dtype), vec(K, k.dtype), vec(K, g.dtype), vec(V, v.dtype),
        vec(beta_window, beta.dtype), vec(bv, _F32),  # beta windows, o on its way out
    ]
    scratch += [vec(K, _F32)] * (2 if fused else 0)  # exp(A_log), dt_bias rows
    n_copies = 8 if fused else 6
    scratch.append(plgpu.Barrier(num_arrivals=n_copies, num_barriers=slots))
    args = [q, k, v, g, beta_flat] + (list(gate_params) if fused else [])
    kernel = functools.partial(_decode_kernel, fused=fused, n_tiles=n_tiles, n_programs=P, heads=H,
                               v_blocks=V // bv, beta_window=beta_window, slots=slots, scale=scale,
                               lower_bound=lower_bound, interpret=bool(interpret))
    with_scratch = lambda *refs: pl.run_scoped(functools.partial(kernel, *refs), *scratch)
    o_type = jax.ShapeDtypeStruct((B, H, V), _F32)
    params = compiler_params or COMPILER_PARAMS
    if interpret:  # JAX 0.10's interpreter takes no mutable refs: the new state goes to a new buffer
        return plgpu.kernel(with_scratch, out_type=[o_type, jax.ShapeDtypeStruct(state.shape, _F32)],
                            grid=(P,), grid_names=("program",), compiler_params=params,
                            interpret=interpret)(*args, state.astype(_F32))
    state_ref = jax.new_ref(state.astype(_F32))  # read and written by the kernel: aliased in and out
    o = pl.kernel(lambda *refs: with_scratch(*refs[:-1], refs[-1], refs[-2]), out_type=o_type,
                  mesh=plgpu.Mesh(grid=(P,), grid_names=("program",)), compiler_params=params,
                  name="kda_decode_mosaic_gpu")(*args, state_ref)
    return o, jax.freeze(state_ref)

__all__ = ["BLOCK_V", "SLOTS", "PROGRAMS_PER_SM", "decode_step"]
