"""MXFP4 dense matmul for a few rows of x (decode), lowered through Mosaic GPU (Hopper wgmma).

``y [M, N] = x [M, K] @ w [N, K]^T`` for M <= 64, computed transposed: each program (one warpgroup)
owns 64 weight rows and walks K in steps of ``bk``. Per step TMA brings the step's code bytes
[64, bk/2] and x tile [Mp, bk] into shared memory (``stages`` steps in flight); every thread reads
its own code words, decodes them in registers straight into wgmma's A-operand register layout, and
one wgmma multiplies them by the x tile (B operand, Mp = M padded to a multiple of 8 as wgmma's N)
into a float32 [64, Mp] accumulator.

No shuffle: wgmma's A layout gives thread (warp w, lane l) rows 16 w + l / 4 (+ 8) and column pairs
8 t + 2 (l % 4) + {0, 1}. Thread c = l % 4 takes, of each of its rows, the ``bk / 128`` 16-byte
chunks (one 32-element scale block each) starting at chunk c bk / 128: four 32-bit words, eight
nibbles each. Output register j of a word holds its nibbles 3 - j and 7 - j, which sit at the same
place of the word's two 16-bit halves: one shift moves their magnitude bits to bf16 bits 6-8, one
shift of the sign bits of the nibbles of that parity (masked once per word) moves their signs to bits
15 and 31, and a ``lop3`` merges the two (``_output_steps``); that is a bf16x2 of the two E2M1 values
times 2**-126 (code 1 the subnormal 2**-127). One bf16x2 multiply by 2**126 times the block scale gives
the elements exactly where that factor is a finite bf16 (scale byte <= 128), else two (by 2**126,
then by the scale); the choice is made once per step for a whole warp (a vote), so the branch is
uniform. That register is column pair t of the A operand, so contracted index k =
``k_permutation(bk)[p]`` sits at column p; x's columns are permuted the same way outside the kernel
(``x_operand``: a transpose over [M, K]), and the sum over k does not care about the order. ptxas makes 17
instructions of a word (8 elements); the whole step about 3.0 per weight element (H200, README).

Scales: the program's [64, K/32] scale bytes are loaded once (one TMA) and read per step. A slot is
refilled after a warpgroup barrier without a memory fence (its tiles were only read). Pallas' automatic
warpgroup barriers (one before every TMA copy and around shared-memory stores) are off
(``unsafe_no_auto_barriers``): that refill barrier orders the reads before a copy into their slot, and
``commit_smem`` (fence and barrier) the output tile's stores before its copy out; each slot is read only
after its mbarrier wait, and no thread reads what it writes.

In interpret mode (CPU) the register decode runs as ``_decode_emulated``: the same words, shifts,
masks and register-to-column map in jnp, and the wgmma is a jnp matrix product (the interpreter's
wgmma takes no transposed operand).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from k3jax.mx import BLOCK, ZERO_BLOCK_SCALE_BYTE
from k3jax.typing import Array
from pallas_kernels._mosaic_gpu import interpret_params, store_transposed, swizzled
from pallas_kernels.mx_matmul.triton import (
    _BF16X2_2_POW_126,
    _BF16X2_NEG_ZERO,
    _MAGNITUDE_MASK,
    _times_bias_and_scale,
)
from pallas_kernels.mx_matmul.layout import pad_axis

ROWS = 64  # weight rows per program: one wgmma M tile, one warpgroup
CHUNK_BYTES = 16  # code bytes per 32-element scale block
_TMA_MAX_BOX = 256  # elements per dimension of one TMA copy
_SCALE_COLUMN_ALIGN = 16  # a TMA row must be a multiple of 16 bytes
_F32, _BF16 = jnp.float32, jnp.bfloat16


@dataclasses.dataclass(frozen=True)
class MosaicBlocks:
    """bk: contracted elements per step (128 or 256: one or two scale blocks per thread and row);
    stages: steps whose tiles are in flight; out_mn: the kernel writes out [M, N] itself (each thread
    stores its accumulator values transposed into a shared [Mp, 64] tile, TMA copies its first M
    rows), so no XLA slice and transpose follow it (measured faster at M = 1 only, README)."""

    bk: int = 256
    stages: int = 2
    out_mn: bool = False

    def __post_init__(self):
        if self.bk not in (128, 256) or self.stages < 1:
            raise ValueError(f"bk must be 128 or 256 and stages >= 1, got {self}")


def _slot_sources(p, bk: int):
    """For A-operand columns p (int array, numpy or jnp) of a bk tile: (chunk of the thread's
    column group, word in chunk, output j of the word, half v)."""
    chunks = bk // 128  # per thread and row
    t, lane_col, v = p // 8, (p % 8) // 2, p % 2
    a, word, j = t // 16, (t // 4) % 4, t % 4
    return chunks * lane_col + a, word, j, v


def k_permutation(bk: int) -> np.ndarray:
    """int [bk]: the contracted index (within a bk tile) that A-operand column p holds. Output j of
    a word holds its nibbles 3 - j (low half) and 7 - j (high half); nibble i of word W is k = 8 W + i."""
    chunk, word, j, v = _slot_sources(np.arange(bk), bk)
    return 8 * (4 * chunk + word) + 3 - j + 4 * v


def _scale_bf16_bits(s):
    """uint32 E8M0 bytes -> bf16 bits of 2**(s - 127) (byte 0: the subnormal 2**-127; 255: NaN)."""
    bits = jnp.where(s == 0, jnp.uint32(0x40), s << 7)
    return jnp.where(s == 255, jnp.uint32(0x7FC0), bits)


_SIGN_BITS = (0x80808080, 0x08080808)  # the sign bits of a word's odd / even nibbles
_MERGE = 0xE4  # lop3 table of (a & c) | (b & ~c)


def _output_steps(j: int) -> tuple[int, int, int]:
    """How output j of a word (nibbles 3 - j and 7 - j) is made: (magnitude shift, sign source mask,
    sign shift), shifts to the left (negative: to the right). The magnitude bits 12-14 - 4 j of each half
    go to bits 6-8; the sign bits 15 - 4 j go to bit 15, taken from the sign bits of the nibbles of
    that parity only, so that after the shift the sign word has bits only at 15 and 31 or in the
    magnitude field (7, 23), which the merge takes from the magnitude word."""
    return 4 * j - 6, _SIGN_BITS[j % 2], 4 * j


def _shift(x, n: int):
    """uint32 x shifted left by n (negative: logically right by -n), bits past 32 dropped."""
    return x << n if n >= 0 else x >> -n


def _decode_emulated(codes: Array, scales: Array, bk: int) -> Array:
    """jnp twin of ``_decode_registers`` for interpret mode: uint8 codes [64, bk/2], scales
    [64, bk/32] -> bf16 [64, bk] with column p holding k = k_permutation(bk)[p]."""
    b = codes.astype(jnp.uint32).reshape(ROWS, bk // 8, 4)
    words = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)  # [64, bk/8]
    chunk, word, j, v = _slot_sources(jax.lax.iota(jnp.int32, bk), bk)  # iota: no captured constants
    w = words[:, 4 * chunk + word]  # [64, bk]: the word of each column
    outputs = []
    for jj in range(4):
        magnitude_shift, sign_bits, sign_shift = _output_steps(jj)
        a, s = _shift(w, magnitude_shift), _shift(w & jnp.uint32(sign_bits), sign_shift)
        outputs.append((a & jnp.uint32(_MAGNITUDE_MASK)) | (s & ~jnp.uint32(_MAGNITUDE_MASK)))
    raw = jnp.select([j == jj for jj in range(4)], outputs)
    half = jnp.where(v == 1, raw >> 16, raw & 0xFFFF)
    scale = scales[:, chunk].astype(jnp.uint32)
    return _times_bias_and_scale(half, jax.lax.bitcast_convert_type(
        _scale_bf16_bits(scale).astype(jnp.uint16), _BF16))


def _ptx_shift(dst: str, src: str, n: int) -> str:
    return f"shl.b32 {dst}, {src}, {n};" if n >= 0 else f"shr.b32 {dst}, {src}, {-n};"


def _decode_asm(one_multiply: bool) -> str:
    """Inline PTX of one code word: outputs $0-$3 the bf16x2 registers of outputs j = 0..3, inputs
    $4 the word and $5 the factor as bf16x2: the block scale (two multiplies: by 2**126, then by
    the scale) or, with one_multiply, 2**126 times the scale (exact in bf16 for scale bytes <= 128).
    Per output (``_output_steps``): one shift of the word for the magnitudes, one of the masked sign
    bits (none for j = 0), one lop3 merge and the multiplies; the two sign masks once per word."""
    lines = ["{", ".reg .b32 w, sc, a, s, bias, nz, sign0, sign1;", "mov.b32 w, $4;", "mov.b32 sc, $5;",
             f"mov.b32 bias, {_BF16X2_2_POW_126:#x};", f"mov.b32 nz, {_BF16X2_NEG_ZERO:#x};"]
    lines += [f"and.b32 sign{p}, w, {bits:#x};" for p, bits in enumerate(_SIGN_BITS)]
    for j in range(4):
        magnitude_shift, _, sign_shift = _output_steps(j)
        lines += [_ptx_shift("a", "w", magnitude_shift), _ptx_shift("s", f"sign{j % 2}", sign_shift),
                  f"lop3.b32 a, a, s, {_MAGNITUDE_MASK:#x}, {_MERGE:#x};"]
        lines += [] if one_multiply else ["fma.rn.bf16x2 a, a, bias, nz;"]
        lines += [f"fma.rn.bf16x2 ${j}, a, sc, nz;"]
    return "\n".join(lines + ["}"])


# Warp vote: $0 = 1 if any lane's $1 is nonzero (uniform over the warp, so a branch on it is too).
_ANY_IN_WARP = ("{ .reg .pred p, q; setp.ne.u32 p, $1, 0; vote.sync.any.pred q, p, 0xffffffff; "
                "selp.u32 $0, 1, 0, q; }")
_ONE_MULTIPLY_MAX_SCALE = 128  # 2**126 * 2**(s - 127) = 2**(s - 1) is a finite bf16 up to here (255 is NaN)


def _decode_registers(bk: int):
    """Inline Mosaic GPU function (ctx, codes_ref [64, bk/2] uint8, scales_ref [64, bk/32] uint8
    in shared memory) -> bf16 [64, bk] in the WGMMA register layout (column p = k_permutation[p])."""
    import jax.experimental.mosaic.gpu as mgpu
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, llvm, memref, scf

    chunks = bk // 128

    @plgpu.inline_mgpu(
        arg_types=(plgpu.RefType(), plgpu.RefType()),
        return_type=plgpu.ShapeDtypeStruct((ROWS, bk), _BF16, layout=plgpu.Layout.WGMMA),
    )
    def decode(ctx, codes_ref, scales_ref):
        del ctx
        i32, i64 = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(64)
        index = ir.IndexType.get()
        bf16x2 = ir.VectorType.get((2,), ir.BF16Type.get())
        words_ty = ir.VectorType.get((4,), i32)
        c = lambda v, ty=i32: arith.constant(ty, v)
        layout = mgpu.WGMMA_LAYOUT
        row0, col0 = next(iter(layout.thread_idxs((ROWS, bk))))  # register (t=0, h=0): row, 2 (l % 4)
        lane_col = arith.divui(arith.index_cast(i32, col0), c(2))
        row0 = arith.index_cast(i32, row0)
        base = mgpu.utils.memref_ptr(codes_ref)
        struct_ty = llvm.StructType.get_literal([i32] * 4)
        eq = lambda v, k: arith.cmpi(arith.CmpIPredicate.eq, v, c(k))
        x2 = lambda bits: arith.ori(bits, arith.shli(bits, c(16)))
        loads, big = [], c(0)  # (register t, h, words, scale byte) per chunk; any byte > 128
        for h in range(2):
            row = arith.addi(row0, c(8 * h))
            for a in range(chunks):
                chunk = arith.addi(arith.muli(lane_col, c(chunks)), c(a))
                offset = arith.addi(arith.muli(row, c(bk // 2)), arith.muli(chunk, c(CHUNK_BYTES)))
                ptr = mgpu.utils.getelementptr(base, [arith.extui(i64, offset)], ir.IntegerType.get_signless(8))
                s = arith.extui(i32, memref.load(scales_ref, [arith.index_cast(index, row),
                                                              arith.index_cast(index, chunk)]))
                loads.append((16 * a, h, llvm.load(words_ty, ptr, alignment=16), s))
                over = arith.cmpi(arith.CmpIPredicate.ugt, s, c(_ONE_MULTIPLY_MAX_SCALE))  # 255 too
                big = arith.ori(big, arith.extui(i32, over))

        def decoded(one_multiply: bool) -> list:
            """The 2 * bk / 8 bf16x2 registers, as i32, in the order of ``loads``."""
            asm = _decode_asm(one_multiply)
            regs = []
            for _, _, words, s in loads:
                if one_multiply:  # 2**(s - 1) in both halves, s <= 128: ((s + 126) << 7) * 0x10001
                    factor = arith.addi(arith.muli(s, c(0x00800080)), c(0x3F003F00))
                else:  # 2**(s - 127): byte 0 the subnormal 2**-127, 255 NaN
                    bits = arith.select(eq(s, 0), c(0x40), arith.shli(s, c(7)))
                    factor = x2(arith.select(eq(s, 255), c(0x7FC0), bits))
                for word in range(4):
                    out = llvm.inline_asm(struct_ty, [llvm.extractelement(words, c(word)), factor],
                                          asm, "=r,=r,=r,=r,r,r")
                    regs += [llvm.extractvalue(i32, out, [j]) for j in range(4)]
            return regs

        any_big = llvm.inline_asm(i32, [big], _ANY_IN_WARP, "=r,r")
        n_regs = len(loads) * 16
        cond = arith.cmpi(arith.CmpIPredicate.ne, any_big, c(0))
        try:
            branch = scf.IfOp(cond, [i32] * n_regs, has_else=True)
        except TypeError:  # MLIR's Python bindings before the snake-case keyword
            branch = scf.IfOp(cond, [i32] * n_regs, hasElse=True)
        with ir.InsertionPoint(branch.then_block):
            scf.yield_(decoded(one_multiply=False))
        with ir.InsertionPoint(branch.else_block):
            scf.yield_(decoded(one_multiply=True))
        out_regs = np.empty(layout.registers_shape((ROWS, bk)), dtype=object)
        for i, (t0, h, _, _) in enumerate(loads):
            for r in range(16):  # word r // 4, output r % 4
                out_regs[(0, t0 + r, 0, 0, h, 0, 0, 0, 0)] = mgpu.utils.bitcast(branch.results[16 * i + r], bf16x2)
        return mgpu.FragmentedArray(_registers=out_regs, _layout=layout, _is_signed=None)

    return decode


def _warpgroup_barrier():
    """Inline Mosaic GPU function (ctx): a barrier of the warpgroup's threads, no memory fence: the
    slot's tiles were only read (its codes by this thread's loads, its x tile by the finished wgmma)."""
    import jax.experimental.mosaic.gpu as mgpu

    @plgpu.inline_mgpu()
    def barrier(ctx):
        del ctx
        mgpu.utils.warpgroup_barrier()

    return barrier


def _kernel(codes_g, scales_g, x_g, out_g, codes_s, scales_s, x_s, out_s, bars, scale_bar, *,
            n_steps: int, m: int, blocks: MosaicBlocks, interpret: bool):
    """One program: 64 weight rows, one warpgroup."""
    row0 = jax.lax.axis_index("rows") * ROWS
    if blocks.out_mn:  # out_s [Mp, 64]: its first M rows
        out_src, out_dst = out_s.at[pl.ds(0, m)], out_g.at[:, pl.ds(row0, ROWS)]
    else:  # out_s [64, Mp]
        out_src, out_dst = out_s, out_g.at[pl.ds(row0, ROWS)]
    _program(codes_g, scales_g, x_g, pl.ds(row0, ROWS), slice(None), out_src, out_dst, codes_s, scales_s, x_s,
             out_s, bars, scale_bar, n_steps=n_steps, blocks=blocks, transposed_out=blocks.out_mn, interpret=interpret)


def _program(codes_g, scales_g, x_g, w_rows, x_rows, out_src, out_dst, codes_s, scales_s, x_s, out_s, bars,
             scale_bar, *, n_steps: int, blocks: MosaicBlocks, transposed_out: bool, interpret: bool):
    """A program's work: weight rows ``w_rows`` (64) of codes_g [., K/2] and scales_g [., K/32 padded]
    times rows ``x_rows`` (Mp) of x_g [., K] into a float32 [64, Mp] accumulator, stored to out_s
    (transposed: [Mp, 64]) and copied from its view ``out_src`` to GMEM ``out_dst``."""
    bk, stages = blocks.bk, blocks.stages
    n_scale_cols = scales_s.shape[1]

    def fetch(step, slot):
        plgpu.copy_gmem_to_smem(codes_g.at[w_rows, pl.ds(step * (bk // 2), bk // 2)], codes_s.at[slot], bars.at[slot])
        plgpu.copy_gmem_to_smem(x_g.at[x_rows, pl.ds(step * bk, bk)], x_s.at[slot], bars.at[slot])

    for start in range(0, n_scale_cols, _TMA_MAX_BOX):
        cols = pl.ds(start, min(_TMA_MAX_BOX, n_scale_cols - start))
        plgpu.copy_gmem_to_smem(scales_g.at[w_rows, cols], scales_s.at[:, cols], scale_bar.at[0])
    for step in range(min(stages, n_steps)):
        fetch(step, step)
    plgpu.barrier_wait(scale_bar.at[0])
    decode = None if interpret else _decode_registers(bk)
    barrier = None if interpret else _warpgroup_barrier()

    def tiles(step, slot):
        scales = scales_s.at[:, pl.ds(step * (bk // BLOCK), bk // BLOCK)]
        plgpu.barrier_wait(bars.at[slot])
        if interpret:
            return _decode_emulated(codes_s[slot], scales[...], bk), x_s[slot]
        return decode(codes_s.at[slot], scales), None

    def release(step, slot):
        """The step's tiles are read: once every thread is past its reads, refill the slot with step + stages."""
        @pl.when(step + stages < n_steps)
        def _():
            if not interpret:
                barrier()
            fetch(step + stages, slot)

    if interpret:
        def step_fn(step, acc):
            slot = jax.lax.rem(step, stages)
            w, x = tiles(step, slot)
            acc = acc + jnp.dot(w, x.T, preferred_element_type=_F32)
            release(step, slot)
            return acc

        acc = jax.lax.fori_loop(0, n_steps, step_fn, jnp.zeros((ROWS, x_s.shape[1]), _F32))
    else:
        def accumulate(acc_ref):
            def step_fn(step, _):
                slot = jax.lax.rem(step, stages)
                w, _ = tiles(step, slot)
                plgpu.wgmma(acc_ref, w, plgpu.transpose_ref(x_s.at[slot], (1, 0)))
                plgpu.wgmma_wait(0)  # the A registers are rewritten by the next step's decode
                release(step, slot)
                return ()

            jax.lax.fori_loop(0, n_steps, step_fn, ())
            return acc_ref[...]

        acc = pl.run_scoped(accumulate, plgpu.ACC((ROWS, x_s.shape[1]), _F32))
    if transposed_out:
        if interpret:
            out_s[...] = acc.T.astype(out_s.dtype)
        else:
            store_transposed()(acc.astype(out_s.dtype), out_s)
    else:
        out_s[...] = acc.astype(out_s.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out_src, out_dst)
    plgpu.wait_smem_to_gmem(0)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _pad2(a: Array, rows: int, cols: int, value) -> Array:
    """a [..., R, C] padded to [..., rows, cols]."""
    return pad_axis(pad_axis(a, a.ndim - 2, rows, value), a.ndim - 1, cols, value)


def weight_operands(codes: Array, scales: Array, bk: int):
    """The programs' weight operands: codes [..., N, K/2] and scales [..., N, K/32] padded to 64-row
    tiles, bk steps and 16-byte scale rows (no copy at N % 64 == 0, K % bk == 0, K % 512 == 0).
    Returns (codes, scales, N padded, K padded, scale columns)."""
    n, k = codes.shape[-2], codes.shape[-1] * 2
    np_, kp = _round_up(n, ROWS), _round_up(k, bk)
    n_scale_cols = _round_up(kp // BLOCK, _SCALE_COLUMN_ALIGN)
    return (_pad2(codes, np_, kp // 2, 0), _pad2(scales, np_, n_scale_cols, ZERO_BLOCK_SCALE_BYTE), np_, kp,
            n_scale_cols)


def x_operand(x: Array, rows: int, bk: int) -> Array:
    """x [M, K] as the programs' B operand: bf16 [rows, K padded to bk] with its columns permuted within each
    bk tile (``k_permutation``), so that column p of a tile holds the k that A-operand column p decodes."""
    kp = _round_up(x.shape[1], bk)
    x = _pad2(x.astype(_BF16), rows, kp, 0)
    # k_permutation as a transpose: k's digits (lane column, chunk part a, word, v, 3 - j) reordered to p's
    # (a, word, j, lane column, v); XLA makes a transpose of it, not an element-by-element gather
    digits = jnp.flip(x.reshape(rows, kp // bk, 4, bk // 128, 4, 2, 4), axis=-1)
    return digits.transpose(0, 1, 3, 4, 6, 2, 5).reshape(rows, kp)


def _program_scratch(blocks: MosaicBlocks, n_scale_cols: int, x_rows: int, out_shape: tuple, out_dtype) -> list:
    """``_program``'s shared memory and barriers: code and x tile slots, the scales, the output tile."""
    bk, stages = blocks.bk, blocks.stages
    return [
        plgpu.SMEM((stages, ROWS, bk // 2), jnp.uint8),
        plgpu.SMEM((ROWS, n_scale_cols), jnp.uint8),
        plgpu.SMEM((stages, x_rows, bk), _BF16, transforms=swizzled(bk)),  # x tiles (B): 8 x 64, 128-byte swizzle
        plgpu.SMEM(out_shape, out_dtype),
        plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        plgpu.Barrier(num_arrivals=-(-n_scale_cols // _TMA_MAX_BOX), num_barriers=1),
    ]


def rows_padded(m: int) -> int:
    """M padded to wgmma's N: a multiple of 8."""
    return _round_up(max(m, 1), 8)


def mx_matmul_mosaic(x: Array, codes: Array, scales: Array, *, blocks: MosaicBlocks = MosaicBlocks(),
                     out_dtype=_F32, interpret=False) -> Array:
    """x bf16 [M, K] (M <= 64), MXFP4 codes uint8 [N, K/2], scales uint8 [N, K/32] -> out_dtype
    [M, N] (float32 accumulation, rounded once; the kernel writes [N, Mp], transposed outside, or
    with ``out_mn`` [M, N] itself).

    Pads N to 64 rows, K to bk and the scale columns to 16 bytes (no copy at N % 64 == 0,
    K % bk == 0, K % 512 == 0), pads x to Mp rows and permutes its columns within each bk tile
    (``k_permutation``). ``interpret``: False on the GPU, or ``interpret_params()`` on a CPU.
    """
    m = x.shape[0]
    n = codes.shape[0]
    mp = rows_padded(m)
    if mp > 64:
        raise ValueError(f"mx_matmul_mosaic takes at most 64 rows of x, got {m}")
    codes, scales, np_, kp, n_scale_cols = weight_operands(codes, scales, blocks.bk)
    x_in = x_operand(x, mp, blocks.bk)
    scratch = _program_scratch(blocks, n_scale_cols, mp, (mp, ROWS) if blocks.out_mn else (ROWS, mp), out_dtype)
    kernel = functools.partial(_kernel, n_steps=kp // blocks.bk, m=m, blocks=blocks, interpret=bool(interpret))
    out = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((m, np_) if blocks.out_mn else (np_, mp), out_dtype),
        scratch_types=scratch, grid=(np_ // ROWS,), grid_names=("rows",),
        compiler_params=plgpu.CompilerParams(unsafe_no_auto_barriers=True), interpret=interpret or None,
    )(codes, scales, x_in)
    return out[:, :n] if blocks.out_mn else out[:n, :m].T


__all__ = ["MosaicBlocks", "interpret_params", "k_permutation", "mx_matmul_mosaic", "rows_padded"]
