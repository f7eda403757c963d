"""Issue 4 (helper o): fused decode MoE A/B at mini's layer shape, same process, interleaved.

Baseline: scratch/o_moe_base.py (pallas_kernels/mx_matmul/moe.py at 3e4f06f, CUDA-core products). Variants: the
tree's fused_moe_mx and scratch/o_moe_dot.py (products on the tensor cores) at several tiles. Each timed row: one
jitted fori_loop of LOOP calls, x perturbed by the carry, experts shifted by k every call (the loop walks all 64
experts, 80 MB > L2: weights from DRAM). Median over interleaved rounds, per call, loop overhead included.
Correctness first: every variant against the baseline (float32 sums) and the dense float32 reference.

    python3 scratch/o_ab.py [--budget SECONDS] [--only NAME,NAME]
"""

import os
import statistics
import sys
import time

sys.path.insert(0, "scratch")
import jax
import jax.numpy as jnp
import numpy as np

from k3jax.functional.moe import moe_dense, situ
from k3jax.mx import MXTensor
import o_moe_base
import o_moe_dot

TINY = bool(os.environ.get("O_TINY"))
E, F, R, K = (8, 64, 512, 2) if TINY else (64, 768, 1024, 8)
LOOP = 2 if TINY else 20
BUDGET_S = float(sys.argv[sys.argv.index("--budget") + 1]) if "--budget" in sys.argv else 150.0
T0 = time.perf_counter()


def random_mx(key, shape):
    def one(kk):
        kc, ks = jax.random.split(kk)
        return (jax.random.bits(kc, (*shape[1:-1], shape[-1] // 2), jnp.uint8),
                jax.random.randint(ks, (*shape[1:-1], shape[-1] // 32), 118, 122).astype(jnp.uint8))
    codes, scales = jax.lax.map(one, jax.random.split(key, shape[0]))
    return MXTensor(codes, scales, "mxfp4")


def rel(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def looped(fn):
    @jax.jit
    def run(x, wt, ex, *w):
        def body(i, acc):
            xi = x + (acc[:1, :1] * 0).astype(x.dtype)
            return acc + fn(xi, wt, (ex + i * K) % E, *w)
        return jax.lax.fori_loop(0, LOOP, body, jnp.zeros(x.shape, jnp.float32))
    return run


def dot(**kw):
    return lambda x, wt, ex, *w: o_moe_dot.fused_moe_dot(x, *w, wt, ex, situ, out_dtype=jnp.float32, **kw)


def variants():
    from pallas_kernels.mx_matmul import fused_moe_mx

    base = lambda x, wt, ex, *w: o_moe_base.fused_moe_mx(x, *w, wt, ex, situ, out_dtype=jnp.float32)
    tree = lambda x, wt, ex, *w: fused_moe_mx(x, *w, wt, ex, situ, out_dtype=jnp.float32)
    return {
        "base (3e4f06f, CUDA cores)": base,
        "tree fused_moe_mx": tree,
        "dot bf32 bk1024 br1024 w8": dot(bf=32, bk=1024, br=1024),
        "dot bf32 bk1024 br256 w8": dot(bf=32, bk=1024, br=256),
        "dot bf32 bk1024 br1024 w8 loads first": dot(bf=32, bk=1024, br=1024, loads_first=True),
        "dot bf32 bk256 br256 w8 s3 one loop": dot(bf=32, bk=256, br=256, num_stages=3, one_loop=True),
        "dot bf32 bk256 br256 w8 s4 one loop": dot(bf=32, bk=256, br=256, num_stages=4, one_loop=True),
        "dot bf32 bk512 br256 w8 s3 one loop": dot(bf=32, bk=512, br=256, num_stages=3, one_loop=True),
        "dot bf32 bk512 br256 w4 s3 one loop": dot(bf=32, bk=512, br=256, num_warps=4, num_stages=3,
                                                   one_loop=True),
        "dot bf32 bk1024 br256 w4": dot(bf=32, bk=1024, br=256, num_warps=4),
        "dot bf64 bk1024 br256 w8": dot(bf=64, bk=1024, br=256),
        "dot bf64 bk256 br256 w8 s3 one loop": dot(bf=64, bk=256, br=256, num_stages=3, one_loop=True),
        "dot bf32 bk1024 br128 w8": dot(bf=32, bk=1024, br=128),
        "dot bf32 bk1024 br512 w8": dot(bf=32, bk=1024, br=512),
        "dot bf32 bk1024 br256 w8 s3": dot(bf=32, bk=1024, br=256, num_stages=3),
        "dot bf32 bk1024 br128 w8 s4": dot(bf=32, bk=1024, br=128, num_stages=4),
        "dot bf32 bk512 br256 w8 s3": dot(bf=32, bk=512, br=256, num_stages=3),
        "base again": base,
    }


def main():
    print(f"jax {jax.__version__} {jax.devices()}", flush=True)
    k1, k3, k2, kx, kr, kw = jax.random.split(jax.random.key(0), 6)
    stacks = (random_mx(k1, (E, F, R)), random_mx(k3, (E, F, R)), random_mx(k2, (E, R, F)))
    fns = variants()
    if "--only" in sys.argv:
        keep = sys.argv[sys.argv.index("--only") + 1].split(",")
        fns = {n: f for n, f in fns.items() if n.startswith("base") or any(n.startswith(k) for k in keep)}
    inputs = {}
    for tokens in (1, 8):
        x = jax.random.normal(jax.random.fold_in(kx, tokens), (tokens, R), jnp.float32).astype(jnp.bfloat16)
        _, ex = jax.lax.top_k(jax.random.uniform(jax.random.fold_in(kr, tokens), (tokens, E)), K)
        if tokens == 8:
            ex = ex.at[3, 1].set(ex[3, 0])  # one token picks an expert twice
        wt = jax.random.uniform(jax.random.fold_in(kw, tokens), (tokens, K), jnp.float32) / K
        inputs[tokens] = (x, wt, ex.astype(jnp.int32), *stacks)
    dense = [w.decode(jnp.float32) for w in stacks]
    ok = {}
    for tokens, args in inputs.items():
        x, wt, ex = args[:3]
        ref = moe_dense(x.astype(jnp.float32), *dense, wt, ex, situ)
        base = jax.jit(fns["base (3e4f06f, CUDA cores)"])(*args)
        for name, fn in fns.items():
            try:
                out = jax.jit(fn)(*args)
                eb, ed = rel(out, base), rel(out, ref)
                good = eb < 1e-4 and ed < 1e-2 and bool(jnp.all(jnp.isfinite(out)))
                print(f"check T={tokens} {name:44s} vs base {eb:.1e} vs dense {ed:.1e} {'ok' if good else 'FAIL'}",
                      flush=True)
                ok[name] = ok.get(name, True) and good
            except Exception as e:  # a variant that fails to compile is reported and dropped
                print(f"check T={tokens} {name}: ERROR {str(e)[:600]}", flush=True)
                ok[name] = False
    del dense
    names = [n for n in fns if ok[n]]
    loops = {}
    for name in names:
        for tokens in inputs:
            fn = looped(fns[name])
            jax.block_until_ready(fn(*inputs[tokens]))
            loops[name, tokens] = fn
    print(f"checks and compiles done at {time.perf_counter() - T0:.0f} s", flush=True)
    samples = {key: [] for key in loops}
    rounds = 0
    while rounds < 40 and (rounds < 3 or time.perf_counter() - T0 < BUDGET_S):
        for key, fn in loops.items():
            args = inputs[key[1]]
            start = time.perf_counter()
            for _ in range(5):
                out = fn(*args)
            jax.block_until_ready(out)
            samples[key].append((time.perf_counter() - start) / 5 / LOOP * 1e6)
        rounds += 1
    print(f"\n{rounds} interleaved rounds at {time.perf_counter() - T0:.0f} s; us per call (median, [p25-p75]), "
          f"loop of {LOOP}, experts rotated per call")
    print(f"{'variant':44s} {'T=1':>22} {'T=8':>22}")
    for name in names:
        cells = []
        for tokens in inputs:
            q = np.percentile(samples[name, tokens], [25, 50, 75])
            cells.append(f"{q[1]:7.2f} [{q[0]:6.2f}-{q[2]:6.2f}]")
        print(f"{name:44s} " + " ".join(f"{c:>22}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
