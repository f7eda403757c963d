"""Pallas kernels for block-scaled (MXFP4 weight) matmuls: bodies and ``pallas_call`` wrappers.

Each program owns a [bm, bn] output tile and loops over the contracted axis in steps of bk
elements: it loads the packed weight codes [bn, bk/2] and E8M0 scales [bn, bk/32], decodes them in
registers into two bf16 planes, the even (low nibble) and odd (high nibble) elements (exact: every
E2M1 value times a power of two is a bf16), and feeds them with the matching even / odd columns of
x as bf16 x bf16 products with float32 accumulation to the matrix units (Hopper has no FP4 MMA). The W4A8 form
decodes MXFP8 activations the same way (an E4M3 value times a power of two is also exact in bf16).

The grouped kernel walks a list of work items (group, row tile, valid row range) built by
``ops.py``; an item may cover a row tile shared with neighbouring groups, so it stores only its
own rows with a masked store.

On GPU the kernels lower through Pallas' Triton backend, selected by passing Triton compiler
params (``_gpu_compiler_params``, the one version-specific spot); on CPU they run in interpret mode.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from k3jax.mx import BLOCK, e8m0_to_float
from k3jax.typing import Array

COMPUTE_DTYPE = jnp.bfloat16


@dataclasses.dataclass(frozen=True)
class MXBlocks:
    """Tile sizes and GPU launch settings of the MX matmul kernels.

    bm: rows of x per program; bn: output columns per program; bk: contracted elements per loop
    step (a multiple of 32, so whole scale blocks); num_warps, num_stages: Triton launch and
    software-pipelining depth (ignored in interpret mode). ``ops.py`` shrinks them to fit a shape.
    """

    bm: int = 64
    bn: int = 128
    bk: int = 256
    num_warps: int = 4
    num_stages: int = 3


def _gpu_compiler_params(blocks: MXBlocks, interpret: bool):
    """Version shim: Triton compiler params select Pallas' Triton lowering on JAX 0.10 and 0.11."""
    if interpret:
        return None
    from jax.experimental.pallas import triton as pltriton

    return pltriton.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages)


def _broadcast_scales(scales: Array, width: int) -> Array:
    """uint8 [r, g] E8M0 bytes -> float32 [r, width], each scale repeated over width // g columns."""
    rows, groups = scales.shape
    s = e8m0_to_float(scales)
    return jnp.broadcast_to(s[:, :, None], (rows, groups, width // groups)).reshape(rows, width)


def _fp4_plane(shifted: Array) -> Array:
    """int32 whose bits 0-3 hold an E2M1 code (higher bits ignored) -> float32 value, exactly.

    For magnitude m = 2e + f >= 2 the float32 bits are ``(m << 22) + (126 << 23)`` (exponent
    field e + 126, top mantissa bit f); m = 1 is 0.5 (bits 0x3F000000) and m = 0 is zero; bit 3
    moves to the sign bit. No subnormals, so flush-to-zero hardware cannot change it.
    """
    mag = shifted & 7
    normal = (mag << 22) + jnp.int32(0x3F000000)
    bits = jnp.where(mag >= 2, normal, mag * jnp.int32(0x3F000000)) | ((shifted & 8) << 28)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def decode_weight_planes(codes: Array, scales: Array) -> tuple[Array, Array]:
    """uint8 [bn, bk//2] packed E2M1 pairs, uint8 [bn, bk//32] scales -> two bf16 [bn, bk//2]
    planes: the even elements (low nibbles) and the odd elements (high nibbles).

    Splitting by nibble instead of interleaving keeps every tile in its loaded layout; the caller
    multiplies each plane by the matching even / odd columns of x.
    """
    c = codes.astype(jnp.int32)
    scale = _broadcast_scales(scales, codes.shape[1])
    return tuple((_fp4_plane(p) * scale).astype(COMPUTE_DTYPE) for p in (c, c >> 4))


def decode_activation_tile(values: Array, scales: Array | None) -> Array:
    """[bm, w] bf16/f32 (scales None) or float8_e4m3fn values with uint8 [bm, g] scales (each
    repeated over w // g columns) -> bf16 [bm, w]."""
    if scales is None:
        return values.astype(COMPUTE_DTYPE)
    return (values.astype(jnp.float32) * _broadcast_scales(scales, values.shape[1])).astype(COMPUTE_DTYPE)


def _accumulate_tiles(tiles_at, n_k: int, bm: int, bn: int) -> Array:
    """float32 [bm, bn] = sum over k steps i and planes p of x_p [bm, bk/2] . w_p [bn, bk/2]^T,
    where tiles_at(i) -> ((x_even, w_even), (x_odd, w_odd))."""
    dims = (((1,), (1,)), ((), ()))

    def step(i, acc):
        for x, w in tiles_at(i):
            acc = acc + jax.lax.dot_general(x, w, dims, preferred_element_type=jnp.float32)
        return acc

    return jax.lax.fori_loop(0, n_k, step, jnp.zeros((bm, bn), jnp.float32))


def _k_slices(i, bk: int):
    """Loop step i -> (half-width column slice of the even/odd planes and packed codes, scale slice)."""
    half = bk // 2
    return pl.ds(pl.multiple_of(i * half, half), half), pl.ds(pl.multiple_of(i * (bk // BLOCK), bk // BLOCK), bk // BLOCK)


def _tiles(x_refs, xs_ref, codes_ref, scales_ref, rows, cols, i, bk):
    """Decoded ((x_even, w_even), (x_odd, w_odd)) tiles of loop step i; refs indexed by rows / cols
    (tuples of leading indices) then the contracted slice."""
    half, blocks = _k_slices(i, bk)
    xs = None if xs_ref is None else xs_ref[(*rows, blocks)]
    xe, xo = (decode_activation_tile(r[(*rows, half)], xs) for r in x_refs)
    we, wo = decode_weight_planes(codes_ref[(*cols, half)], scales_ref[(*cols, blocks)])
    return (xe, we), (xo, wo)


def _split_refs(refs, w4a8: bool, leading: int):
    """(leading refs..., x_even, x_odd, [x_scales], codes, scales, out) -> named tuple of parts."""
    lead, rest = refs[:leading], refs[leading:]
    if w4a8:
        x_even, x_odd, xs_ref, codes_ref, scales_ref, o_ref = rest
    else:
        x_even, x_odd, codes_ref, scales_ref, o_ref = rest
        xs_ref = None
    return lead, (x_even, x_odd), xs_ref, codes_ref, scales_ref, o_ref


def _mx_matmul_kernel(*refs, bk: int, n_k: int, w4a8: bool):
    """Refs: x_even, x_odd [bm, K/2] (+ x scales [bm, K/32] if w4a8), codes [bn, K/2],
    scales [bn, K/32], out [bm, bn]."""
    _, x_refs, xs_ref, codes_ref, scales_ref, o_ref = _split_refs(refs, w4a8, 0)
    every = (slice(None),)
    tiles_at = lambda i: _tiles(x_refs, xs_ref, codes_ref, scales_ref, every, every, i, bk)
    o_ref[...] = _accumulate_tiles(tiles_at, n_k, *o_ref.shape).astype(o_ref.dtype)


def mx_matmul_pallas(
    x_even: Array,
    x_odd: Array,
    x_scales: Array | None,
    codes: Array,
    scales: Array,
    *,
    blocks: MXBlocks,
    out_dtype,
    interpret: bool,
) -> Array:
    """x_even, x_odd [M, K/2] (the even and odd columns of x; M % bm == 0), optional x_scales uint8
    [M, K/32], codes uint8 [N, K/2] (N % bn == 0), scales uint8 [N, K/32] -> out_dtype [M, N].
    Grid (M/bm, N/bn), row tiles fastest, so programs running together share a weight tile."""
    m, half = x_even.shape
    k = 2 * half
    n = codes.shape[0]
    bm, bn, bk = blocks.bm, blocks.bn, blocks.bk
    w4a8 = x_scales is not None
    row = lambda width: pl.BlockSpec((bm, width), lambda i, j: (i, 0))
    col = lambda width: pl.BlockSpec((bn, width), lambda i, j: (j, 0))
    in_specs = [row(half), row(half)] + ([row(k // BLOCK)] if w4a8 else []) + [col(half), col(k // BLOCK)]
    operands = [x_even, x_odd] + ([x_scales] if w4a8 else []) + [codes, scales]
    return pl.pallas_call(
        functools.partial(_mx_matmul_kernel, bk=bk, n_k=k // bk, w4a8=w4a8),
        out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
        grid=(m // bm, n // bn),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        compiler_params=_gpu_compiler_params(blocks, interpret),
        interpret=interpret,
        name="mx_matmul_w4a8" if w4a8 else "mx_matmul",
    )(*operands)


def _masked_store(ref, value: Array, mask: Array, interpret: bool) -> None:
    """Store value [bm, bn] into ref where mask [bm, 1] holds (Triton's masked store on GPU)."""
    if interpret:
        ref[...] = jnp.where(mask, value, ref[...])
        return
    from jax.experimental.pallas import triton as pltriton

    pltriton.store(ref, value, mask=jnp.broadcast_to(mask, value.shape))


def _grouped_kernel(*refs, bm: int, bn: int, bk: int, n_k: int, w4a8: bool, interpret: bool):
    """Refs: items int32 [4, I] (group, row tile, first row, end row), x_even, x_odd [Mp, K/2]
    (+ x scales [Mp, K/32]), codes [G, N, K/2], scales [G, N, K/32], out [Mp, N];
    program (n tile, item)."""
    (items_ref,), x_refs, xs_ref, codes_ref, scales_ref, o_ref = _split_refs(refs, w4a8, 1)
    n_tile, item = pl.program_id(0), pl.program_id(1)
    group, row_tile, lo, hi = (items_ref[r, item] for r in range(4))

    @pl.when(lo < hi)
    def _():
        row0 = pl.multiple_of(row_tile * bm, bm)
        rows = pl.ds(row0, bm)
        cols = pl.ds(pl.multiple_of(n_tile * bn, bn), bn)
        tiles_at = lambda i: _tiles(x_refs, xs_ref, codes_ref, scales_ref, (rows,), (group, cols), i, bk)
        acc = _accumulate_tiles(tiles_at, n_k, bm, bn)
        row_ids = row0 + jax.lax.broadcasted_iota(jnp.int32, (bm, 1), 0)
        mask = (row_ids >= lo) & (row_ids < hi)
        _masked_store(o_ref.at[rows, cols], acc.astype(o_ref.dtype), mask, interpret)


def grouped_mx_matmul_pallas(
    items: Array,
    x_even: Array,
    x_odd: Array,
    x_scales: Array | None,
    codes: Array,
    scales: Array,
    *,
    blocks: MXBlocks,
    out_dtype,
    interpret: bool,
) -> Array:
    """items int32 [4, I] (see ``ops._work_items``), x_even, x_odd [Mp, K/2] (Mp % bm == 0),
    optional x_scales uint8 [Mp, K/32], codes uint8 [G, N, K/2] (N % bn == 0), scales uint8
    [G, N, K/32] -> out_dtype [Mp, N]; rows no item covers are left unwritten. Grid (N/bn, I),
    n tiles fastest, so programs running together share one item's rows and one group's weights."""
    m, half = x_even.shape
    n = codes.shape[1]
    w4a8 = x_scales is not None
    kernel = functools.partial(
        _grouped_kernel, bm=blocks.bm, bn=blocks.bn, bk=blocks.bk, n_k=2 * half // blocks.bk,
        w4a8=w4a8, interpret=interpret,
    )
    operands = [items, x_even, x_odd] + ([x_scales] if w4a8 else []) + [codes, scales]
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
        grid=(n // blocks.bn, items.shape[1]),
        compiler_params=_gpu_compiler_params(blocks, interpret),
        interpret=interpret,
        name="grouped_mx_matmul_w4a8" if w4a8 else "grouped_mx_matmul",
    )(*operands)


__all__ = [
    "COMPUTE_DTYPE",
    "MXBlocks",
    "decode_activation_tile",
    "decode_weight_planes",
    "grouped_mx_matmul_pallas",
    "mx_matmul_pallas",
]
