"""MX block-scaled matmuls (MXFP4 weights) for Pallas' Mosaic TPU lowering: dense and grouped (MoE).

Same contracts as ``ops.mx_matmul`` / ``ops.grouped_mx_matmul`` (README.md, section "TPU"). In short:

- Operands stay in their checkpoint layout: codes uint8 [N, K/2] (low nibble = even k), E8M0 scale
  bytes uint8 [N, K/32]. The wrapper splits x into its even and odd columns [M, K/2] (the elements
  the low and high nibbles of a code byte meet), so a code tile [bn, bk/2] decodes into two planes
  in place and ``y = x_even . w_even^T + x_odd . w_odd^T`` (no lane interleave in the kernel).
- Grid (M tiles, N tiles, K tiles), K last and sequential, a float32 [bm, bn] accumulator in VMEM.
  Per step the code tile is widened to int32 and decoded with integer ops into the exact float32
  E2M1 value (its bits built as in ``kernel._fp4_plane``, no subnormals), times the block scale
  2**(s - 127) (float32 bits ``s << 23``), rounded to bf16 (exact) and fed to the MXU as a bf16 x
  bf16 dot with float32 accumulation.
- Scale broadcast: a code byte in column j of the step uses scale block k * bk/32 + j // 16. The
  scale block is a whole row [bn, K/32] (K/32 is rarely a multiple of 128 lanes; its block index does
  not change with k, so it is fetched once per N tile), and the scales of the step's columns come
  from one small MXU product with a 0/1 matrix: scale bytes [bn, K/32] (integers 0..255, exact in
  bf16) . onehot [K/32, bk/2] -> float32 [bn, bk/2], exact since each output has a single nonzero
  term. No lane repeat, reshape or dynamic lane slice in the kernel.
- W4A8: x comes in as its float8_e4m3fn bytes (uint8) and E8M0 scales [M, K/32]; E4M3 is decoded
  with integer ops too (normal: float32 bits, subnormal: mantissa * 2**-9) and scaled the same way.
- Grouped: rows of x sorted by group, w [G, N, K]. Work items (group, row tile, first row, end row),
  one per row tile a non-empty group touches (``layout.work_items``), go in by scalar prefetch
  (``pltpu.PrefetchScalarGridSpec``) and pick the x row tile and the expert's weights in the index
  maps, as megablox's gmm does. Grid (N tiles, items, K tiles); items sequential, so a row tile
  shared by two groups stays in VMEM across their consecutive items and each stores only its own
  rows. Unused items repeat the last real item's blocks (no copies) and compute nothing.

Tiles (``TPUBlocks``): bm a multiple of 32 (uint8 tiles are (32, 128)), bn of 128, bk of 256 (so the
code tile is whole 128-lane tiles), or the whole K when K is not a multiple of 256. M and N are
padded to whole tiles (padding N copies the weights; K3's N are multiples of 256).

Verified on CPU only: TPU interpret mode for the values and lowering for the TPU platform
(``tests/kernels/mx_matmul/test_tpu.py``), which runs Pallas' Mosaic TPU lowering but not Mosaic's own
layout passes and compiler (libtpu, on a TPU). Not yet run on a TPU.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from k3jax.mx import BLOCK, ZERO_BLOCK_SCALE_BYTE, MXTensor, e8m0_to_float
from k3jax.typing import Array
from pallas_kernels.mx_matmul.layout import check_grouped, check_operands, pad_axis, resolve_dtype, work_items

_BF16 = jnp.bfloat16
_F32 = jnp.float32
_ROW_UNIT = 32  # sublanes of a uint8 tile (codes, W4A8 activations); bf16 needs 16
_LANES = 128
_K_UNIT = 2 * _LANES  # elements of K in one 128-lane row of code bytes
_X_WT = (((1,), (1,)), ((), ()))  # x . w^T


@dataclasses.dataclass(frozen=True)
class TPUBlocks:
    """Tile caps of the TPU kernels: bm rows of x (a multiple of 32), bn output columns (of 128), bk
    contracted elements per K step (of 256). The wrappers shrink them to the shape."""

    bm: int = 128
    bn: int = 256
    bk: int = 1024

    def __post_init__(self):
        if self.bm % _ROW_UNIT or self.bn % _LANES or self.bk % _K_UNIT or min(self.bm, self.bn, self.bk) <= 0:
            raise ValueError(f"TPUBlocks need bm % {_ROW_UNIT} == 0, bn % {_LANES} == 0 and bk % {_K_UNIT} == 0, "
                             f"got bm={self.bm}, bn={self.bn}, bk={self.bk}")


def _round_up(n: int, unit: int) -> int:
    return -(-n // unit) * unit


def _largest_tile(n: int, cap: int, unit: int) -> int:
    """Largest multiple of unit, at most max(cap, unit), that divides n (a multiple of unit)."""
    return max(t for t in range(unit, max(cap, unit) + 1, unit) if n % t == 0)


def _fit(blocks: TPUBlocks, m: int, n: int, k: int) -> tuple[int, int, int, int, int]:
    """(bm, bn, bk, M padded, N padded) for x [M, K] . w [N, K]^T: bm <= M rounded up to 32, N padded
    to 128, bk the whole K when K is not a multiple of 256."""
    bm = min(blocks.bm, _round_up(m, _ROW_UNIT))
    n_pad = _round_up(n, _LANES)
    bn = _largest_tile(n_pad, blocks.bn, _LANES)
    bk = _largest_tile(k, blocks.bk, _K_UNIT) if k % _K_UNIT == 0 else k
    return bm, bn, bk, _round_up(m, bm), n_pad


def _e2m1(nibbles: Array) -> Array:
    """int32 with an E2M1 code in bits 0-3 (higher bits ignored) -> its float32 value, exactly.

    Magnitude m = 2e + f: m >= 2 has float32 bits (m << 22) + (126 << 23), m = 1 is 0.5 and m = 0 is
    zero; bit 3 becomes the sign bit. Shifts, masks and selects only."""
    magnitude = nibbles & 7
    half = jnp.int32(0x3F000000)  # 0.5
    bits = jnp.where(magnitude >= 2, (magnitude << 22) + half, jnp.where(magnitude == 1, half, 0))
    return jax.lax.bitcast_convert_type(bits | ((nibbles & 8) << 28), _F32)


def _e4m3(byte: Array) -> Array:
    """int32 float8_e4m3fn bit patterns (0..255) -> float32 values, exactly; 0x7F / 0xFF are NaN."""
    exponent, mantissa = (byte >> 3) & 15, byte & 7
    normal = jax.lax.bitcast_convert_type(((exponent + 120) << 23) | (mantissa << 20), _F32)
    magnitude = jnp.where(exponent == 0, mantissa.astype(_F32) * 2.0**-9, normal)
    magnitude = jnp.where((byte & 0x7F) == 0x7F, jnp.nan, magnitude)
    return jnp.where((byte & 0x80) != 0, -magnitude, magnitude)


def _step_onehot(n_blocks: int, half: int, k) -> Array:
    """bf16 [K/32, bk/2] 0/1: entry (b, j) is 1 when code byte j of K step k lies in scale block b."""
    blocks_per_step = half * 2 // BLOCK
    column_block = k * blocks_per_step + (jax.lax.broadcasted_iota(jnp.int32, (n_blocks, half), 1) >> 4)
    rows = jax.lax.broadcasted_iota(jnp.int32, (n_blocks, half), 0)
    return jnp.where(rows == column_block, 1.0, 0.0).astype(_BF16)


def _step_scales(scale_bytes: Array, onehot: Array) -> Array:
    """uint8 [R, K/32] E8M0 bytes, the step's one-hot [K/32, bk/2] -> float32 [R, bk/2] scales of
    the step's columns: the bytes (exact in bf16) picked by one MXU product, then 2**(s - 127)."""
    as_bf16 = scale_bytes.astype(jnp.int32).astype(_F32).astype(_BF16)
    picked = jax.lax.dot_general(as_bf16, onehot, (((1,), (0,)), ((), ())), preferred_element_type=_F32)
    return e8m0_to_float(picked.astype(jnp.int32))


def _step_product(x_refs, xs_ref, codes_ref, scales_ref, k) -> Array:
    """float32 [bm, bn] = x_even . w_even^T + x_odd . w_odd^T for K step k, decoding the code tile
    [bn, bk/2] (and with W4A8 the x byte tiles [bm, bk/2]) in VMEM."""
    codes = codes_ref[...].astype(jnp.int32)
    onehot = _step_onehot(scales_ref.shape[-1], codes.shape[-1], k)
    w_scale = _step_scales(scales_ref[...], onehot)
    w_planes = [(_e2m1(c) * w_scale).astype(_BF16) for c in (codes, codes >> 4)]
    if xs_ref is None:
        x_planes = [ref[...] for ref in x_refs]
    else:
        x_scale = _step_scales(xs_ref[...], onehot)
        x_planes = [(_e4m3(ref[...].astype(jnp.int32)) * x_scale).astype(_BF16) for ref in x_refs]
    even, odd = (jax.lax.dot_general(x, w, _X_WT, preferred_element_type=_F32) for x, w in zip(x_planes, w_planes))
    return even + odd


def _split_refs(refs, w4a8: bool):
    """(x_even, x_odd, [x_scales], codes, scales, out, acc) -> (x refs, x scales or None, codes,
    scales, out, acc)."""
    if w4a8:
        x_even, x_odd, xs_ref, *rest = refs
    else:
        (x_even, x_odd, *rest), xs_ref = refs, None
    return (x_even, x_odd), xs_ref, *rest


def _accumulate_step(x_refs, xs_ref, codes_ref, scales_ref, acc_ref, k) -> None:
    @pl.when(k == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    acc_ref[...] += _step_product(x_refs, xs_ref, codes_ref, scales_ref, k)


def _dense_kernel(*refs, w4a8: bool):
    """Refs: x_even, x_odd [bm, bk/2] (+ x scale bytes [bm, K/32]), codes [bn, bk/2], scale bytes
    [bn, K/32], out [bm, bn], float32 accumulator [bm, bn]; program (M tile, N tile, K step)."""
    x_refs, xs_ref, codes_ref, scales_ref, o_ref, acc_ref = _split_refs(refs, w4a8)
    k = pl.program_id(2)
    _accumulate_step(x_refs, xs_ref, codes_ref, scales_ref, acc_ref, k)

    @pl.when(k == pl.num_programs(2) - 1)
    def _():
        o_ref[...] = acc_ref[...].astype(o_ref.dtype)


def _x_specs(bm: int, half_bk: int, n_blocks: int, w4a8: bool, row_tile) -> list:
    """BlockSpecs of x_even, x_odd (+ x scale bytes): row_tile(*grid and prefetch indices) -> (row
    tile, K step)."""
    plane = pl.BlockSpec((bm, half_bk), row_tile)
    scales = pl.BlockSpec((bm, n_blocks), lambda *idx: (row_tile(*idx)[0], 0))
    return [plane, plane] + ([scales] if w4a8 else [])


def _operands(x_even, x_odd, x_scales, codes, scales) -> list:
    return [x_even, x_odd] + ([] if x_scales is None else [x_scales]) + [codes, scales]


def mx_matmul_tpu(x_even, x_odd, x_scales, codes, scales, *, bm: int, bn: int, bk: int, out_dtype, interpret):
    """x_even, x_odd [M, K/2] (bf16, or W4A8 float8_e4m3fn bytes as uint8 with x_scales uint8
    [M, K/32]; M % bm == 0), codes uint8 [N, K/2], scales uint8 [N, K/32] (N % bn == 0, K % bk == 0)
    -> out_dtype [M, N]. ``interpret``: False on a TPU, or a ``pltpu.InterpretParams()``."""
    m, half = x_even.shape
    n, n_blocks = scales.shape
    w4a8 = x_scales is not None
    in_specs = _x_specs(bm, bk // 2, n_blocks, w4a8, lambda i, j, k: (i, k)) + [
        pl.BlockSpec((bn, bk // 2), lambda i, j, k: (j, k)),
        pl.BlockSpec((bn, n_blocks), lambda i, j, k: (j, 0)),  # whole rows, fetched once per N tile
    ]
    return pl.pallas_call(
        functools.partial(_dense_kernel, w4a8=w4a8),
        out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
        grid=(m // bm, n // bn, 2 * half // bk),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((bm, bn), lambda i, j, k: (i, j)),
        scratch_shapes=[pltpu.VMEM((bm, bn), _F32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="mx_matmul_w4a8_tpu" if w4a8 else "mx_matmul_tpu",
    )(*_operands(x_even, x_odd, x_scales, codes, scales))


def _grouped_kernel(group_ref, tile_ref, lo_ref, hi_ref, *refs, bm: int, w4a8: bool):
    """Prefetched items: group, row tile, first row, end row [I]. Refs as ``_dense_kernel``'s with
    the codes and scales of the item's group; program (N tile, item, K step). An item accumulates
    its row tile and stores only rows [first, end) at its last K step."""
    x_refs, xs_ref, codes_ref, scales_ref, o_ref, acc_ref = _split_refs(refs, w4a8)
    item, k = pl.program_id(1), pl.program_id(2)
    lo, hi = lo_ref[item], hi_ref[item]

    @pl.when(lo < hi)
    def _():
        _accumulate_step(x_refs, xs_ref, codes_ref, scales_ref, acc_ref, k)

        @pl.when(k == pl.num_programs(2) - 1)
        def _():
            rows = tile_ref[item] * bm + jax.lax.broadcasted_iota(jnp.int32, o_ref.shape, 0)
            mine = (rows >= lo) & (rows < hi)
            o_ref[...] = jnp.where(mine, acc_ref[...].astype(o_ref.dtype), o_ref[...])


def _prefetched_items(group_sizes: Array, m: int, bm: int, n_items: int) -> tuple[Array, ...]:
    """(group, row tile, first row, end row) int32 [n_items] each, from ``layout.work_items``; unused
    items (empty row range) take the last real item's group and row tile, so their blocks are
    already in VMEM."""
    group, tile, lo, hi = work_items(group_sizes, m, bm, n_items)
    last = jnp.maximum(jnp.sum(hi > lo) - 1, 0)
    used = hi > lo
    return jnp.where(used, group, group[last]), jnp.where(used, tile, tile[last]), lo, hi


def grouped_mx_matmul_tpu(items, x_even, x_odd, x_scales, codes, scales, *, bm: int, bn: int, bk: int, out_dtype,
                          interpret):
    """items: (group, row tile, first row, end row) int32 [I] (``_prefetched_items``); x as in
    ``mx_matmul_tpu``; codes uint8 [G, N, K/2], scales uint8 [G, N, K/32] -> out_dtype [M, N]; rows
    no item covers are left unwritten. Grid (N/bn, I, K/bk)."""
    m, half = x_even.shape
    _, n, n_blocks = scales.shape
    n_k = 2 * half // bk
    w4a8 = x_scales is not None

    def step(item, k, lo, hi):
        """K step of an item; an unused item stays on its predecessor's last step (no new copies)."""
        return jnp.where(lo[item] < hi[item], k, n_k - 1)

    def x_tile(j, item, k, group, tile, lo, hi):
        return tile[item], step(item, k, lo, hi)

    in_specs = _x_specs(bm, bk // 2, n_blocks, w4a8, x_tile) + [
        pl.BlockSpec((None, bn, bk // 2), lambda j, i, k, g, t, lo, hi: (g[i], j, step(i, k, lo, hi))),
        pl.BlockSpec((None, bn, n_blocks), lambda j, i, k, g, t, lo, hi: (g[i], j, 0)),
    ]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=4,
        grid=(n // bn, items[0].shape[0], n_k),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((bm, bn), lambda j, i, k, g, t, lo, hi: (t[i], j)),
        scratch_shapes=[pltpu.VMEM((bm, bn), _F32)],
    )
    return pl.pallas_call(
        functools.partial(_grouped_kernel, bm=bm, w4a8=w4a8),
        out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
        grid_spec=grid_spec,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary", "arbitrary")),
        interpret=interpret,
        name="grouped_mx_matmul_w4a8_tpu" if w4a8 else "grouped_mx_matmul_tpu",
    )(*items, *_operands(x_even, x_odd, x_scales, codes, scales))


def _x_planes(x: Array | MXTensor, m_pad: int) -> tuple[Array, Array, Array | None]:
    """x padded to m_pad rows and split into its even and odd columns: bf16, or for an MXFP8 x its
    float8 bytes as uint8 (plus its scale bytes, padded with unit scales)."""
    if isinstance(x, MXTensor):
        values = pad_axis(jax.lax.bitcast_convert_type(x.codes, jnp.uint8), 0, m_pad, 0)
        x_scales = pad_axis(x.scales, 0, m_pad, ZERO_BLOCK_SCALE_BYTE)
    else:
        values, x_scales = pad_axis(x.astype(_BF16), 0, m_pad, 0), None
    return values[:, 0::2], values[:, 1::2], x_scales


def _weights(w: MXTensor, n_pad: int) -> tuple[Array, Array]:
    """Codes and scale bytes with rows padded to n_pad (zero codes, unit scales)."""
    axis = w.ndim - 2
    return pad_axis(w.codes, axis, n_pad, 0), pad_axis(w.scales, axis, n_pad, ZERO_BLOCK_SCALE_BYTE)


def _resolve_tpu(x, blocks, out_dtype, interpret: bool | None):
    """(blocks, out_dtype, interpret): blocks default to ``TPUBlocks()``; out_dtype as
    ``layout.resolve_dtype``; interpret defaults to "not on a TPU"."""
    if not isinstance(blocks, (TPUBlocks, type(None))):
        raise ValueError(f"the Mosaic TPU kernels take TPUBlocks, got {blocks!r}")
    out_dtype, _ = resolve_dtype(x, out_dtype, False)
    return blocks or TPUBlocks(), out_dtype, jax.default_backend() != "tpu" if interpret is None else interpret


def _interpret_params(interpret: bool):
    return pltpu.InterpretParams() if interpret else False


@functools.partial(jax.jit, static_argnames=("blocks", "out_dtype", "interpret"))
def _mx_matmul(x, w, *, blocks, out_dtype, interpret):
    m, n, k = check_operands(x, w, 2)
    bm, bn, bk, m_pad, n_pad = _fit(blocks, m, n, k)
    out = mx_matmul_tpu(*_x_planes(x, m_pad), *_weights(w, n_pad), bm=bm, bn=bn, bk=bk, out_dtype=out_dtype,
                        interpret=_interpret_params(interpret))
    return out[:m, :n]


def mx_matmul(x: Array | MXTensor, w: MXTensor, *, blocks: TPUBlocks | None = None, out_dtype=None,
              interpret: bool | None = None) -> Array:
    """x [M, K] (bf16/f32, rounded to bf16; or an MXFP8 ``MXTensor``, W4A8) times MXFP4 w [N, K] ->
    [M, N] on the Mosaic TPU kernel. out_dtype defaults to x's dtype (bf16 for MXFP8 x);
    accumulation is float32. ``interpret`` (default: off a TPU) runs Pallas' TPU interpret mode."""
    blocks, out_dtype, interpret = _resolve_tpu(x, blocks, out_dtype, interpret)
    return _mx_matmul(x, w, blocks=blocks, out_dtype=out_dtype, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("blocks", "out_dtype", "interpret"))
def _grouped_mx_matmul(x, w, group_sizes, *, blocks, out_dtype, interpret):
    m, n, k, g = check_grouped(x, w, group_sizes)
    bm, bn, bk, m_pad, n_pad = _fit(blocks, m, n, k)
    items = _prefetched_items(group_sizes, m, bm, m_pad // bm + min(g, m) - 1)
    out = grouped_mx_matmul_tpu(items, *_x_planes(x, m_pad), *_weights(w, n_pad), bm=bm, bn=bn, bk=bk,
                                out_dtype=out_dtype, interpret=_interpret_params(interpret))
    covered = jnp.arange(m)[:, None] < jnp.sum(group_sizes)
    return jnp.where(covered, out[:m, :n], jnp.zeros((), out_dtype))


def grouped_mx_matmul(x: Array | MXTensor, w: MXTensor, group_sizes: Array, *, blocks: TPUBlocks | None = None,
                      out_dtype=None, interpret: bool | None = None) -> Array:
    """Ragged MX matmul on the Mosaic TPU kernel: x [M, K] rows sorted by group (bf16/f32 or MXFP8),
    MXFP4 w [G, N, K], group_sizes int32 [G] -> [M, N]; rows of group g multiply w[g], rows past
    sum(group_sizes) are zero. out_dtype and ``interpret`` as in ``mx_matmul``."""
    blocks, out_dtype, interpret = _resolve_tpu(x, blocks, out_dtype, interpret)
    return _grouped_mx_matmul(x, w, group_sizes, blocks=blocks, out_dtype=out_dtype, interpret=interpret)


__all__ = ["TPUBlocks", "grouped_mx_matmul", "grouped_mx_matmul_tpu", "mx_matmul", "mx_matmul_tpu"]
