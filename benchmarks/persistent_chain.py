"""Issue 4's design question, measured: does a chain of dependent matvecs run near the memory rate when it is
one persistent kernel that streams the next link's weights while it waits for the link before?

A batch-1 decode step is a chain of small dependent kernels; each boundary costs a launch, a ramp and a tail
(seventeenth session: 1.1-1.4 us per boundary; the step's matvecs read at 2.2 TB/s). The weights of the next
link do not depend on the link before, so one kernel that owns every SM for the whole chain could keep its
weight copies going through the wait. This script times that kernel against one Triton matvec kernel per link
(the step's `pallas_kernels.matvec.matvecs`):

- ``persistent``: one Mosaic GPU program per 64 weight rows (all resident: N / 64 <= the SM count), one
  warpgroup each, the whole chain in one launch. Per link: wait until every program has written the link
  before (a grid barrier: each program adds 1 to every program's counter when its output tile is written,
  and waits for its own counter to reach the program count, then takes that count off, so the counters are
  0 again when the kernel ends), TMA the link's input [8, K] (x as wgmma's N = 8), then walk K in steps of
  ``bk``: wait for the step's weight tile [64, bk] in its slot, one wgmma, refill the slot with the tile
  ``stages`` steps ahead, which near a link's end is the next link's: those copies are in flight through the
  barrier.
- ``persistent, no copies ahead``: the same kernel with the slots filled only from the link's own start, after
  its barrier (so the barrier's wait is not hidden): what the copies ahead are worth.
- ``persistent, flagged inputs``: the same kernel with no grid barrier between links. A program's output
  tile leaves as (two bf16, link + 1) pairs, each one 64-bit store to a buffer of the link's input words
  (persistent between calls, zero at a call's start); each reader polls its words until their flags read
  link + 1 and moves the data into its x tile. Seeing a word's flag is seeing its data (one single-copy-atomic
  access), so a dependent link costs one store and one poll through L2 instead of the barrier's chain of round
  trips (the output's copy out and wait, the release, the polls, the compare-and-swap, the input's copy in).
  After the last link one grid barrier, then each writer zeroes its words for the next call.
- ``Triton matvec``: one kernel per link.

Link l+1's input is the first K values of link l's output (N >= K); the links take their weights in turn from
``--links`` sets (more than L2 holds). Per link: the time of a chain of R L links less that of L links, over
(R - 1) L. The fixed cost of a call cancels as long as both chains take longer on the GPU than a call takes to
dispatch (about 80 us here): shorter chains run at the host's rate, which hides the links' cost. Every form's
chain output is checked against a float32 chain with the same bf16 roundings before timing. GPU only (the grid
barrier has no interpret mode); on a CPU it lowers the kernel for CUDA and stops.

    python3 benchmarks/persistent_chain.py [--shapes 8192x1536,8192x512] [--links 32] [--repeat 4]
                                           [--stages 4] [--bk 256] [--forms "persistent;Triton matvec"]
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from benchmarks.kda import time_jax
from pallas_kernels._mosaic_gpu import splat_i32, store_transposed, swizzled
from pallas_kernels.matvec import matvecs

ROWS, X_ROWS = 64, 8
FORMS = ("persistent", "persistent, no copies ahead", "persistent, flagged inputs", "Triton matvec")
_F32, _BF16 = jnp.float32, jnp.bfloat16


def _signal_every_program(programs: int):
    """Thread t of the warpgroup adds 1 to counter t (t < programs), after a warpgroup barrier and with
    release order at GPU scope: the output tile this program wrote (TMA, completed) is visible first."""
    import jax.experimental.mosaic.gpu as mgpu
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, gpu, llvm

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))
    def signal(ctx, counters):
        del ctx
        i32 = ir.IntegerType.get_signless(32)
        mgpu.utils.warpgroup_barrier()
        tid = arith.index_cast(i32, gpu.thread_id(gpu.Dimension.x))
        ptr = mgpu.utils.getelementptr(mgpu.utils.memref_ptr(counters), [tid], i32)
        active = arith.cmpi(arith.CmpIPredicate.ult, tid, arith.constant(i32, programs))
        llvm.inline_asm(ir.Type.parse("!llvm.void"), [ptr, active],
                        "@$1 red.release.gpu.global.add.u32 [$0], 1;", "l,b", has_side_effects=True)

    return signal


def _wait_for_every_program(programs: int):
    """One thread waits until this program's counter holds ``programs`` and takes them off (compare-and-swap),
    then an acquire fence, a proxy fence (the link's input is read by TMA next) and a warpgroup barrier."""
    import jax.experimental.mosaic.gpu as mgpu
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, gpu, llvm

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))
    def wait(ctx, counters):
        del ctx
        i32 = ir.IntegerType.get_signless(32)
        block = arith.index_cast(i32, gpu.block_id(gpu.Dimension.x))
        ptr = mgpu.utils.getelementptr(mgpu.utils.memref_ptr(counters), [block], i32)
        first = arith.cmpi(arith.CmpIPredicate.eq, arith.index_cast(i32, gpu.thread_id(gpu.Dimension.x)),
                           arith.constant(i32, 0))
        llvm.inline_asm(
            ir.Type.parse("!llvm.void"), [ptr, arith.constant(i32, programs), first],
            """{
            .reg .pred p, q;
            .reg .b32 seen, left;
            @!$2 bra DONE;
            WAIT:
            ld.relaxed.gpu.global.b32 seen, [$0];
            setp.lt.u32 p, seen, $1;
            @p bra WAIT;
            sub.u32 left, seen, $1;
            atom.relaxed.gpu.global.cas.b32 left, [$0], seen, left;
            setp.ne.u32 q, left, seen;
            @q bra WAIT;
            fence.acq_rel.gpu;
            fence.proxy.async.global;
            DONE:
            }""",
            "l,r,b", has_side_effects=True)
        mgpu.utils.warpgroup_barrier()

    return wait


def _publish_row(words: int):
    """Threads 0-31 of a program below ``words`` / 32: word t of the output tile's row 0 (two bf16, read from
    shared memory) into flagged[link, 32 program + t] as one 64-bit store of (data, link + 1), so a reader that
    sees the flag sees the data (no fence, no counter)."""
    import jax.experimental.mosaic.gpu as mgpu
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, gpu, llvm

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType(), plgpu.Layout.WG_SPLAT))
    def publish(ctx, row_ref, flagged, link):
        del ctx
        i32 = ir.IntegerType.get_signless(32)
        c = lambda v: arith.constant(i32, v)
        link = splat_i32(link)
        tid = arith.index_cast(i32, gpu.thread_id(gpu.Dimension.x))
        block = arith.index_cast(i32, gpu.block_id(gpu.Dimension.x))
        word = arith.addi(arith.muli(block, c(ROWS // 2)), tid)
        active = arith.andi(arith.cmpi(arith.CmpIPredicate.ult, tid, c(ROWS // 2)),
                            arith.cmpi(arith.CmpIPredicate.ult, word, c(words)))
        data = llvm.load(i32, mgpu.utils.getelementptr(mgpu.utils.memref_ptr(row_ref), [tid], i32))
        slot = arith.muli(arith.addi(arith.muli(link, c(words)), word), c(2))
        dst = mgpu.utils.getelementptr(mgpu.utils.memref_ptr(flagged), [slot], i32)
        llvm.inline_asm(ir.Type.parse("!llvm.void"), [dst, data, arith.addi(link, c(1)), active],
                        "{ .reg .b64 v; mov.b64 v, {$1, $2}; @$3 st.relaxed.gpu.global.b64 [$0], v; }",
                        "l,r,r,b", has_side_effects=True)

    return publish


def _poll_row(words: int, bk: int):
    """Each thread of the warpgroup waits for its ``words`` / 128 words of flagged[link] to carry the flag
    link + 1 and stores their data into row 0 of the x tiles [steps, 8, bk] in shared memory (8-row tiles of
    64 columns; row 0 is not moved by the 128-byte swizzle). The caller then fences for wgmma."""
    import jax.experimental.mosaic.gpu as mgpu
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, gpu, llvm

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType(swizzled(bk)), plgpu.Layout.WG_SPLAT))
    def poll(ctx, flagged, x_ref, link):
        del ctx
        i32, i8 = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(8)
        c = lambda v: arith.constant(i32, v)
        link = splat_i32(link)
        tid = arith.index_cast(i32, gpu.thread_id(gpu.Dimension.x))
        base = mgpu.utils.memref_ptr(flagged)
        x_base = mgpu.utils.memref_ptr(x_ref)
        # byte of row 0, column 2 tid within a 256-column slice: tile tid // 32 of 1024 bytes, 4 bytes a word
        in_slice = arith.addi(arith.muli(arith.divui(tid, c(32)), c(1024)), arith.muli(arith.remui(tid, c(32)), c(4)))
        for i in range(words // 128):
            word = arith.addi(arith.muli(link, c(words)), arith.addi(tid, c(128 * i)))
            src = mgpu.utils.getelementptr(base, [arith.muli(word, c(2))], i32)
            data = llvm.inline_asm(
                i32, [src, arith.addi(link, c(1))],
                f"""{{
                .reg .pred p;
                .reg .b32 f;
                .reg .b64 v;
                POLL_{i}:
                ld.relaxed.gpu.global.b64 v, [$1];
                mov.b64 {{$0, f}}, v;
                setp.ne.u32 p, f, $2;
                @p bra POLL_{i};
                }}""",
                "=r,l,r", has_side_effects=True)
            column = 256 * i
            offset = (column // bk) * 16 * bk + (column % bk) // 64 * 1024
            llvm.store(data, mgpu.utils.getelementptr(x_base, [arith.addi(in_slice, c(offset))], i8))

    return poll


def _clear_flags(words: int, links: int):
    """Threads 0-31 of a program below ``words`` / 32 zero their word of flagged in every link (after a grid
    barrier, so no program still reads them): the next call finds no flag set."""
    import jax.experimental.mosaic.gpu as mgpu
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, gpu, llvm

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))
    def clear(ctx, flagged):
        del ctx
        i32, i64 = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(64)
        c = lambda v: arith.constant(i32, v)
        tid = arith.index_cast(i32, gpu.thread_id(gpu.Dimension.x))
        block = arith.index_cast(i32, gpu.block_id(gpu.Dimension.x))
        word = arith.addi(arith.muli(block, c(ROWS // 2)), tid)
        active = arith.andi(arith.cmpi(arith.CmpIPredicate.ult, tid, c(ROWS // 2)),
                            arith.cmpi(arith.CmpIPredicate.ult, word, c(words)))
        first = mgpu.utils.getelementptr(mgpu.utils.memref_ptr(flagged), [arith.muli(word, c(2))], i32)
        llvm.inline_asm(
            ir.Type.parse("!llvm.void"), [first, arith.constant(i64, words * 8), c(links), active],
            """{
            .reg .pred p;
            .reg .b32 i;
            .reg .b64 a, z;
            @!$3 bra CLEARED;
            mov.u32 i, 0;
            mov.b64 a, $0;
            mov.b64 z, 0;
            CLEAR:
            st.relaxed.gpu.global.b64 [a], z;
            add.s64 a, a, $1;
            add.u32 i, i, 1;
            setp.lt.u32 p, i, $2;
            @p bra CLEAR;
            CLEARED:
            }""",
            "l,l,r,b", has_side_effects=True)

    return clear


def _chain_kernel(x_g, w_g, out_g, w_s, x_s, out_s, w_bars, x_bar, *, links: int, k: int, bk: int, stages: int,
                  ahead: bool, flags: bool, programs: int):
    rows = pl.ds(jax.lax.axis_index("rows") * ROWS, ROWS)
    steps = k // bk
    total = links * steps
    n_weights = w_g.shape[0]
    words = k // 2  # a link's input, two bf16 a word
    counters = pl.get_global(plgpu.SemaphoreType.REGULAR((programs,)))
    signal, wait = _signal_every_program(programs), _wait_for_every_program(programs)
    if flags:  # (data, flag) word pairs of every link's input, zero between calls
        flagged = pl.get_global(plgpu.SemaphoreType.REGULAR((links * words * 2,)))
        publish, poll = _publish_row(words), _poll_row(words, bk)

    def fetch(t):
        link, step = t // steps, jax.lax.rem(t, steps)
        slot = jax.lax.rem(t, stages)
        plgpu.copy_gmem_to_smem(w_g.at[jax.lax.rem(link, n_weights), rows, pl.ds(step * bk, bk)], w_s.at[slot],
                                w_bars.at[slot])

    def fetch_link_start(link):
        for step in range(min(stages, steps)):
            fetch(link * steps + step)

    def copy_input(source):
        for step in range(steps):
            plgpu.copy_gmem_to_smem(source.at[:, pl.ds(step * bk, bk)], x_s.at[step], x_bar.at[0])
        plgpu.barrier_wait(x_bar.at[0])

    def run_link(link):
        def accumulate(acc_ref):
            def step_fn(step, _):
                t = link * steps + step
                slot = jax.lax.rem(t, stages)
                plgpu.barrier_wait(w_bars.at[slot])
                plgpu.wgmma(acc_ref, w_s.at[slot], x_s.at[step].transpose((1, 0)))
                plgpu.wgmma_wait(0)
                refill = t + stages < total if ahead else step + stages < steps

                @pl.when(refill)
                def _():
                    fetch(t + stages)

                return ()

            jax.lax.fori_loop(0, steps, step_fn, ())
            return acc_ref[...]

        acc = pl.run_scoped(accumulate, plgpu.ACC((ROWS, X_ROWS), _F32))
        if flags:
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the link before's tile has left out_s
        store_transposed()(acc.astype(_BF16), out_s)
        if flags:
            publish(out_s, flagged, link)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_s, out_g.at[link, :, rows])
        if not flags:  # the counters' readers copy the output by TMA
            plgpu.wait_smem_to_gmem(0)

    if ahead:  # the ring runs across links from the start
        for t in range(min(stages, total)):
            fetch(t)
    else:
        fetch_link_start(0)
    copy_input(x_g)
    run_link(jnp.int32(0))

    def link_fn(link, _):
        if flags:
            poll(flagged, x_s, link - 1)
            plgpu.commit_smem()
        else:
            signal(counters)
            wait(counters)
            if not ahead:
                fetch_link_start(link)
            copy_input(out_g.at[link - 1])
        run_link(link)
        return ()

    jax.lax.fori_loop(1, links, link_fn, ())
    if flags:  # once every program has read its last input, the flags go back to zero
        signal(counters)
        wait(counters)
        _clear_flags(words, links)(flagged)
    plgpu.wait_smem_to_gmem(0)


@functools.partial(jax.jit, static_argnames=("links", "bk", "stages", "ahead", "flags"))
def persistent_chain(x8, weights, *, links: int, bk: int = 256, stages: int = 4, ahead: bool = True,
                     flags: bool = False):
    """x8 bf16 [8, N], weights bf16 [W, N, K] -> the outputs of ``links`` links [links, 8, N]; link l reads
    weights[l % W] and (from l = 1) the first K values of link l - 1's output. ``flags``: each link's input
    passes as flagged words instead of a grid barrier and a copy (module docstring)."""
    n_weights, n, k = weights.shape
    if n % ROWS or k % bk or k > n or x8.shape != (X_ROWS, n):
        raise ValueError(f"weights [W, N, K] = {weights.shape}, x8 {x8.shape}: N a multiple of {ROWS}, K of "
                         f"bk = {bk}, K <= N, x8 [{X_ROWS}, N]")
    programs = n // ROWS
    sms = getattr(jax.devices()[0], "core_count", programs)
    if flags and not (ahead and bk % 256 == 0):
        raise ValueError(f"flags: the weights' copies run ahead and bk = {bk} is a multiple of 256")
    if programs > sms:  # the grid barrier waits for every program: all must be resident at once
        raise ValueError(f"weights [W, N, K] = {weights.shape}: N / {ROWS} = {programs} programs, more than the "
                         f"{sms} SMs (the grid barrier would wait forever)")
    steps = k // bk
    scratch = [
        plgpu.SMEM((stages, ROWS, bk), _BF16, transforms=swizzled(bk)),
        plgpu.SMEM((steps, X_ROWS, bk), _BF16, transforms=swizzled(bk)),
        plgpu.SMEM((X_ROWS, ROWS), _BF16),
        plgpu.Barrier(num_arrivals=1, num_barriers=stages),
        plgpu.Barrier(num_arrivals=steps, num_barriers=1),
    ]
    kernel = functools.partial(_chain_kernel, links=links, k=k, bk=bk, stages=stages, ahead=ahead, flags=flags,
                               programs=programs)
    return plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct((links, X_ROWS, n), _BF16), scratch_types=scratch,
                        grid=(programs,), grid_names=("rows",))(x8, weights)


@functools.partial(jax.jit, static_argnames="links")
def triton_chain(x_row, weights, *, links: int):
    """The same chain as one ``matvecs`` kernel per link; returns the last link's output row [N]."""
    n_weights, _, k = weights.shape
    x = x_row[None]
    for link in range(links):
        x = matvecs(x[:, :k], [weights[link % n_weights]], [_BF16])[0]
    return x[0]


def reference(x_row, weights, links: int) -> np.ndarray:
    """The chain in float32 with each link's output rounded to bf16, as the kernels round."""
    n_weights, _, k = weights.shape
    w32 = np.asarray(weights.astype(_F32))
    x = np.asarray(x_row.astype(_F32))
    for link in range(links):
        x = np.asarray(jnp.asarray(w32[link % n_weights] @ x[:k]).astype(_BF16).astype(_F32))
    return x


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="8192x1536,8192x512", help="N x K of the links' weights, comma separated")
    ap.add_argument("--links", type=int, default=32, help="links of the shorter chain (and weight sets)")
    ap.add_argument("--repeat", type=int, default=4, help="the longer chain is the shorter one this many times")
    ap.add_argument("--stages", type=int, default=4, help="weight tiles in flight per program")
    ap.add_argument("--bk", type=int, default=256, help="K columns per weight tile")
    ap.add_argument("--forms", default=";".join(FORMS), help="the forms to time, separated by semicolons")
    args = ap.parse_args()
    forms_asked = args.forms.split(";")
    if unknown := sorted(set(forms_asked) - set(FORMS)):
        ap.error(f"--forms: unknown {unknown}; choose from {list(FORMS)}")
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    if jax.default_backend() != "gpu":
        n, k = shapes[0]
        args_ = (jnp.zeros((X_ROWS, n), _BF16), jnp.zeros((2, n, k), _BF16))
        for flags in (False, True):
            fn = functools.partial(persistent_chain, links=2, bk=args.bk, stages=args.stages, flags=flags)
            text = jax.jit(fn).trace(*args_).lower(lowering_platforms=("cuda",)).as_text()
            print(f"no GPU: the kernel (flags={flags}) lowers for CUDA ({len(text)} characters of StableHLO)")
        print("nothing timed")
        return
    short, long = args.links, args.repeat * args.links
    rows = []
    for n, k in shapes:
        keys = jax.random.split(jax.random.key(n * k), 2)
        weights = (jax.random.normal(keys[1], (short, n, k), _F32) * k**-0.5).astype(_BF16)
        x_row = jax.random.normal(keys[0], (n,), _F32).astype(_BF16)
        x8 = jnp.zeros((X_ROWS, n), _BF16).at[0].set(x_row)
        expected = reference(x_row, weights, short)
        forms = {
            "persistent": lambda links: functools.partial(
                persistent_chain, x8, weights, links=links, bk=args.bk, stages=args.stages),
            "persistent, no copies ahead": lambda links: functools.partial(
                persistent_chain, x8, weights, links=links, bk=args.bk, stages=args.stages, ahead=False),
            "persistent, flagged inputs": lambda links: functools.partial(
                persistent_chain, x8, weights, links=links, bk=args.bk, stages=args.stages, flags=True),
            "Triton matvec": lambda links: functools.partial(
                triton_chain, x_row, weights, links=links),
        }
        for name in forms_asked:
            make = forms[name]
            out = np.asarray(make(short)()).astype(np.float32)
            last = out[-1, 0] if out.ndim == 3 else out
            err = float(np.linalg.norm(last - expected) / np.linalg.norm(expected))
            print(f"{n}x{k} {name}: rel err {err:.1e} against the float32 chain", flush=True)
            if not err < 5e-2:
                raise SystemExit(f"{name} at {n}x{k}: the chain's output is {err:.1e} from the float32 chain")
            seconds = [time_jax(make(length)) / 1e3 for length in (short, long)]  # time_jax: ms
            per_link = (seconds[1] - seconds[0]) / (long - short)
            rows.append((f"{n}x{k}", name, per_link * 1e6, n * k * 2 / per_link / 1e12))
            print(f"{n}x{k} {name}: {seconds[0] * 1e6:.0f} / {seconds[1] * 1e6:.0f} us per call of {short} / {long} "
                  f"links, {per_link * 1e6:.2f} us per link", flush=True)
    print(f"\ndevice {jax.devices()[0].device_kind}, JAX {jax.__version__}; chains of {short} and {long} links")
    print("weights | form | us per link | TB/s")
    for shape, name, us, tbs in rows:
        print(f"{shape} | {name} | {us:.2f} | {tbs:.2f}")


if __name__ == "__main__":
    main()
