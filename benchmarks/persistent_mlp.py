"""Issue 4's persistent step, one real sublayer: `mini`'s dense MLP at batch 1 (x + down(SiTU(gate x, up x)),
D = 2048, F = 5632, 69 MB of bf16 weights) as one persistent Mosaic GPU kernel, against the step's kernels for it.

The thirty-sixth session timed a chain of identical matvecs with each link's input as flagged words (about 0.5 us
a dependent link above its bytes) and estimated a persistent step from it. A real sublayer is not such a chain: its
phases have more row tiles than the GPU has SMs, an activation between the matvecs, a contraction (the down
projection's F = 5632) longer than one program should read alone, and a residual. This kernel is the MLP in the
form the estimate assumes, so that the estimate meets one sublayer's real shape:

- Items of 16 hidden units: item i's 16 gate rows and 16 up rows ([32, D], ``w13``) and its 16 columns of the down
  weight, stored as rows (``w2`` [items + 1, 16, D], so that a copy reads 512-byte rows). Program p (of P, one per
  SM, all resident) takes items p, p + P, p + 2P (352 items on 132 SMs: 2 or 3 each; a missing third is a zero item
  past the last, read from L2 by the 44 programs that take it).
  ``--units 32``: items of 32 units, whose 64 gate and up rows fill a wgmma (176 items: 1 or 2 a program).
- Phase 1, per item: its gate and up rows times x (the weights by TMA through a ring of 32-row slots, one wgmma of
  64 rows per 256-wide step: the slot's rows and the next slot's, whose products are not used), then
  h = SiTU(bf16 gate, bf16 up) rounded to bf16, as the step rounds them.
- Phase 2, per 256 output rows: the program's items' down columns times their h (one wgmma each, K = 16),
  summed over its items in order: the program's partial down product [D]. Its down weights depend on no other
  program, so their first copies are issued at the kernel's start and stream through phase 1. No program waits
  for another before this point.
- The one dependent hop: each partial value leaves as one 64-bit store of (float32 value, flag), the flag the
  call's epoch (unique per call: each call returns the next one's, so the flag buffer, a ``pl.get_global`` that
  lives across calls, needs no clearing). Program r < D / 16 owns 16 output rows: its 128 threads load their rows'
  words of all P partials at once and again until every flag reads the epoch, sum them in a fixed order
  (programs, then the 8 thread groups), round to bf16, add the residual (x's row) and round again, as the step's
  epilogue does. Rows 1-7 of the [8, D] output are zeros, so the output is the next layer's input as it stands.

The whole layer reads its 69 MB once, plus the partials (2.2 MB, in L2). Forms timed (us per dependent layer, a
chain of R L layers less one of L, over (R - 1) L; ``--links`` weight sets, more than L2 holds):

- ``persistent, S + D slots``: the kernel above with S gate/up slots and D down slots (each of ``--stages`` with
  each of ``--down-stages``; by default 2 and 4, with 4);
- ``step kernels``: the batch-1 step's path for this layer (``k3jax.layers.basic.project`` on the Pallas path:
  gate and up in one matvec kernel, SiTU and the down product with the residual as the step runs them),
  compiled with the decode step's options;
- probes (``phases``): the kernel without the reduction, with phase 1 alone, and the gate/up weights' ring alone
  (its barrier waits and refills, no wgmma): where its time goes;
- ``--sweep units.stages.programs,...``: phase 1 and the ring alone at other item sizes, slot counts and program
  counts (``--sweep-only``: those and the step kernels alone).

On an H100 (RESULTS, issue 4, thirty-seventh and thirty-eighth sessions) the kernel is correct, its one flagged hop
costs about 1 us, and it is slower than the step's kernels (36.8 against 30.3 us): the ring alone reads phase 1's
46.1 MB at 2.4-2.56 TB/s, the wgmma add 4-5 us to it, and more slots than 4 in flight make it slower. Waiting only
for the wgmma before the last (refilling a slot a step later) was slower at every slot count and was removed.

``--layers L,...``: L layers a kernel (each layer's output broadcast to every program as flagged words, the copy
rings running on into the next layer), unrolled; ``--poll-sleep NS,...``: a nanosleep between poll rounds. On an
H100 (fortieth session) 4 layers a kernel took 54-55 us a layer against 36 at one a kernel, with or without the
sleep. The layers as a loop of one layer's code were slower still (68 us; 50 against 46 with 32-unit items,
forty-first session), so code size is not the cause; the loop was removed.

Each form is checked against float32 layers with the same bf16 roundings before timing (one layer within 2e-3;
the chain of L within 1e-1, as the random bf16 chain amplifies rounding from layer to layer), and the floor is
the layer's bytes at the copy rate measured in the same run (``inference.ceilings``). GPU only (the flags have no
interpret mode); on a CPU it lowers the kernel for CUDA and stops.

    python3 benchmarks/persistent_mlp.py [--links 8] [--repeat 4] [--programs 132] [--stages 2,4] [--down-stages 4]
                                         [--units 16] [--layers 1,4] [--poll-sleep 0,200]
                                         [--sweep 16.4.88,32.2.88] [--sweep-only] [--no-probes]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from benchmarks.inference import ceilings
from k3jax import use_implementation
from k3jax.inference import DECODE_GPU_OPTIONS, on_gpu
from k3jax.layers.basic import Activated, project
from k3jax.layers.mlp import activation
from pallas_kernels._mosaic_gpu import accumulator_elements, splat_i32, swizzled

DIM, WIDTH = 2048, 5632  # `mini`'s dense MLP
UNITS = 16  # hidden units an item, by default (16 or 32: the down product's K, a multiple of wgmma's 16)
ROWS = 64  # rows of a gate/up wgmma: the item's 2 x units and, below 32 units, the next slot's
BK = 256  # phase 1's contraction step
DOWN_ROWS = 256  # phase 2's output rows a wgmma
OWNED_ROWS = 16  # output rows a reducing program owns
X_ROWS = 8  # x as wgmma's N = 8 (row 0 is x)
SPIN_LIMIT = 1 << 20  # polls of the partials before a reducing thread gives up and sums a NaN (a bug, not a hang)
LAYER_BYTES = 3 * DIM * WIDTH * 2
GATE_UP_BYTES = 2 * DIM * WIDTH * 2  # what phase 1 reads
_F32, _BF16 = jnp.float32, jnp.bfloat16


def _ir():
    import jax.experimental.mosaic.gpu as mgpu
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, gpu, llvm, math, memref, scf

    return mgpu, ir, arith, gpu, llvm, math, memref, scf


def _situ(a, b):
    """SiTU(a, b) = 4 tanh(a / 4) sigmoid(a) 25 tanh(b / 25) on float32 MLIR values (``k3jax.functional.moe.situ``)."""
    _, ir, arith, _, _, math, *_ = _ir()
    f32 = ir.F32Type.get()
    c = lambda v: arith.constant(f32, v)
    sigmoid = arith.divf(c(1.0), arith.addf(c(1.0), math.exp(arith.negf(a))))
    gate = arith.mulf(arith.mulf(c(4.0), math.tanh(arith.mulf(a, c(0.25)))), sigmoid)
    return arith.mulf(gate, arith.mulf(c(25.0), math.tanh(arith.mulf(b, c(1 / 25)))))


def _activate(units: int):
    """(acc [64, 8] float32 in the WGMMA layout: rows 0 to u - 1 the item's gate sums, u to 2 u - 1 its up sums, in
    column 0; scratch [64, 8] float32; h tile [8, u] bf16) -> h = bf16(SiTU(bf16 gate, bf16 up)) in row 0 of the
    h tile (u = ``units``)."""
    mgpu, ir, arith, gpu, llvm, _, memref, scf = _ir()

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType(), plgpu.RefType(swizzled(units))))
    def activate(ctx, acc, scratch, h_ref):
        del ctx
        i32, index = ir.IntegerType.get_signless(32), ir.IndexType.get()
        f32, bf16 = ir.F32Type.get(), ir.BF16Type.get()
        for value, row, col in accumulator_elements(acc):
            memref.store(value, scratch, [row, col])
        mgpu.utils.warpgroup_barrier()
        tid = gpu.thread_id(gpu.Dimension.x)
        unit = arith.cmpi(arith.CmpIPredicate.ult, tid, arith.constant(index, units))
        branch = scf.IfOp(unit)
        with ir.InsertionPoint(branch.then_block):
            zero = arith.constant(index, 0)
            rounded = lambda v: arith.extf(f32, arith.truncf(bf16, v))
            gate = rounded(memref.load(scratch, [tid, zero]))
            up = rounded(memref.load(scratch, [arith.addi(tid, arith.constant(index, units)), zero]))
            h = arith.truncf(bf16, _situ(gate, up))
            byte = arith.muli(arith.index_cast(i32, tid), arith.constant(i32, 2))  # row 0: not swizzled
            llvm.store(h, mgpu.utils.getelementptr(mgpu.utils.memref_ptr(h_ref), [byte], ir.IntegerType.get_signless(8)))
            scf.yield_([])
        mgpu.utils.warpgroup_barrier()

    return activate


def _publish(layer: int):
    """(acc [256, 8] float32 in the WGMMA layout, flagged [P * D * 2] i32, epoch [1] i32, first word) -> column
    0's 256 values as (value, epoch + ``layer``) 64-bit words at flagged[2 (first + row)], one store each."""
    mgpu, ir, arith, _, llvm, *_ = _ir()

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType(), plgpu.RefType(), plgpu.Layout.WG_SPLAT))
    def publish(ctx, acc, flagged, epoch_ref, first):
        del ctx
        i32 = ir.IntegerType.get_signless(32)
        c = lambda v: arith.constant(i32, v)
        flag = arith.addi(llvm.load(i32, mgpu.utils.memref_ptr(epoch_ref)), c(layer))
        first = splat_i32(first)
        base = mgpu.utils.memref_ptr(flagged)
        for reg, (row, col) in zip(acc.registers.flat, acc.layout.thread_idxs(acc.shape)):
            bits = llvm.bitcast(i32, llvm.extractelement(reg, c(0)))
            word = arith.addi(first, arith.index_cast(i32, row))
            active = arith.cmpi(arith.CmpIPredicate.eq, arith.index_cast(i32, col), c(0))
            _store_word(mgpu.utils.getelementptr(base, [arith.muli(word, c(2))], i32), bits, flag, active)

    return publish


def _store_word(dst, bits, flag, active=None):
    """One 64-bit store of (bits, flag) at ``dst`` (relaxed, GPU scope: the word carries its own flag), where the i1
    ``active`` holds (every thread without it)."""
    _, ir, arith, _, llvm, *_ = _ir()
    if active is None:
        active = arith.constant(ir.IntegerType.get_signless(1), 1)
    llvm.inline_asm(ir.Type.parse("!llvm.void"), [dst, bits, flag, active],
                    "{ .reg .b64 v; mov.b64 v, {$1, $2}; @$3 st.relaxed.gpu.global.b64 [$0], v; }",
                    "l,r,r,b", has_side_effects=True)


def _poll(sources, flag, sleep_ns: int) -> list:
    """The value halves (i32) of the 64-bit words at ``sources`` (pointers), all loaded at once and again, after a
    ``sleep_ns`` nanosleep (0: none), until every flag half reads ``flag`` (at most ``SPIN_LIMIT`` rounds: then the
    first value is a NaN's bits, so a lost word fails the check instead of hanging the GPU)."""
    _, ir, _, _, llvm, *_ = _ir()
    n = len(sources)
    loads = "\n".join(f"ld.relaxed.gpu.global.b64 v{m}, [${n + m}];" for m in range(n))
    unpack = "\n".join(f"mov.b64 {{${m}, f{m}}}, v{m};" for m in range(n))
    checks = "\n".join(["setp.ne.u32 p, f0, $%d;" % (2 * n)]
                       + [f"setp.ne.or.u32 p, f{m}, ${2 * n}, p;" for m in range(1, n)])
    polled = llvm.inline_asm(
        ir.Type.parse("!llvm.struct<(" + ", ".join(["i32"] * n) + ")>"), list(sources) + [flag],
        f"""{{
        .reg .pred p;
        .reg .b64 v<{n}>;
        .reg .b32 f<{n}>;
        .reg .pred q, again;
        .reg .b32 tries;
        mov.u32 tries, 0;
        WORDS_READY:
        {loads}
        {unpack}
        {checks}
        add.u32 tries, tries, 1;
        setp.lt.u32 q, tries, {SPIN_LIMIT};
        and.pred again, p, q;
        {f"@again nanosleep.u32 {sleep_ns};" if sleep_ns else ""}
        @again bra WORDS_READY;
        @p mov.b32 $0, 0x7fc00000;
        }}""",
        ",".join(["=r"] * n + ["l"] * n + ["r"]), has_side_effects=True)
    return [llvm.extractvalue(ir.IntegerType.get_signless(32), polled, [m]) for m in range(n)]


def _x_element(column, arith, i32):
    """Row 0, ``column`` of x's shared tile [D / BK, 8, BK] (``swizzled(BK)``: 8 x 64 tiles, row 0 unswizzled), as
    an element offset."""
    tile = 8 * 64
    return arith.addi(arith.muli(arith.divui(column, arith.constant(i32, 64)), arith.constant(i32, tile)),
                      arith.remui(column, arith.constant(i32, 64)))


def _reduce(programs: int, dim: int, layer: int, last: bool, sleep_ns: int):
    """(flagged, epoch, x tile (shared, the layer's input), out, next epoch [1] i32, scratch [128] float32, r) ->
    for the 16 rows r * 16 + j: the layer's output bf16(bf16(sum of the P partials) + x) into ``out``: the last
    layer's as out [8, D] bf16 (rows 1-7 zero; program 0 writes epoch + layers), an earlier layer's as (value,
    epoch + ``layer``) words into out [D * 2] i32 for every program's next input. Thread t reads row t % 16 of the
    partials t // 16 + 8 m (flags epoch + ``layer``) and sums them in m's order; threads 0-15 then sum the 8 thread
    groups in order."""
    mgpu, ir, arith, gpu, llvm, _, memref, scf = _ir()
    groups = 128 // OWNED_ROWS
    per_thread = -(-programs // groups)

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),) * 2 + (plgpu.RefType(swizzled(BK)),) + (plgpu.RefType(),) * 3
                       + (plgpu.Layout.WG_SPLAT,))
    def reduce(ctx, flagged, epoch_ref, x_s, out_ref, next_ref, scratch, owner):
        del ctx
        i32, f32, bf16, index = (ir.IntegerType.get_signless(32), ir.F32Type.get(), ir.BF16Type.get(),
                                 ir.IndexType.get())
        c = lambda v: arith.constant(i32, v)
        epoch = llvm.load(i32, mgpu.utils.memref_ptr(epoch_ref))
        flag = arith.addi(epoch, c(layer))
        tid_index = gpu.thread_id(gpu.Dimension.x)
        tid = arith.index_cast(i32, tid_index)
        lane_row, group = arith.remui(tid, c(OWNED_ROWS)), arith.divui(tid, c(OWNED_ROWS))
        owner = splat_i32(owner)
        row = arith.addi(arith.muli(owner, c(OWNED_ROWS)), lane_row)
        base = mgpu.utils.memref_ptr(flagged)
        sources, valid = [], []
        for m in range(per_thread):
            program = arith.addi(group, c(groups * m))
            valid.append(arith.cmpi(arith.CmpIPredicate.ult, program, c(programs)))
            program = arith.minui(program, c(programs - 1))
            word = arith.addi(arith.muli(program, c(dim)), row)
            sources.append(mgpu.utils.getelementptr(base, [arith.muli(word, c(2))], i32))
        total = arith.constant(f32, 0.0)
        for ok, bits in zip(valid, _poll(sources, flag, sleep_ns)):
            total = arith.addf(total, arith.select(ok, llvm.bitcast(f32, bits), arith.constant(f32, 0.0)))
        memref.store(total, scratch, [tid_index])
        mgpu.utils.warpgroup_barrier()
        out_base, x_base = mgpu.utils.memref_ptr(out_ref), mgpu.utils.memref_ptr(x_s)
        owned = scf.IfOp(arith.cmpi(arith.CmpIPredicate.ult, tid, c(OWNED_ROWS)))
        with ir.InsertionPoint(owned.then_block):
            total = memref.load(scratch, [tid_index])
            for g in range(1, groups):
                total = arith.addf(total, memref.load(scratch, [arith.addi(tid_index, arith.constant(index, OWNED_ROWS * g))]))
            residual = arith.extf(f32, llvm.load(bf16, mgpu.utils.getelementptr(x_base, [_x_element(row, arith, i32)], bf16)))
            down = arith.extf(f32, arith.truncf(bf16, total))
            value = arith.truncf(bf16, arith.addf(down, residual))
            if last:
                llvm.store(value, mgpu.utils.getelementptr(out_base, [row], bf16))
            else:
                bits = llvm.bitcast(i32, arith.extf(f32, value))
                _store_word(mgpu.utils.getelementptr(out_base, [arith.muli(row, c(2))], i32), bits, flag)
            scf.yield_([])
        if not last:
            return
        zero_rows = scf.IfOp(arith.cmpi(arith.CmpIPredicate.ult, tid, c(OWNED_ROWS * (X_ROWS - 1))))
        with ir.InsertionPoint(zero_rows.then_block):
            element = arith.addi(arith.muli(arith.addi(group, c(1)), c(dim)), row)
            llvm.store(arith.constant(bf16, 0.0), mgpu.utils.getelementptr(out_base, [element], bf16))
            scf.yield_([])
        first = arith.andi(arith.cmpi(arith.CmpIPredicate.eq, owner, c(0)), arith.cmpi(arith.CmpIPredicate.eq, tid, c(0)))
        bump = scf.IfOp(first)
        with ir.InsertionPoint(bump.then_block):
            llvm.store(arith.addi(epoch, c(layer + 1)), mgpu.utils.memref_ptr(next_ref))
            scf.yield_([])

    return reduce


def _broadcast(dim: int, layer: int, sleep_ns: int):
    """(words [D * 2] i32, epoch [1] i32, x tile (shared)) -> row 0 of the x tile = the D values of the words, once
    every flag reads epoch + ``layer`` (thread t polls words t + 128 m); then a warpgroup barrier."""
    mgpu, ir, arith, gpu, llvm, *_ = _ir()

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType(), plgpu.RefType(swizzled(BK))))
    def broadcast(ctx, words, epoch_ref, x_s):
        del ctx
        i32, f32, bf16 = ir.IntegerType.get_signless(32), ir.F32Type.get(), ir.BF16Type.get()
        c = lambda v: arith.constant(i32, v)
        flag = arith.addi(llvm.load(i32, mgpu.utils.memref_ptr(epoch_ref)), c(layer))
        tid = arith.index_cast(i32, gpu.thread_id(gpu.Dimension.x))
        base, x_base = mgpu.utils.memref_ptr(words), mgpu.utils.memref_ptr(x_s)
        columns = [arith.addi(tid, c(128 * m)) for m in range(dim // 128)]
        sources = [mgpu.utils.getelementptr(base, [arith.muli(col, c(2))], i32) for col in columns]
        for col, bits in zip(columns, _poll(sources, flag, sleep_ns)):
            value = arith.truncf(bf16, llvm.bitcast(f32, bits))
            llvm.store(value, mgpu.utils.getelementptr(x_base, [_x_element(col, arith, i32)], bf16))
        mgpu.utils.warpgroup_barrier()

    return broadcast


def _mlp_kernel(x_g, w13_g, w2_g, epoch_g, out_g, next_g, w13_s, w2_s, x_s, h_s, act_s, red_s, w13_bars, w2_bars, x_bar, *,
                items: int, programs: int, stages: int, down_stages: int, phases: int, poll_sleep: int):
    layers, dim, units = w13_g.shape[0], x_g.shape[1], w2_g.shape[2]
    p = jax.lax.axis_index("programs")
    per_program = h_s.shape[0]  # a program's items, one h slot each (``persistent_mlp``'s scratch)
    steps, blocks = dim // BK, dim // DOWN_ROWS
    up_total, down_total = layers * per_program * steps, layers * blocks * per_program
    flagged = pl.get_global(plgpu.SemaphoreType.REGULAR((programs * dim * 2,)))
    words = pl.get_global(plgpu.SemaphoreType.REGULAR((dim * 2,)))  # a layer's output, every program's next input

    def item(j):  # past the last item: the zero item
        return jnp.minimum(p + j * programs, items)

    def fetch_up(t):  # the ring runs on across layers: a layer's last slots fetch the next one's first tiles
        layer, rest = divmod(t, per_program * steps)
        j, step = divmod(rest, steps)
        slot = t % stages
        plgpu.copy_gmem_to_smem(w13_g.at[layer, item(j), :, pl.ds(step * BK, BK)],
                                w13_s.at[pl.ds(slot * 2 * units, 2 * units)], w13_bars.at[slot])

    def fetch_down(s):
        layer, rest = divmod(s, blocks * per_program)
        block, j = divmod(rest, per_program)
        slot = s % down_stages
        plgpu.copy_gmem_to_smem(w2_g.at[layer, item(j), :, pl.ds(block * DOWN_ROWS, DOWN_ROWS)], w2_s.at[slot],
                                w2_bars.at[slot])

    for step in range(steps):
        plgpu.copy_gmem_to_smem(x_g.at[:, pl.ds(step * BK, BK)], x_s.at[step], x_bar.at[0])
    for t in range(min(stages, up_total)):
        fetch_up(t)
    for s in range(min(down_stages, down_total) if phases > 1 else 0):
        fetch_down(s)
    plgpu.barrier_wait(x_bar.at[0])

    def refill(t):  # slot t's weights are read: its next tile
        if t + stages < up_total:
            fetch_up(t + stages)

    activate = _activate(units)
    for layer in range(layers):
        for j in range(per_program):
            first_t = (layer * per_program + j) * steps
            if phases == 0:  # the ring alone
                for t in range(first_t, first_t + steps):
                    plgpu.barrier_wait(w13_bars.at[t % stages])
                    refill(t)
                continue

            def gate_up(acc_ref, first_t=first_t):
                for step in range(steps):
                    t = first_t + step
                    plgpu.barrier_wait(w13_bars.at[t % stages])
                    # 64 rows from the slot: its 2 u and the next slot's (or the spare's), whose sums are not used
                    plgpu.wgmma(acc_ref, w13_s.at[pl.ds(t % stages * 2 * units, ROWS)], x_s.at[step].transpose((1, 0)))
                    plgpu.wgmma_wait(0)
                    refill(t)
                return acc_ref[...]

            acc = pl.run_scoped(gate_up, plgpu.ACC((ROWS, X_ROWS), _F32))
            activate(acc, act_s, h_s.at[j])
        plgpu.commit_smem()
        if phases < 2:
            return

        publish = _publish(layer)
        for block in range(blocks):
            def down(acc_ref, block=block):
                for j in range(per_program):
                    s = (layer * blocks + block) * per_program + j
                    slot = s % down_stages
                    plgpu.barrier_wait(w2_bars.at[slot])
                    plgpu.wgmma(acc_ref, w2_s.at[slot].transpose((1, 0)), h_s.at[j].transpose((1, 0)))
                    plgpu.wgmma_wait(0)
                    if s + down_stages < down_total:
                        fetch_down(s + down_stages)
                return acc_ref[...]

            acc = pl.run_scoped(down, plgpu.ACC((DOWN_ROWS, X_ROWS), _F32))
            publish(acc, flagged, epoch_g, p * dim + block * DOWN_ROWS)
        if phases < 3:
            return

        last = layer == layers - 1

        @pl.when(p < dim // OWNED_ROWS)
        def _():
            _reduce(programs, dim, layer, last, poll_sleep)(flagged, epoch_g, x_s, out_g if last else words, next_g, red_s, p)

        if not last:
            _broadcast(dim, layer, poll_sleep)(words, epoch_g, x_s)
            plgpu.commit_smem()


@functools.partial(jax.jit, static_argnames=("programs", "stages", "down_stages", "phases", "poll_sleep"))
def persistent_mlp(x8, w13, w2, epoch, *, programs: int, stages: int = 2, down_stages: int = 4, phases: int = 3,
                   poll_sleep: int = 0):
    """x8 bf16 [8, D] (row 0 = x, the rest zero), w13 bf16 [L, items + 1, 2 u, D] and w2 bf16 [L, items + 1, u, D]
    (L layers' ``pack_weights``, u = 16 or 32 units an item), epoch int32 [1] (the calls of this process take
    epochs from 1 up, each the one the call before returned) -> (out [8, D]: row 0 = the L layers
    x + down(SiTU(gate x, up x)) one after another in the step's roundings, rows 1-7 zero; epoch + L, the next
    call's). Layer l's partials and outputs are flagged epoch + l; the weights' copy rings run on from one layer
    into the next. ``phases`` below 3 is a timing probe of one layer: 2 skips the reduction, 1 the down product
    too, 0 the products too (the gate/up weights' ring alone; the outputs are not written). A program polling
    flagged words it waits for sleeps ``poll_sleep`` ns between rounds (0: spins)."""
    dim, units = x8.shape[1], w2.shape[-2]
    layers, items = w13.shape[0], w13.shape[1] - 1
    if (x8.shape != (X_ROWS, dim) or units not in (16, 32) or w13.shape[2:] != (2 * units, dim)
            or w2.shape != (layers, items + 1, units, dim) or dim % DOWN_ROWS or dim % BK
            or (phases == 3 and dim // OWNED_ROWS > programs) or (phases < 3 and layers > 1)):
        raise ValueError(f"x8 {x8.shape}, w13 {w13.shape}, w2 {w2.shape}, phases {phases}: expected x8 [{X_ROWS}, D], "
                         f"w13 [L, items + 1, 2 u, D], w2 [L, items + 1, u, D] with u 16 or 32, D a multiple of "
                         f"{DOWN_ROWS}, D / {OWNED_ROWS} <= programs = {programs}, one layer for a probe")
    sms = getattr(jax.devices()[0], "core_count", programs)
    if programs > sms:  # the reducing programs wait for every program: all must be resident at once
        raise ValueError(f"programs = {programs} is more than the {sms} SMs (the reduction would wait forever)")
    scratch = [
        plgpu.SMEM(((stages - 1) * 2 * units + ROWS, BK), _BF16, transforms=swizzled(BK)),  # the last slot's 64 rows
        plgpu.SMEM((down_stages, units, DOWN_ROWS), _BF16, transforms=swizzled(units)),  # h's swizzle, as wgmma asks
        plgpu.SMEM((dim // BK, X_ROWS, BK), _BF16, transforms=swizzled(BK)),
        plgpu.SMEM((-(-items // programs), X_ROWS, units), _BF16, transforms=swizzled(units)),
        plgpu.SMEM((ROWS, X_ROWS), _F32),
        plgpu.SMEM((128,), _F32),
        plgpu.Barrier(num_arrivals=1, num_barriers=stages),
        plgpu.Barrier(num_arrivals=1, num_barriers=down_stages),
        plgpu.Barrier(num_arrivals=dim // BK, num_barriers=1),
    ]
    kernel = functools.partial(_mlp_kernel, items=items, programs=programs, stages=stages, down_stages=down_stages,
                               phases=phases, poll_sleep=poll_sleep)
    out_type = (jax.ShapeDtypeStruct((X_ROWS, dim), _BF16), jax.ShapeDtypeStruct((1,), jnp.int32))
    return plgpu.kernel(kernel, out_type=out_type, scratch_types=scratch, grid=(programs,),
                        grid_names=("programs",))(x8, w13, w2, epoch)


def pack_weights(gate, up, down, units: int = UNITS):
    """gate, up [F, D], down [D, F] -> w13 [F / u + 1, 2 u, D] (item i: gate rows u i.., then up rows u i..) and
    w2 [F / u + 1, u, D] (item i's down columns as rows, so that its copies read 512-byte rows); the last item
    zeros (u = ``units``)."""
    width, dim = gate.shape
    w13 = jnp.concatenate([gate.reshape(-1, units, dim), up.reshape(-1, units, dim)], axis=1)
    zeros = jnp.zeros((1, units, dim), gate.dtype)
    return (jnp.concatenate([w13, jnp.concatenate([zeros, zeros], axis=1)]),
            jnp.concatenate([down.T.reshape(-1, units, dim), zeros]))


def reference(x, layers) -> np.ndarray:
    """The chain in float32 with the step's roundings: gate and up to bf16, SiTU to bf16, the down product to
    bf16, plus the residual to bf16."""
    from k3jax.functional.moe import situ

    bf = lambda a: np.asarray(jnp.asarray(a).astype(_BF16).astype(_F32))
    x = bf(x)
    for gate, up, down in layers:
        g, u = bf(np.asarray(gate.astype(_F32)) @ x), bf(np.asarray(up.astype(_F32)) @ x)
        h = bf(situ(jnp.asarray(g), jnp.asarray(u)))
        x = bf(bf(np.asarray(down.astype(_F32)) @ h) + x)
    return x


def persistent_chain(packed, programs: int, stages: int, down_stages: int, phases: int = 3, layers: int = 1,
                     poll_sleep: int = 0):
    """length -> the jitted chain (x8, epoch) -> (x8 after ``length`` persistent layers, the next epoch), ``layers``
    layers a kernel (``length`` a multiple of it; ``packed``'s weight sets in order, stacked ``layers`` at a time).
    A probe (``phases`` < 3) writes no epoch: it passes its own on, so it must come after every checked chain."""
    if len(packed) % layers:
        raise ValueError(f"{len(packed)} weight sets do not stack {layers} at a time")
    stacked = [tuple(jnp.stack(arrays) for arrays in zip(*packed[i:i + layers])) for i in range(0, len(packed), layers)]

    def make(length):
        if length % layers:
            raise ValueError(f"a chain of {length} layers in kernels of {layers}")

        def chain(x8, epoch):
            for i in range(length // layers):
                out, next_epoch = persistent_mlp(x8, *stacked[i % len(stacked)], epoch, programs=programs,
                                                 stages=stages, down_stages=down_stages, phases=phases,
                                                 poll_sleep=poll_sleep)
                x8, epoch = out, (next_epoch if phases == 3 else epoch)  # a probe's out: unwritten, but used
            return x8, epoch

        return jax.jit(chain, compiler_options=on_gpu(DECODE_GPU_OPTIONS))

    return functools.lru_cache(make)


def step_chain(layers):
    """length -> the jitted chain (x8, epoch) -> (x8, epoch) of the batch-1 step's MLP path (row 0 of x8; the
    epoch passed through)."""
    act = activation("situ")

    def make(length):
        def chain(x8, epoch):
            with use_implementation("pallas"):
                x = x8[:1]
                for i in range(length):
                    gate, up, down = layers[i % len(layers)]
                    g, u = project(x, [gate, up])
                    x = project(Activated(act, g, u), [down], add=(x,))[0]
            return jnp.zeros_like(x8).at[0].set(x[0]), epoch

        return jax.jit(chain, compiler_options=on_gpu(DECODE_GPU_OPTIONS))

    return functools.lru_cache(make)


def best_seconds(fn, x8, epoch, rounds: int = 5, calls: int = 10):
    """The best round's seconds a call of ``fn(x8, epoch) -> (out, next epoch)``, calls dispatched back to back,
    each with the epoch the one before returned; returns it and the epoch after the last call."""
    out, epoch = fn(x8, epoch)
    jax.block_until_ready(out)
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            out, epoch = fn(x8, epoch)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - start) / calls)
    return best, epoch


def sweep_forms(spec: str, packed_for, down_stages: int) -> dict:
    """``spec``: comma-separated ``units.stages.programs`` (``16.4.88``) -> for each, the phase 1 probe and the
    ring-alone probe (phases 0), named by the spec, with the bytes they read."""
    forms = {}
    for item in filter(None, spec.split(",")):
        fields = item.split(".")
        if not (len(fields) == 3 and all(f.isdigit() for f in fields)):
            raise SystemExit(f"--sweep item {item!r}: expected units.stages.programs, as 16.4.88")
        units, stages, programs = map(int, fields)
        for phases, what in ((1, "gate, up, SiTU"), (0, "ring alone")):
            forms[f"probe {item}: {what}"] = (persistent_chain(packed_for(units), programs, stages, down_stages,
                                                               phases), GATE_UP_BYTES)
    return forms


def _integers(least: int):
    """An argparse type: comma-separated integers of at least ``least``, as 2,4."""
    def parse(text: str) -> tuple[int, ...]:
        try:
            values = tuple(int(c) for c in text.split(","))
        except ValueError:
            values = ()
        if not values or min(values) < least:
            raise argparse.ArgumentTypeError(f"{text!r}: expected integers of at least {least}, comma-separated, as 2,4")
        return values

    return parse


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--links", type=int, default=8, help="layers of the shorter chain (and weight sets)")
    ap.add_argument("--repeat", type=int, default=4, help="the longer chain is the shorter one this many times")
    ap.add_argument("--programs", type=int, default=0, help="programs (default: the SM count)")
    ap.add_argument("--stages", type=_integers(1), default=(2, 4), help="gate/up weight slots in flight a program, "
                    "comma-separated (each timed)")
    ap.add_argument("--down-stages", type=_integers(1), default=(4,), help="down weight slots in flight a program, "
                    "comma-separated (each timed with each --stages)")
    ap.add_argument("--layers", type=_integers(1), default=(1,), help="layers a kernel, comma-separated (each timed with each "
                    "slot pair; each divides --links)")
    ap.add_argument("--units", type=int, default=UNITS, choices=(16, 32), help="hidden units an item")
    ap.add_argument("--sweep", default="", help="phase probes to time after the forms: units.stages.programs,"
                    " comma-separated (each as phase 1 alone and as the ring alone)")
    ap.add_argument("--poll-sleep", type=_integers(0), default=(0,), help="ns a polling program sleeps between rounds, "
                    "comma-separated (each timed with each form; 0: spins)", metavar="NS")
    ap.add_argument("--sweep-only", action="store_true", help="time the step kernels (the peer) and the sweep alone")
    ap.add_argument("--no-probes", action="store_true", help="no default probes (the sweep's still run)")
    args = ap.parse_args()
    on_gpu = jax.default_backend() == "gpu"
    programs = args.programs or getattr(jax.devices()[0], "core_count", 132)
    if not on_gpu:
        items = WIDTH // args.units
        layers = args.layers[-1]
        shapes = [((X_ROWS, DIM), _BF16), ((layers, items + 1, 2 * args.units, DIM), _BF16),
                  ((layers, items + 1, args.units, DIM), _BF16), ((1,), jnp.int32)]
        fn = functools.partial(persistent_mlp, programs=programs, stages=args.stages[0],
                               down_stages=args.down_stages[0])
        text = jax.jit(fn).trace(*(jax.ShapeDtypeStruct(s, d) for s, d in shapes)).lower(
            lowering_platforms=("cuda",)).as_text()
        print(f"no GPU: the kernel of {layers} layers lowers for CUDA ({len(text)} characters of StableHLO); "
              "nothing timed")
        return
    short, long = args.links, args.repeat * args.links
    keys = jax.random.split(jax.random.key(0), 3 * short + 1)
    normal = lambda key, shape, fan_in: (jax.random.normal(key, shape, _F32) * fan_in**-0.5).astype(_BF16)
    layers = [(normal(keys[3 * i], (WIDTH, DIM), DIM), normal(keys[3 * i + 1], (WIDTH, DIM), DIM),
               normal(keys[3 * i + 2], (DIM, WIDTH), WIDTH)) for i in range(short)]
    packed_for = functools.cache(lambda units: [pack_weights(*layer, units=units) for layer in layers])
    packed = packed_for(args.units)
    x_row = jax.random.normal(keys[-1], (DIM,), _F32).astype(_BF16)
    x8 = jnp.zeros((X_ROWS, DIM), _BF16).at[0].set(x_row)
    expected = {1: reference(x_row, layers[:1]), short: reference(x_row, layers)}
    stages, down_stages = args.stages[0], args.down_stages[0]
    forms = {"step kernels": (step_chain(layers), LAYER_BYTES)}
    if not args.sweep_only:
        for s, d, n, sleep in itertools.product(args.stages, args.down_stages, args.layers, args.poll_sleep):
            name = (f"persistent, {s} + {d} slots" + (f", {n} layers a kernel" if n > 1 else "")
                    + (f", polls {sleep} ns apart" if sleep else ""))
            forms[name] = (persistent_chain(packed, programs, s, d, layers=n, poll_sleep=sleep), LAYER_BYTES)
    if not (args.sweep_only or args.no_probes):
        forms["probe: no reduction"] = (persistent_chain(packed, programs, stages, down_stages, 2), LAYER_BYTES)
        forms.update(sweep_forms(f"{args.units}.{stages}.{programs}", packed_for, down_stages))
    forms.update(sweep_forms(args.sweep, packed_for, down_stages))  # probes last: they write no epoch
    copy_rate = ceilings()[0]  # first: a run cut short still has it
    print(f"copy {copy_rate / 1e12:.2f} TB/s", flush=True)
    epoch = jnp.ones((1,), jnp.int32)
    rows = []
    for name, (make, size) in forms.items():
        checks = () if name.startswith("probe") else ((1, 2e-3), (short, 1e-1)) if "a kernel" not in name else (
            (short, 1e-1),)  # the random bf16 chain amplifies rounding layer by layer
        for length, bound in checks:
            out, epoch = make(length)(x8, epoch)
            out = np.asarray(out.astype(_F32))
            err = float(np.linalg.norm(out[0] - expected[length]) / np.linalg.norm(expected[length]))
            print(f"{name}: rel err {err:.1e} against the float32 chain of {length} layers; rows 1-7 zero: "
                  f"{not out[1:].any()}", flush=True)
            if not (err < bound and not out[1:].any()):
                raise SystemExit(f"{name}: {length} layers {err:.1e} from the float32 chain (bound {bound:.0e}) "
                                 f"or rows 1-7 not zero")
        seconds = []
        for length in (short, long):
            best, epoch = best_seconds(make(length), x8, epoch)
            seconds.append(best)
        per_layer = (seconds[1] - seconds[0]) / (long - short)
        rows.append((name, per_layer * 1e6, size))
        print(f"{name}: {seconds[0] * 1e6:.0f} / {seconds[1] * 1e6:.0f} us per call of {short} / {long} layers, "
              f"{per_layer * 1e6:.2f} us per layer", flush=True)
    floor_us = LAYER_BYTES / copy_rate * 1e6
    print(f"\ndevice {jax.devices()[0].device_kind}, JAX {jax.__version__}; chains of {short} and {long} layers; "
          f"copy {copy_rate / 1e12:.2f} TB/s, the layer's {LAYER_BYTES / 1e6:.1f} MB at it {floor_us:.2f} us")
    print("form | us per layer | MB read | TB/s | x its bytes at the copy rate")
    for name, us, size in rows:
        print(f"{name} | {us:.2f} | {size / 1e6:.1f} | {size / us / 1e6:.2f} | {us / (size / copy_rate * 1e6):.2f}")


if __name__ == "__main__":
    main()
