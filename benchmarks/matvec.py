"""pallas_kernels/matvec.py on the GPU at mini's shapes: correctness, then time against XLA's einsums.

Each timed function runs SETS weight sets (so the weights are not L2-resident) ITERS times in one
jitted fori_loop; set s's x passes through an optimization_barrier with set s-1's outputs, so
XLA neither fuses einsums across sets nor reorders them. Table last: us per call, TB/s of weight bytes.
Usage (repo root, on the GPU): ``PYTHONPATH=$PWD python3 benchmarks/matvec.py [budget seconds [rows of x, e.g. 1,8]]``; variants
past the budget are skipped.
"""
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from benchmarks.kda import rel_err
from pallas_kernels.matvec import MatvecBlocks, matvecs

BUDGET_S = float(sys.argv[1]) if len(sys.argv) > 1 else 170.0
START = time.perf_counter()
BF, F32 = jnp.bfloat16, jnp.float32
HI = jax.lax.Precision.HIGHEST
GROUPS = {  # a decode step's matvec kernels at mini: KDA's input maps (q, k, v, f_a, b, g_a) and o_proj, the MoE's inputs
    "kda": [(2048, BF), (2048, BF), (2048, BF), (128, BF), (16, BF), (128, BF)],
    "kda_o": [(2048, BF)],
    "moe": [(64, F32), (1024, BF), (768, BF), (768, BF)],
}
D, SETS, ITERS = 2048, 8, 25
VARIANTS = [MatvecBlocks(4, 2048, 4, 3), MatvecBlocks(2, 2048, 2, 3), MatvecBlocks(4, 2048, 2, 3),
            MatvecBlocks(8, 2048, 4, 3), MatvecBlocks(8, 2048, 8, 3), MatvecBlocks(16, 2048, 8, 3),
            MatvecBlocks(16, 1024, 8, 4), MatvecBlocks(32, 1024, 8, 3), MatvecBlocks(8, 1024, 4, 3)]
ROWS_OF_X = [int(a) for a in sys.argv[2].split(",")] if len(sys.argv) > 2 else [1, 8]


def out_dtypes(group):
    return tuple(F32 if d == F32 else BF for _, d in group)


def xla(x, ws, dts):
    return tuple(jnp.einsum("md,nd->mn", x.astype(F32) if w.dtype == F32 else x, w, precision=HI).astype(d)
                 for w, d in zip(ws, dts))


def pallas(blocks):
    return lambda x, ws, dts: matvecs(x, ws, dts, blocks=blocks)


def looped(fn, dts):
    @jax.jit
    def loop(x, sets):
        def body(_, acc):
            outs = ()
            for ws in sets:
                xs, _ = jax.lax.optimization_barrier((x, outs))
                outs = fn(xs, ws, dts)
                acc = acc + sum(o[0, 0].astype(F32) for o in outs)
            return acc
        return jax.lax.fori_loop(0, ITERS, body, jnp.float32(0))
    return loop


def time_loop(loop, x, sets, reps=7):
    t0 = time.perf_counter()
    jax.block_until_ready(loop(x, sets))
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(loop(x, sets))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / (ITERS * SETS) * 1e6, compile_s


rows = []
print(jax.devices(), jax.__version__, flush=True)
all_sets = {g: tuple(tuple(jax.random.normal(jax.random.key(1000 * gi + 100 * s + i), (n, D), F32).astype(d) * 0.02
                           for i, (n, d) in enumerate(group)) for s in range(SETS))
            for gi, (g, group) in enumerate(GROUPS.items())}
for m in ROWS_OF_X:
    for gname, group in GROUPS.items():
        dts, sets, key = out_dtypes(group), all_sets[gname], jax.random.key(7 + m)
        nbytes = sum(w.nbytes for w in sets[0])
        x = jax.random.normal(jax.random.fold_in(key, m), (m, D), F32).astype(BF)
        exact = [jnp.einsum("md,nd->mn", x.astype(F32), w.astype(F32), precision=HI) for w in sets[1]]
        for name, fn in [("xla", xla)] + [(str(b), pallas(b)) for b in VARIANTS]:
            if time.perf_counter() - START > BUDGET_S:
                print("budget spent, skipping", gname, m, name, flush=True)
                continue
            try:
                outs = jax.jit(fn, static_argnums=2)(x, sets[1], dts)
                err = max(rel_err(o, e) for o, e in zip(outs, exact))
                f32_err = max(rel_err(o, e) for o, e, d in zip(outs, exact, dts) if d == F32) if F32 in dts else 0.0
                us, comp = time_loop(looped(fn, dts), x, sets)
            except Exception as e:  # a variant that fails to compile is reported, not fatal
                print("FAILED", gname, m, name, repr(e)[:300], flush=True)
                continue
            rows.append((gname, m, name, us, nbytes / us / 1e6, err, f32_err, comp))
            print(rows[-1], flush=True)

print("\nweights/call: " + ", ".join(f"{g} {sum(n * D * (4 if d == F32 else 2) for n, d in group) / 1e6:.2f} MB"
                                    for g, group in GROUPS.items()) + "; "
      f"{ITERS}x{SETS} calls per loop, median of 7; elapsed {time.perf_counter() - START:.0f} s")
print(f"{'group':5} {'M':>2} {'variant':68} {'us/call':>8} {'TB/s':>6} {'vs xla':>6} {'rel err':>8} {'f32 err':>8}")
base = {(g, m): us for g, m, name, us, *_ in rows if name == "xla"}
for g, m, name, us, tbs, err, f32_err, comp in rows:
    print(f"{g:5} {m:2} {name.replace('MatvecBlocks', ''):68} {us:8.2f} {tbs:6.2f} "
          f"{base.get((g, m), float('nan')) / us:6.2f} {err:8.1e} {f32_err:8.1e}")
