"""Pallas kernels for block-scaled (MXFP4 weight) matmuls: bodies and ``pallas_call`` wrappers.

Each program owns an output tile and loops over the contracted axis in steps of bk elements: it
loads the packed weight codes as a [bn, bk/32, 16] tile (16 code bytes = one 32-element scale
block per row of the middle axis) and the E8M0 scales as [bn, bk/32, 1], so the scale broadcast
is a size-1 broadcast with no data movement. It decodes them in registers into two bf16 planes, the
even (low nibble) and odd (high nibble) elements (exact: every E2M1 value times a power of two is
a bf16), and feeds them with the matching even / odd columns of x as bf16 x bf16 products with
float32 accumulation to the matrix units (Hopper has no FP4 MMA). The W4A8 form decodes MXFP8
activations the same way (an E4M3 value times a power of two is also exact in bf16).

One-row form (``MXBlocks.gemv``, bm = 1): no matrix unit; each step converts the decoded planes
to float32, multiplies them by the matching x plane broadcast over the bn rows on the CUDA cores
and adds them into a float32 [bn, bk/2] accumulator, summed over its columns once after the loop
(``_accumulate_products``).

Two decodes (``MXBlocks.decode``), equal bit for bit:

- ``"ptx"`` (GPU default): inline PTX per 32-bit word of 8 nibbles, ``_PTX_DECODE`` (one asm
  per plane): one ``prmt`` pairs the nibbles, then per output bf16x2 register a shift and mask put
  the magnitude bits into bf16 bits 6-8, a shift and ``lop3`` add the sign bit, and two bf16x2
  multiplies apply 2**126
  (the E2M1 exponent bias; code 1 is built as the bf16 subnormal 2**-127) and the block scale.
  About 2 integer operations and 1 bf16x2 multiply per element. Interpret mode runs
  ``_ptx_decode_emulated``, the same bit steps in jnp.
- ``"arith"``: portable jnp integer/float arithmetic (``_fp4_plane``), about 10 operations per
  element; any backend.

Orientation (``MXBlocks.weights_lhs``, the default for dense M <= 128): the dot is computed transposed,
out^T [bn, bm] = w [bn, bk/2] . x^T, so the decoded weights are the left (A) operand that the matrix
instruction may take from registers and M (padded to bm) is the instruction's small N.

The grouped kernel walks a list of work items (group, row tile, valid row range) built by
``ops.py``; an item may cover a row tile shared with neighbouring groups, so it stores only its
own rows with a masked store. ``decode_mxfp4_pallas`` only decodes, into a bf16 [N, 2, K/2] array
(even plane, odd plane per row), for the large-M path of ``ops.py`` that hands the product to XLA.

On GPU the kernels lower through Pallas' Triton backend, selected by passing Triton compiler
params (``pallas_kernels._triton.triton_params``, the one version-specific spot); on CPU they run in interpret mode.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from k3jax.mx import BLOCK, e8m0_to_float
from k3jax.typing import Array
from pallas_kernels._triton import triton_params

COMPUTE_DTYPE = jnp.bfloat16
SCALE_BLOCK_BYTES = BLOCK // 2  # packed code bytes per E8M0 scale


@dataclasses.dataclass(frozen=True)
class MXBlocks:
    """Tile sizes, GPU launch settings and method of the MX matmul kernels.

    bm: rows of x per program; bn: output columns per program; bk: contracted elements per loop
    step (a power of two >= 32, so whole scale blocks); num_warps, num_stages: Triton launch and
    software-pipelining depth (ignored in interpret mode); weights_lhs: compute the transposed
    product with the decoded weights as the dot's left operand; decode: "ptx" (inline PTX,
    emulated bit for bit in interpret mode) or "arith" (portable jnp arithmetic);
    decode_then_dot: dense only, decode the whole weight to bf16 with ``decode_mxfp4_pallas``
    (tiles bn x bk) and let XLA do the dot; gemv: one row of x per program (bm must be 1),
    products and sums on the CUDA cores instead of a dot (not with weights_lhs or
    decode_then_dot); mosaic_gpu: dense, at most 64 rows, the Mosaic GPU kernel of
    ``mosaic_gpu.py`` (64 weight rows per program, steps of bk = 128 or 256, num_stages steps in
    flight; the other fields are ignored), or grouped, the kernel of ``mosaic_gpu_grouped.py`` (the
    same, over tiles of bm rows of x, bm a multiple of 8 up to 256). ``ops.py`` shrinks the tiles
    to fit a shape (bm to at least 16 unless gemv; not for mosaic_gpu, which pads).
    """

    bm: int = 64
    bn: int = 128
    bk: int = 256
    num_warps: int = 4
    num_stages: int = 3
    weights_lhs: bool = False
    decode: Literal["ptx", "arith"] = "ptx"
    decode_then_dot: bool = False
    gemv: bool = False
    mosaic_gpu: bool = False

    def __post_init__(self):
        if self.mosaic_gpu and (self.bk not in (128, 256) or self.gemv or self.decode_then_dot):
            raise ValueError(f"mosaic_gpu needs bk 128 or 256 and neither gemv nor decode_then_dot, got {self}")
        if self.gemv and (self.bm != 1 or self.weights_lhs or self.decode_then_dot):
            raise ValueError(
                f"gemv needs bm == 1 and neither weights_lhs nor decode_then_dot, got bm={self.bm}, "
                f"weights_lhs={self.weights_lhs}, decode_then_dot={self.decode_then_dot}"
            )


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


def _arith_decode(codes: Array, scale: Array) -> tuple[Array, Array]:
    """uint8 codes, float32 scales of the same shape -> even, odd bf16 planes (jnp arithmetic)."""
    c = codes.astype(jnp.int32)
    return tuple((_fp4_plane(p) * scale).astype(COMPUTE_DTYPE) for p in (c, c >> 4))


# The PTX decode works on one 32-bit word of 4 code bytes (b0, b1, b2, b3), 8 nibbles. ``prmt``
# reorders it to bytes (b0, b2, b1, b3); then nibbles q and q + 4 of the word (q = 0..3) sit at
# the same place in its low and high 16-bit halves and are two neighbouring elements of one plane:
# q = 0: low nibbles of b0, b1 (even elements 0, 1); q = 1: their high nibbles (odd 0, 1);
# q = 2, 3: the same for b2, b3 (elements 2, 3). Shifting the word left by 6 - 4q and masking
# with 0x01C001C0 puts the magnitude bits at bf16 bits 6-8 (exponent bits 0-1, top mantissa bit),
# shifting it by 12 - 4q puts the sign at bit 15, and lop3 merges the two: the bf16 value is the
# E2M1 value times 2**-126 (code 1 the subnormal 2**-127), so one bf16x2 multiply by 2**126 and one
# by the block scale give the exact element. Triton packs 4 bytes per input register and 2 bf16 per
# register of a bf16 operand or result, element 0 in the low half. One asm per plane (Pallas lowers
# single-result inline asm only): plane p takes q = p (elements 0, 1) and q = p + 2 (2, 3).
_PRMT_PAIR_NIBBLES = 0x3120
_MAGNITUDE_MASK = 0x01C001C0
_SIGN_MASK = 0x80008000
_BF16X2_2_POW_126 = 0x7E807E80
_BF16X2_NEG_ZERO = 0x80008000


def _nibble_shifts(q: int) -> tuple[int, int]:
    """Left shifts (negative: right) that move nibble q's magnitude to bit 6 and its sign to bit 15."""
    return 6 - 4 * q, 12 - 4 * q


def _ptx_shift(dst: str, src: str, amount: int) -> str:
    if amount > 0:
        return f"shl.b32 {dst}, {src}, {amount};"
    if amount < 0:
        return f"shr.b32 {dst}, {src}, {-amount};"
    return f"mov.b32 {dst}, {src};"


def _ptx_decode_asm(plane: int) -> str:
    """The inline PTX of plane 0 (even) or 1 (odd): outputs $0, $1 (elements 0-1, 2-3 as bf16x2),
    inputs $2 the code word, $3, $4 the scales of elements 0-1 and 2-3 as bf16x2. Inputs are copied
    first, so outputs may share their registers."""
    lines = [
        "{",
        ".reg .b32 w, m, s, sc0, sc1, bias, nz;",
        f"prmt.b32 w, $2, $2, {_PRMT_PAIR_NIBBLES:#x};",
        "mov.b32 sc0, $3;",
        "mov.b32 sc1, $4;",
        f"mov.b32 bias, {_BF16X2_2_POW_126:#x};",
        f"mov.b32 nz, {_BF16X2_NEG_ZERO:#x};",
    ]
    for pair in (0, 1):
        magnitude_shift, sign_shift = _nibble_shifts(plane + 2 * pair)
        lines += [
            _ptx_shift("m", "w", magnitude_shift),
            f"and.b32 m, m, {_MAGNITUDE_MASK:#x};",
            _ptx_shift("s", "w", sign_shift),
            f"lop3.b32 m, m, s, {_SIGN_MASK:#x}, 0xF8;",  # m | (s & mask)
            "fma.rn.bf16x2 m, m, bias, nz;",
            f"fma.rn.bf16x2 ${pair}, m, sc{pair}, nz;",
        ]
    return "\n".join(lines + ["}"])


_PTX_DECODE = tuple(_ptx_decode_asm(plane) for plane in (0, 1))


def _ptx_decode(codes: Array, scale: Array) -> tuple[Array, Array]:
    """uint8 codes, bf16 scales of the same shape -> even, odd bf16 planes, by inline PTX."""
    from jax.experimental.pallas import triton as pltriton

    plane = jax.ShapeDtypeStruct(codes.shape, COMPUTE_DTYPE)
    return tuple(
        pltriton.elementwise_inline_asm(
            asm, args=[codes, scale], constraints="=r,=r,r,r,r", pack=4, result_shape_dtypes=[plane]
        )[0]
        for asm in _PTX_DECODE
    )


def _shift_left_u32(x: Array, amount: int) -> Array:
    return x << amount if amount >= 0 else x >> -amount


def _times_bias_and_scale(bits: Array, scale: Array) -> Array:
    """bf16 bits from the PTX integer steps (uint32 < 2**16), bf16 scales -> bf16 bits * 2**126 *
    scale, exactly; the 2**126 step edits the exponent field instead of multiplying, since XLA on
    CPU flushes the subnormal 2**-127 to zero."""
    normal = bits + (126 << 7)
    subnormal = (bits & 0x8000) | jnp.where((bits & 0x40) != 0, jnp.uint32(0x3F00), jnp.uint32(0))
    biased = jnp.where((bits & 0x7F80) == 0, subnormal, normal).astype(jnp.uint16)
    value = jax.lax.bitcast_convert_type(biased, COMPUTE_DTYPE).astype(jnp.float32)
    return (value * scale.astype(jnp.float32)).astype(COMPUTE_DTYPE)


def _ptx_decode_emulated(codes: Array, scale: Array) -> tuple[Array, Array]:
    """``_ptx_decode`` in jnp for interpret mode: the same word, shifts, masks and register order."""
    b = codes.astype(jnp.uint32).reshape(*codes.shape[:-1], codes.shape[-1] // 4, 4)
    word = b[..., 0] | (b[..., 2] << 8) | (b[..., 1] << 16) | (b[..., 3] << 24)  # prmt 0x3120
    planes = []
    for plane in (0, 1):
        halves = []
        for pair in (0, 1):
            magnitude_shift, sign_shift = _nibble_shifts(plane + 2 * pair)
            magnitude = _shift_left_u32(word, magnitude_shift) & jnp.uint32(_MAGNITUDE_MASK)
            register = magnitude | (_shift_left_u32(word, sign_shift) & jnp.uint32(_SIGN_MASK))
            halves += [register & 0xFFFF, register >> 16]  # element 0 of the pair in the low half
        bits = jnp.stack(halves, axis=-1).reshape(codes.shape)
        planes.append(_times_bias_and_scale(bits, scale))
    return planes[0], planes[1]


def decode_weight_planes(codes: Array, scales: Array, method: str, interpret: bool, *,
                         blocked: bool = False) -> tuple[Array, Array]:
    """uint8 [bn, g, 16] packed E2M1 pairs (g scale blocks of 16 bytes), uint8 [bn, g, 1] scales
    -> two bf16 [bn, 16 g] planes (with ``blocked``: [bn, g, 16], as loaded): the even elements (low
    nibbles) and the odd (high nibbles).

    Splitting by nibble instead of interleaving keeps every tile in its loaded layout; the caller
    multiplies each plane by the matching even / odd columns of x.
    """
    bn, g, width = codes.shape
    scale = e8m0_to_float(scales)
    if method == "arith":
        planes = _arith_decode(codes, jnp.broadcast_to(scale, codes.shape))
    else:
        decode = _ptx_decode_emulated if interpret else _ptx_decode
        planes = decode(codes, jnp.broadcast_to(scale.astype(COMPUTE_DTYPE), codes.shape))
    return tuple(planes) if blocked else tuple(p.reshape(bn, g * width) for p in planes)


def decode_activation_tile(values: Array, scales: Array | None) -> Array:
    """[bm, w] bf16/f32 (scales None) or float8_e4m3fn values with uint8 [bm, g] scales (each
    repeated over w // g columns) -> bf16 [bm, w]."""
    if scales is None:
        return values.astype(COMPUTE_DTYPE)
    rows, groups = scales.shape
    width = values.shape[1]
    s = jnp.broadcast_to(e8m0_to_float(scales)[:, :, None], (rows, groups, width // groups)).reshape(rows, width)
    return (values.astype(jnp.float32) * s).astype(COMPUTE_DTYPE)


def _accumulate_tiles(tiles_at, n_k: int, bm: int, bn: int, weights_lhs: bool) -> Array:
    """float32 [bm, bn] = sum over k steps i and planes p of x_p [bm, bk/2] . w_p [bn, bk/2]^T,
    where tiles_at(i) -> ((x_even, w_even), (x_odd, w_odd)); with weights_lhs the loop accumulates
    w_p . x_p^T [bn, bm] and transposes once at the end."""
    dims = (((1,), (1,)), ((), ()))

    def step(i, acc):
        for x, w in tiles_at(i):
            lhs, rhs = (w, x) if weights_lhs else (x, w)
            acc = acc + jax.lax.dot_general(lhs, rhs, dims, preferred_element_type=jnp.float32)
        return acc

    acc = jax.lax.fori_loop(0, n_k, step, jnp.zeros((bn, bm) if weights_lhs else (bm, bn), jnp.float32))
    return acc.T if weights_lhs else acc


def _accumulate_products(tiles_at, n_k: int, bn: int, half: int) -> Array:
    """One row of x, no dot: float32 [1, bn] = the sums over the half columns of a float32
    [bn, half] accumulator of w_p [bn, half] * x_p [1, half] (broadcast over the bn rows) over k
    steps i and planes p, where tiles_at(i) -> ((x_even, w_even), (x_odd, w_odd)), half = bk / 2."""

    def step(i, acc):
        for x, w in tiles_at(i):
            acc = acc + w.astype(jnp.float32) * x.astype(jnp.float32)
        return acc

    acc = jax.lax.fori_loop(0, n_k, step, jnp.zeros((bn, half), jnp.float32))
    return jnp.sum(acc, axis=1)[None, :]


def _accumulate(tiles_at, n_k: int, blocks: MXBlocks) -> Array:
    """float32 [bm, bn] output tile: products on the CUDA cores with gemv, else bf16 dots."""
    if blocks.gemv:
        return _accumulate_products(tiles_at, n_k, blocks.bn, blocks.bk // 2)
    return _accumulate_tiles(tiles_at, n_k, blocks.bm, blocks.bn, blocks.weights_lhs)


def _k_slices(i, bk: int):
    """Loop step i -> (half-width column slice of the x planes, scale-block slice)."""
    half, blocks = bk // 2, bk // BLOCK
    return pl.ds(pl.multiple_of(i * half, half), half), pl.ds(pl.multiple_of(i * blocks, blocks), blocks)


def _tiles(x_refs, xs_ref, codes_ref, scales_ref, rows, cols, i, blocks: MXBlocks, interpret: bool):
    """Decoded ((x_even, w_even), (x_odd, w_odd)) tiles of loop step i; refs indexed by rows / cols
    (tuples of leading indices) then the contracted slice (codes, scales: then their last axis)."""
    half, scale_blocks = _k_slices(i, blocks.bk)
    xs = None if xs_ref is None else xs_ref[(*rows, scale_blocks)]
    xe, xo = (decode_activation_tile(r[(*rows, half)], xs) for r in x_refs)
    w_index = (*cols, scale_blocks, slice(None))
    we, wo = decode_weight_planes(codes_ref[w_index], scales_ref[w_index], blocks.decode, interpret)
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


def _mx_matmul_kernel(*refs, blocks: MXBlocks, n_k: int, w4a8: bool, interpret: bool):
    """Refs: x_even, x_odd [bm, K/2] (+ x scales [bm, K/32] if w4a8), codes [bn, K/32, 16],
    scales [bn, K/32, 1], out [bm, bn]."""
    _, x_refs, xs_ref, codes_ref, scales_ref, o_ref = _split_refs(refs, w4a8, 0)
    every = (slice(None),)
    tiles_at = lambda i: _tiles(x_refs, xs_ref, codes_ref, scales_ref, every, every, i, blocks, interpret)
    o_ref[...] = _accumulate(tiles_at, n_k, blocks).astype(o_ref.dtype)


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
    [M, K/32], codes uint8 [N, K/32, 16] (N % bn == 0), scales uint8 [N, K/32, 1] -> out_dtype
    [M, N]. Grid (M/bm, N/bn), row tiles fastest, so programs running together share a weight tile."""
    m, half = x_even.shape
    k = 2 * half
    n = codes.shape[0]
    bm, bn = blocks.bm, blocks.bn
    w4a8 = x_scales is not None
    row = lambda width: pl.BlockSpec((bm, width), lambda i, j: (i, 0))
    col = lambda width: pl.BlockSpec((bn, k // BLOCK, width), lambda i, j: (j, 0, 0))
    in_specs = [row(half), row(half)] + ([row(k // BLOCK)] if w4a8 else []) + [col(SCALE_BLOCK_BYTES), col(1)]
    operands = [x_even, x_odd] + ([x_scales] if w4a8 else []) + [codes, scales]
    kernel = functools.partial(_mx_matmul_kernel, blocks=blocks, n_k=k // blocks.bk, w4a8=w4a8, interpret=interpret)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
        grid=(m // bm, n // bn),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        compiler_params=triton_params(blocks.num_warps, blocks.num_stages, interpret),
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


def _grouped_kernel(*refs, blocks: MXBlocks, n_k: int, w4a8: bool, interpret: bool):
    """Refs: items int32 [4, I] (group, row tile, first row, end row), x_even, x_odd [Mp, K/2]
    (+ x scales [Mp, K/32]), codes [G, N, K/32, 16], scales [G, N, K/32, 1], out [Mp, N];
    program (n tile, item)."""
    (items_ref,), x_refs, xs_ref, codes_ref, scales_ref, o_ref = _split_refs(refs, w4a8, 1)
    bm, bn = blocks.bm, blocks.bn
    n_tile, item = pl.program_id(0), pl.program_id(1)
    group, row_tile, lo, hi = (items_ref[r, item] for r in range(4))

    @pl.when(lo < hi)
    def _():
        row0 = pl.multiple_of(row_tile * bm, bm)
        rows = pl.ds(row0, bm)
        cols = pl.ds(pl.multiple_of(n_tile * bn, bn), bn)
        tiles_at = lambda i: _tiles(x_refs, xs_ref, codes_ref, scales_ref, (rows,), (group, cols), i, blocks, interpret)
        acc = _accumulate(tiles_at, n_k, blocks)
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
    """items int32 [4, I] (see ``layout.work_items``), x_even, x_odd [Mp, K/2] (Mp % bm == 0),
    optional x_scales uint8 [Mp, K/32], codes uint8 [G, N, K/32, 16] (N % bn == 0), scales uint8
    [G, N, K/32, 1] -> out_dtype [Mp, N]; rows no item covers are left unwritten. Grid (N/bn, I),
    n tiles fastest, so programs running together share one item's rows and one group's weights."""
    m, half = x_even.shape
    n = codes.shape[1]
    w4a8 = x_scales is not None
    kernel = functools.partial(
        _grouped_kernel, blocks=blocks, n_k=2 * half // blocks.bk, w4a8=w4a8, interpret=interpret,
    )
    operands = [items, x_even, x_odd] + ([x_scales] if w4a8 else []) + [codes, scales]
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
        grid=(n // blocks.bn, items.shape[1]),
        compiler_params=triton_params(blocks.num_warps, blocks.num_stages, interpret),
        interpret=interpret,
        name="grouped_mx_matmul_w4a8" if w4a8 else "grouped_mx_matmul",
    )(*operands)


def _decode_kernel(codes_ref, scales_ref, o_ref, *, method: str, interpret: bool):
    """Refs: codes [bn, g, 16], scales [bn, g, 1], out bf16 [bn, 2, 16 g] (even, odd plane)."""
    even, odd = decode_weight_planes(codes_ref[...], scales_ref[...], method, interpret)
    o_ref[:, 0, :] = even
    o_ref[:, 1, :] = odd


def decode_mxfp4_pallas(codes: Array, scales: Array, *, blocks: MXBlocks, interpret: bool) -> Array:
    """codes uint8 [N, K/32, 16] (N % bn == 0), scales uint8 [N, K/32, 1] -> bf16 [N, 2, K/2]:
    per row the even elements (w[:, 0::2]) then the odd ones (w[:, 1::2]); reshaped to [N, K] it
    multiplies x with its columns in the same order. Grid (N/bn, K/bk), one [bn, bk] tile each."""
    n, n_blocks, _ = codes.shape
    bn, g = blocks.bn, blocks.bk // BLOCK
    spec = lambda width: pl.BlockSpec((bn, g, width), lambda i, j: (i, j, 0))
    return pl.pallas_call(
        functools.partial(_decode_kernel, method=blocks.decode, interpret=interpret),
        out_shape=jax.ShapeDtypeStruct((n, 2, n_blocks * SCALE_BLOCK_BYTES), COMPUTE_DTYPE),
        grid=(n // bn, n_blocks // g),
        in_specs=[spec(SCALE_BLOCK_BYTES), spec(1)],
        out_specs=pl.BlockSpec((bn, 2, g * SCALE_BLOCK_BYTES), lambda i, j: (i, 0, j)),
        compiler_params=triton_params(blocks.num_warps, blocks.num_stages, interpret),
        interpret=interpret,
        name="mxfp4_decode",
    )(codes, scales)


__all__ = [
    "COMPUTE_DTYPE",
    "MXBlocks",
    "decode_activation_tile",
    "decode_mxfp4_pallas",
    "decode_weight_planes",
    "grouped_mx_matmul_pallas",
    "mx_matmul_pallas",
]
