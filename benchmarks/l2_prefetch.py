"""Does a weight read into L2 ahead of its matvec, by a kernel that runs beside the latency-bound kernels
before it, shorten the matvec? (Issue 4: the batch-1 step's critical path is a chain of kernels that
leave DRAM mostly idle, such as the MoE's two kernels, 10 MB in 17.6 us, while each KDA layer's input
maps, 26 MB, come from DRAM at 2.3 TB/s in 11.3 us; benchmarks/RESULTS.md, eighteenth session.)

    python3 benchmarks/l2_prefetch.py [--stages 8] [--gap 12] [--rows 6400] [--dim 2048]
                                      [--programs 16,64,128]   (a CPU runs it in interpret mode, small
                                                                sizes, for a check only)

Each of ``stages`` stages is a gap of ``gap`` dependent one-program Pallas kernels on a float32 [dim]
vector (``launch_floor.py``'s link: latency-bound, like the small kernels between two projections of the
step), then the step's matvec kernel (``pallas_kernels.matvec``) of that vector against a [rows, dim]
bf16 weight (6400 x 2048: a KDA layer's input maps, 26 MB), whose first dim outputs are the next stage's
vector. One jitted call, with the decode step's command-buffer options. Forms:
- gap only: the gaps, no matvec;
- cold: every stage its own weight (8 x 26 MB, so each is read from DRAM);
- warm: one weight for every stage (read from L2 where L2 keeps it);
- prefetch P: cold, and at each stage's start a kernel of P programs reads the stage's weight (summing
  it, so that the reads stay) beside the gap; the matvec waits for it (an optimization barrier).
Times: the best of 5 rounds, each a median of 20 calls; us per stage (a whole call's time over the
stages, so it holds a share of the call's fixed host cost), and the matvec's share (the form's time less
the gap-only time, which takes that cost out). The prefetch forms must give the cold form's output bitwise, and
the cold form XLA's einsum chain to float32 summation order.
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from k3jax.implementation import pallas_interpret
from k3jax.inference import DECODE_GPU_OPTIONS, on_gpu
from launch_floor import ROUNDS, median_seconds, pallas_link
from pallas_kernels._triton import triton_params
from pallas_kernels.matvec import matvecs


def _read_kernel(w_ref, after_ref, o_ref, *, rows: int, chunk: int):
    """Program p sums rows [p rows, (p + 1) rows) of w [N, D] into o [D], chunk rows a step.
    ``after_ref`` is not read: it makes the kernel wait for the stage's input."""
    del after_ref
    first = pl.program_id(0) * rows

    def step(i, acc):
        row0 = pl.multiple_of(first + i * chunk, chunk)
        return acc + w_ref[pl.ds(row0, chunk), :].astype(jnp.float32)

    acc = jax.lax.fori_loop(0, rows // chunk, step, jnp.zeros((chunk, w_ref.shape[1]), jnp.float32))
    o_ref[...] = jnp.sum(acc, axis=0)


def read_weight(w, after, programs: int):
    """Every row of w read once by ``programs`` programs (after ``after`` exists): [programs, D] sums."""
    n, d = w.shape
    if n % programs:
        raise SystemExit(f"--programs {programs} must divide --rows {n}")
    rows = n // programs
    chunk = min(rows & -rows, 8)  # the largest power of two dividing rows, at most 8
    interpret = pallas_interpret()
    return pl.pallas_call(
        functools.partial(_read_kernel, rows=rows, chunk=chunk),
        out_shape=jax.ShapeDtypeStruct((programs, d), jnp.float32),
        grid=(programs,),
        out_specs=pl.BlockSpec((None, d), lambda p: (p, 0)),
        compiler_params=triton_params(num_warps=4, num_stages=3, interpret=interpret),
        interpret=interpret,
        name="read_weight",
    )(w, after)


def stages(weights, gap: int, matvec: bool, programs: int | None):
    """The jitted chain: for each weight, the gap, then (with ``matvec``) the matvec; with ``programs``,
    each stage's weight read beside its gap first. Returns (the last vector, the reads' sums)."""
    def run(v, weights):
        reads = []
        for w in weights:
            if programs:
                reads.append(read_weight(w, v, programs))
            for _ in range(gap):
                v = pallas_link(v, 1)
            if programs:
                v, reads[-1] = jax.lax.optimization_barrier((v, reads[-1]))
            if matvec:
                v = matvecs(v[None], [w], [jnp.float32])[0][0, :v.shape[0]]
        return v, reads

    return jax.jit(functools.partial(run, weights=weights), compiler_options=on_gpu(DECODE_GPU_OPTIONS))


def xla_chain(v, weights, gap: int):
    for w in weights:
        for _ in range(gap):
            v = v * 1.0001 + 1.0
        v = jnp.einsum("d,nd->n", v, w.astype(jnp.float32), precision="highest")[:v.shape[0]]
    return v


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stages", type=int, default=8)
    ap.add_argument("--gap", type=int, default=12, help="one-program kernels before each matvec")
    ap.add_argument("--rows", type=int, default=6400)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--programs", default="16,64,128", help="the prefetch forms' program counts")
    args = ap.parse_args()
    if args.dim % 128 or args.rows < args.dim:
        raise SystemExit(f"--dim must be a multiple of 128 and at most --rows, got {args.dim} and {args.rows}")
    keys = jax.random.split(jax.random.key(0), args.stages + 1)
    weights = [(jax.random.normal(k, (args.rows, args.dim), jnp.float32) * args.dim ** -0.5).astype(jnp.bfloat16)
               for k in keys[1:]]
    v = jax.random.normal(keys[0], (args.dim,), jnp.float32)
    megabytes = args.rows * args.dim * 2 / 1e6
    print(f"device {jax.devices()[0].device_kind}; {args.stages} stages of {args.gap} links and a "
          f"{args.rows} x {args.dim} bf16 matvec ({megabytes:.1f} MB)")
    forms = {"gap only": stages(weights, args.gap, False, None), "cold": stages(weights, args.gap, True, None),
             "warm": stages([weights[0]] * args.stages, args.gap, True, None)}
    forms.update({f"prefetch {p}": stages(weights, args.gap, True, int(p)) for p in args.programs.split(",")})
    cold = np.asarray(forms["cold"](v)[0], np.float64)
    reference = np.asarray(xla_chain(v, weights, args.gap), np.float64)
    err = float(np.linalg.norm(cold - reference) / np.linalg.norm(reference))
    if err > 1e-3:
        raise SystemExit(f"cold: the chain's output is {err:.1e} from XLA's einsum chain")
    for name, fn in forms.items():
        if name.startswith("prefetch") and not np.array_equal(np.asarray(fn(v)[0]), np.asarray(cold, np.float32)):
            raise SystemExit(f"{name}: the chain's output differs from the cold form's")
    print(f"cold vs XLA's einsum chain: rel err {err:.1e}; prefetch forms equal to cold")
    best = {name: min(median_seconds(fn, v) for _ in range(ROUNDS)) for name, fn in forms.items()}
    gap = best["gap only"]
    print("\nform | us per stage | matvec's share, us | TB/s of the weight in that share")
    for name, seconds in best.items():
        per, share = seconds / args.stages * 1e6, (seconds - gap) / args.stages * 1e6
        rate = f"{megabytes / share:.2f}" if name != "gap only" and share > 0 else "-"  # MB per us
        print(f"{name} | {per:.1f} | {share:.1f} | {rate}")


if __name__ == "__main__":
    main()
