"""MXFP4 dense matmul for a few rows of x (decode): independent warps, codes loaded ahead into registers,
``mma.sync`` on the tensor cores; lowered through Mosaic GPU.

``y [M, N] = x [M, K] @ w [N, K]^T`` for M <= 16. Each warp owns 16 weight rows and walks its share of
K in steps of ``bk``. Nothing is shared between warps while they stream: each thread loads its own
code bytes straight from global memory into registers (16-byte loads that skip L1), ``ahead`` steps
before it uses them, decodes them in registers (the inline PTX of ``mosaic_gpu._decode_asm``, straight
into the A fragment of ``mma.sync.m16n8k16``) and multiplies them by x's B fragments, which it loads
from a small, L1-resident copy of x that XLA lays out in fragment order beforehand. No shared-memory
pipeline, no barriers, no warpgroup: the SM's warps are as many independent load chains as registers
allow, which the one-warpgroup wgmma kernel (``mosaic_gpu.py``) cannot have.

Fragments (PTX ISA, ``mma.m16n8k16`` with bf16): thread (g = lane / 4, c = lane % 4) holds A rows g
and g + 8 at columns 2c + {0, 1} (registers a0, a1) and 2c + 8 + {0, 1} (a2, a3); B (x transposed)
columns n = g at rows 2c + {0, 1} (b0) and 2c + 8 + {0, 1} (b1); the accumulator rows g, g + 8 at
columns 2c + {0, 1}. Per step and row a thread reads the step's 16-byte code chunks c + 4a
(a < bk / 128: 64 contiguous bytes per row across the four threads of a row), four 32-bit words each;
output j of a word (nibbles 3 - j and 7 - j) is one bf16x2 register. mma q of the step takes word
(q % 8) // 2 of chunk a = q // 8, outputs j = 2 (q % 2) (a0 / a1, rows g / g + 8) and j + 1 (a2 / a3),
so the A operand's column p of the step holds contracted index ``k_permutation(bk)[p]``; x's B
fragments are gathered to match (``fragment_x``), and the sum over k does not care about the order.

A program (Pallas' one warpgroup: 4 warps) covers 64 / k_split rows: with ``k_split`` > 1 its warps
split each 16-row slab's K steps, and the partial sums meet once at the end in shared memory. The
scale of each 32-element block multiplies its decoded weights, as in ``mosaic_gpu.py``: one bf16x2
multiply by 2**126 times the scale where that is a finite bf16 (scale byte <= 128), else two; a warp
vote picks the branch per step.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import mosaic_gpu as plgpu

from k3jax.mx import BLOCK, ZERO_BLOCK_SCALE_BYTE
from k3jax.typing import Array
from pallas_kernels.mx_matmul.mosaic_gpu import _ANY_IN_WARP, _decode_asm, _pad2, _round_up

WARPS = 4  # per program: one Mosaic GPU warpgroup
SLAB = 16  # weight rows per warp: mma's M
MAX_M = 16  # two n tiles of 8
TABLE_ENTRIES = 256  # code bytes
_F32, _BF16 = jnp.float32, jnp.bfloat16


@dataclasses.dataclass(frozen=True)
class WarpBlocks:
    """bk: contracted elements per step (128, 256 or 512: 1, 2 or 4 code chunks per thread and row);
    ahead: steps whose codes are loaded before the one being multiplied; k_split: warps of a program
    that share a 16-row slab, each taking a contiguous part of its K steps (1, 2 or 4)."""

    bk: int = 256
    ahead: int = 1
    k_split: int = 1
    pinned: bool = False
    multiply_shifts: bool = False
    unroll: bool = False
    table: bool = False

    def __post_init__(self):
        if self.bk not in (128, 256, 512) or self.ahead < 1 or self.k_split not in (1, 2, 4):
            raise ValueError(f"bk must be 128, 256 or 512, ahead >= 1 and k_split 1, 2 or 4, got {self}")


def _a_source(q, col):
    """For A column col (< 16) of mma q of a step: (chunk a, word, output j, half v)."""
    return q // 8, (q % 8) // 2, 2 * (q % 2) + col // 8, col % 2


def k_permutation(bk: int, table: bool = False) -> np.ndarray:
    """int [bk]: the contracted index (within a step) that A column p = 16 q + col holds. Thread column
    c = (col % 8) // 2 reads chunk c + 4a; nibble i of word W of a chunk is element 8 W + i. Output j
    of a word: nibbles 3 - j and 7 - j (shift decode) or byte j's two nibbles (table decode)."""
    p = np.arange(bk)
    q, col = p // 16, p % 16
    a, word, j, v = _a_source(q, col)
    c = (col % 8) // 2
    return 32 * (c + 4 * a) + 8 * word + (2 * j + v if table else 3 - j + 4 * v)


def fragment_x(x: Array, bk: int, table: bool = False) -> Array:
    """bf16 x [M, Kp] -> uint32 [Kp / bk, M, bk / 32, 4, 4], flat, then bk / 2 zeros (what the threads of
    rows n >= M read, at every step): per step, row n and 16-byte load i, thread column c's four B
    registers: b0, b1 of mma 2i, then of mma 2i + 1 (bf16 pairs, the lower column in the low half)."""
    m, kp = x.shape
    steps = kp // bk
    i, c, qq, w2, v = np.meshgrid(np.arange(bk // 32), np.arange(4), np.arange(2), np.arange(2), np.arange(2),
                                  indexing="ij")
    p = 16 * (2 * i + qq) + 8 * w2 + 2 * c + v  # A column, in the order of the fragment's bf16 values
    columns = (np.arange(steps)[:, None] * bk + k_permutation(bk, table)[p.reshape(-1)][None, :]).reshape(-1)
    xs = x[:, columns].reshape(m, steps, bk)  # [M, step, bk] in fragment order
    pairs = jax.lax.bitcast_convert_type(xs.reshape(m, steps, bk // 2, 2), jnp.uint32)
    fragments = pairs.reshape(m, steps, bk // 32, 4, 4).transpose(1, 0, 2, 3, 4).reshape(-1)
    return jnp.concatenate([fragments, jnp.zeros(bk // 2, jnp.uint32)])


def _mma_asm() -> str:
    return ("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {$0, $1, $2, $3}, {$4, $5, $6, $7}, "
            "{$8, $9}, {$10, $11, $12, $13};")


def _body(*, m: int, n_steps: int, np_: int, kp: int, n_scale_cols: int, blocks: WarpBlocks, out_bf16: bool):
    """The program, as one inline Mosaic GPU function (ctx, codes, scales, x fragments, out in global
    memory; partial sums in shared memory)."""
    import jax.experimental.mosaic.gpu as mgpu
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, llvm, scf

    bk, ahead, ks = blocks.bk, blocks.ahead, blocks.k_split
    chunks = bk // 128  # per thread and row and step
    scale_words = bk // 128  # 32-bit words of a row's scale bytes per step
    n_tiles = -(-m // 8)

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),) * 6)
    def body(ctx, codes_ref, scales_ref, xf_ref, out_ref, partial_ref, table_ref):
        del ctx
        i32, i64, f32 = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(64), ir.F32Type.get()
        index = ir.IndexType.get()
        c = lambda v, ty=i32: arith.constant(ty, v)
        asm = lambda ty, operands, text, constraints, effects=False: llvm.inline_asm(
            ty, operands, text, constraints, has_side_effects=effects)
        struct = lambda n, ty=i32: llvm.StructType.get_literal([ty] * n)
        void = ir.Type.parse("!llvm.void")
        fields = lambda value, n, ty=i32: [llvm.extractvalue(ty, value, [k]) for k in range(n)]

        def global_address(ref):
            ptr = llvm.ptrtoint(i64, mgpu.utils.memref_ptr(ref))
            return asm(i64, [ptr], "cvta.to.global.u64 $0, $1;", "=l,l")

        pin = blocks.pinned

        def load(address, n, cached: bool):
            hint = "" if cached else ".L1::no_allocate"
            vec = {1: "", 2: ".v2", 4: ".v4"}[n]
            regs = ", ".join(f"${k}" for k in range(n))
            text = f"ld.global.nc{hint}{vec}.u32 {{{regs}}}, [${n}];" if n > 1 else f"ld.global.nc{hint}.u32 $0, [$1];"
            out = asm(struct(n) if n > 1 else i32, [address], text, ",".join(["=r"] * n + ["l"]), effects=pin)
            return fields(out, n) if n > 1 else [out]

        wide = lambda v: arith.extui(i64, v)
        add64 = lambda base, offset: arith.addi(base, wide(offset))
        special = lambda name: asm(i32, [], f"mov.u32 $0, %{name};", "=r")

        tid, pid = special("tid.x"), special("ctaid.x")
        warp, lane = arith.shrui(tid, c(5)), arith.andi(tid, c(31))
        g, tc = arith.shrui(lane, c(2)), arith.andi(lane, c(3))
        slab, part = arith.divui(warp, c(ks)), arith.remui(warp, c(ks))
        row0 = arith.addi(arith.muli(pid, c(WARPS * SLAB // ks)), arith.addi(arith.muli(slab, c(SLAB)), g))
        rows = [row0, arith.addi(row0, c(8))]
        first = arith.divui(arith.muli(part, c(n_steps)), c(ks))
        last = arith.divui(arith.muli(arith.addi(part, c(1)), c(n_steps)), c(ks))

        codes_base, scales_base, xf_base, out_base = map(global_address, (codes_ref, scales_ref, xf_ref, out_ref))
        code_rows = [add64(codes_base, arith.addi(arith.muli(r, c(kp // 2)), arith.muli(tc, c(16)))) for r in rows]
        scale_rows = [add64(scales_base, arith.muli(r, c(n_scale_cols))) for r in rows]
        n_rows = [arith.addi(g, c(8 * t)) for t in range(n_tiles)]
        x_valid = [arith.cmpi(arith.CmpIPredicate.ult, n, c(m)) for n in n_rows]
        zero_block = c(n_steps * m * bk // 32 * 64)  # fragment_x's zeros after the steps
        x_rows = [add64(xf_base, arith.addi(arith.select(ok, arith.muli(n, c(bk // 32 * 64)), zero_block),
                                            arith.muli(tc, c(16)))) for n, ok in zip(n_rows, x_valid)]
        x_strides = [arith.select(ok, c(m * bk // 32 * 64), c(0)) for ok in x_valid]
        scale_shift = arith.muli(tc, c(8))
        byte_pair = arith.addi(arith.muli(tc, c(0x101)), c(0x4040))  # prmt selector: byte tc, 0, byte tc, 0

        table = blocks.table
        if table:  # decode table: bf16x2 of byte e's two nibbles at [e][lane], then 2**(s - 127) at [256 * 32 + s]
            table_base = llvm.ptrtoint(i32, mgpu.utils.memref_ptr(table_ref))
            lane_table = arith.addi(table_base, arith.muli(lane, c(4)))
            factor_table = arith.addi(table_base, c(TABLE_ENTRIES * 32 * 4))
            fill = _decode_asm(True)
            for e_off in (0, WARPS * 32):
                e = arith.addi(tid, c(e_off))
                word = arith.ori(arith.andi(e, c(15)), arith.shli(arith.shrui(e, c(4)), c(16)))  # nibbles 0, 4
                value = fields(asm(struct(4), [word, c(0x7E807E80)], fill, "=r,=r,=r,=r,r,r"), 4)[3]
                row = arith.addi(table_base, arith.muli(e, c(32 * 4)))
                for i in range(8):
                    asm(void, [arith.addi(row, c(16 * i)), value], "st.shared.v4.u32 [$0], {$1, $1, $1, $1};", "r,r",
                        effects=True)
                bits = arith.select(arith.cmpi(arith.CmpIPredicate.eq, e, c(0)), c(0x40), arith.shli(e, c(7)))
                bits = arith.select(arith.cmpi(arith.CmpIPredicate.eq, e, c(255)), c(0x7FC0), bits)
                asm(void, [arith.addi(factor_table, arith.muli(e, c(4))), arith.ori(bits, arith.shli(bits, c(16)))],
                    "st.shared.u32 [$0], $1;", "r,r", effects=True)
            asm(void, [], "bar.sync 1, 128;", "", effects=True)
            scale_byte = arith.addi(tc, c(0x4440))  # prmt selector: byte tc, then zeros
        lds = lambda address: asm(i32, [address], "ld.shared.u32 $0, [$1];", "=r,r", effects=True)
        prmt = lambda word, selector: asm(i32, [word, selector], "prmt.b32 $0, $1, 0, $2;", "=r,r,r")

        def fetch(step):
            """Step ``step``'s code words [row][chunk][4] and scale words [row][word], flat."""
            words = []
            for r in range(2):
                for a in range(chunks):
                    offset = arith.addi(arith.muli(step, c(bk // 2)), c(64 * a))
                    words += load(add64(code_rows[r], offset), 4, cached=False)
            for r in range(2):
                words += load(add64(scale_rows[r], arith.muli(step, c(bk // 32))), scale_words, cached=True)
            return words

        n_fetched = 2 * chunks * 4 + 2 * scale_words

        def multiply(step, fetched, acc, one_multiply: bool):
            codes, scale_regs = fetched[:2 * chunks * 4], fetched[2 * chunks * 4:]
            factors = []
            for r in range(2):
                row_factors = []
                for a in range(chunks):
                    word = scale_regs[r * scale_words + a]
                    if table:
                        row_factors.append(lds(arith.addi(factor_table, arith.muli(prmt(word, scale_byte), c(4)))))
                        continue
                    if one_multiply:  # 2**(s - 1) in both halves: ((s + 126) << 7) * 0x10001
                        pair = asm(i32, [word, byte_pair], "prmt.b32 $0, $1, 0, $2;", "=r,r,r")
                        row_factors.append(arith.addi(arith.muli(pair, c(0x80)), c(0x3F003F00)))
                        continue
                    s = arith.andi(arith.shrui(word, scale_shift), c(255))  # 2**(s - 127): byte 0 2**-127, 255 NaN
                    bits = arith.select(arith.cmpi(arith.CmpIPredicate.eq, s, c(0)), c(0x40), arith.shli(s, c(7)))
                    bits = arith.select(arith.cmpi(arith.CmpIPredicate.eq, s, c(255)), c(0x7FC0), bits)
                    row_factors.append(arith.ori(bits, arith.shli(bits, c(16))))
                factors.append(row_factors)
            xregs = []  # [tile][load i][4]
            for t in range(n_tiles):
                base = add64(x_rows[t], arith.muli(step, x_strides[t]))
                xregs.append([load(add64(base, c(64 * i)), 4, cached=True) for i in range(bk // 32)])
            decode = _decode_asm(one_multiply, blocks.multiply_shifts)
            acc = list(acc)
            for a in range(chunks):
                for word in range(4):
                    outs = []  # [row][j]
                    for r in range(2):
                        code = codes[(r * chunks + a) * 4 + word]
                        if table:
                            outs.append([asm(i32, [lds(arith.addi(lane_table, arith.muli(prmt(code, c(0x4440 + b)),
                                                                                          c(32 * 4)))),
                                                   factors[r][a]], "mul.rn.bf16x2 $0, $1, $2;", "=r,r,r")
                                         for b in range(4)])
                            continue
                        out = asm(struct(4), [code, factors[r][a]], decode, "=r,=r,=r,=r,r,r")
                        outs.append(fields(out, 4))
                    for half in range(2):
                        q = 8 * a + 2 * word + half
                        j = 2 * half
                        a_regs = [outs[0][j], outs[1][j], outs[0][j + 1], outs[1][j + 1]]
                        for t in range(n_tiles):
                            b_regs = xregs[t][q // 2][2 * (q % 2): 2 * (q % 2) + 2]
                            k = 4 * t
                            out = asm(struct(4, f32), a_regs + b_regs + acc[k:k + 4], _mma_asm(),
                                      "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", effects=pin)
                            acc[k:k + 4] = fields(out, 4, f32)
            return acc

        def step_with_branch(step, fetched, acc):
            if table:
                return multiply(step, fetched, acc, one_multiply=True)
            big = c(0)
            for reg in fetched[2 * chunks * 4:]:  # every byte of the rows' scale words: other threads' chunks too
                big = arith.ori(big, reg)
            big = arith.andi(big, c(0x80808080))  # a byte >= 128 somewhere (128 itself included: still exact)
            any_big = asm(i32, [big], _ANY_IN_WARP, "=r,r")
            cond = arith.cmpi(arith.CmpIPredicate.ne, any_big, c(0))
            try:
                branch = scf.IfOp(cond, [f32] * len(acc), has_else=True)
            except TypeError:  # MLIR's Python bindings before the snake-case keyword
                branch = scf.IfOp(cond, [f32] * len(acc), hasElse=True)
            with ir.InsertionPoint(branch.then_block):
                scf.yield_(multiply(step, fetched, acc, one_multiply=False))
            with ir.InsertionPoint(branch.else_block):
                scf.yield_(multiply(step, fetched, acc, one_multiply=True))
            return list(branch.results)

        if blocks.unroll:  # every part has n_steps / ks steps: straight-line code, no registers rotated
            count = n_steps // ks
            acc = [arith.constant(f32, 0.0)] * (4 * n_tiles)
            sets = {d: fetch(arith.addi(first, c(d))) for d in range(min(ahead, count))}
            for i in range(count):
                if i + ahead < count:
                    sets[i + ahead] = fetch(arith.addi(first, c(i + ahead)))
                acc = step_with_branch(arith.addi(first, c(i)), sets.pop(i), acc)
        last_step = arith.subi(last, c(1))
        clamp = lambda s: arith.minui(s, last_step)
        queue = []
        for d in range(0 if blocks.unroll else ahead):
            queue += fetch(clamp(arith.addi(first, c(d))))
        acc0 = [arith.constant(f32, 0.0)] * (4 * n_tiles)
        if not blocks.unroll:
            loop = scf.ForOp(arith.index_cast(index, first), arith.index_cast(index, last), c(1, index), acc0 + queue)
            with ir.InsertionPoint(loop.body):
                step = arith.index_cast(i32, loop.induction_variable)
                carried = list(loop.inner_iter_args)
                acc, queue = carried[:4 * n_tiles], carried[4 * n_tiles:]
                new = fetch(clamp(arith.addi(step, c(ahead))))
                acc = step_with_branch(step, queue[:n_fetched], acc)
                scf.yield_(acc + queue[n_fetched:] + new)
            acc = list(loop.results)[:4 * n_tiles]

        if ks > 1:  # partial sums of a slab meet in shared memory: partial_ref [WARPS, 32, 4 n_tiles]
            from jax._src.lib.mlir.dialects import memref
            idx = lambda v: arith.index_cast(index, v)
            for k, value in enumerate(acc):
                memref.store(value, partial_ref, [idx(warp), idx(lane), c(k, index)])
            asm(ir.Type.parse("!llvm.void"), [], "bar.sync 1, 128;", "", effects=True)
            for other in range(1, ks):  # read by part 0 only; the index stays in bounds for every warp
                source = idx(arith.addi(arith.muli(slab, c(ks)), c(other)))
                acc = [arith.addf(value, memref.load(partial_ref, [source, idx(lane), c(k, index)]))
                       for k, value in enumerate(acc)]
        writer = c(1) if ks == 1 else arith.extui(i32, arith.cmpi(arith.CmpIPredicate.eq, part, c(0)))
        elem = 2 if out_bf16 else 4
        store = ("{ .reg .pred p; .reg .b16 h; setp.ne.u32 p, $2, 0; cvt.rn.bf16.f32 h, $1; @p st.global.b16 [$0], h; }"
                 if out_bf16 else "{ .reg .pred p; setp.ne.u32 p, $2, 0; @p st.global.f32 [$0], $1; }")
        for t in range(n_tiles):
            for v in range(2):
                n = arith.addi(arith.muli(tc, c(2)), c(8 * t + v))
                ok = arith.andi(writer, arith.extui(i32, arith.cmpi(arith.CmpIPredicate.ult, n, c(m))))
                for r in range(2):
                    offset = arith.muli(arith.addi(arith.muli(n, c(np_)), rows[r]), c(elem))
                    asm(ir.Type.parse("!llvm.void"), [add64(out_base, offset), acc[4 * t + 2 * r + v], ok], store,
                        "l,f,r", effects=True)

    return body


def mx_matmul_warps(x: Array, codes: Array, scales: Array, *, blocks: WarpBlocks = WarpBlocks(),
                    out_dtype=_F32) -> Array:
    """x bf16 [M, K] (M <= 16), MXFP4 codes uint8 [N, K/2], scales uint8 [N, K/32] -> out_dtype [M, N]
    (float32 accumulation, rounded once). Pads N to a program's rows, K to bk and the scale columns
    to 16 bytes (no copy at N % 64 == 0, K % bk == 0, K % 512 == 0). GPU only."""
    m, k = x.shape
    n = codes.shape[0]
    bk = blocks.bk
    if m > MAX_M:
        raise ValueError(f"mx_matmul_warps takes at most {MAX_M} rows of x, got {m}")
    if out_dtype not in (_F32, _BF16):
        raise ValueError(f"out_dtype must be float32 or bfloat16, got {out_dtype}")
    rows_per_program = WARPS * SLAB // blocks.k_split
    np_, kp = _round_up(n, rows_per_program), _round_up(k, bk)
    n_steps = kp // bk
    if blocks.unroll and n_steps % blocks.k_split:
        raise ValueError(f"unroll needs the {n_steps} steps of {bk} to split evenly over k_split = {blocks.k_split}")
    if n_steps < blocks.k_split:
        raise ValueError(f"K = {k} gives {n_steps} steps of {bk}, fewer than k_split = {blocks.k_split}")
    n_scale_cols = _round_up(kp // BLOCK, 16)
    codes = _pad2(codes, np_, kp // 2, 0)
    scales = _pad2(scales, np_, n_scale_cols, ZERO_BLOCK_SCALE_BYTE)
    xf = fragment_x(_pad2(x.astype(_BF16), m, kp, 0), bk, blocks.table)
    body = _body(m=m, n_steps=n_steps, np_=np_, kp=kp, n_scale_cols=n_scale_cols, blocks=blocks,
                 out_bf16=jnp.dtype(out_dtype) == _BF16)
    n_tiles = -(-m // 8)

    def kernel(codes_g, scales_g, xf_g, out_g, partial_s, table_s):
        body(codes_g, scales_g, xf_g, out_g, partial_s, table_s)

    out = plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct((m, np_), out_dtype),
        scratch_types=[plgpu.SMEM((WARPS, 32, 4 * n_tiles), _F32),
                       plgpu.SMEM(((TABLE_ENTRIES * 32 + TABLE_ENTRIES) if blocks.table else 4,), jnp.uint32)],
        grid=(np_ // rows_per_program,), grid_names=("rows",),
        compiler_params=plgpu.CompilerParams(unsafe_no_auto_barriers=True),
    )(codes, scales, xf)
    return out[:, :n]


__all__ = ["WarpBlocks", "fragment_x", "k_permutation", "mx_matmul_warps"]
