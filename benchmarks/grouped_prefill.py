"""The grouped MX matmul at a prefill chunk's size: the Triton kernel's tiles against the grouped Mosaic GPU
kernel (``pallas_kernels/mx_matmul/mosaic_gpu_grouped.py``), with XLA's dense bf16 dot of the same FLOPs as
the roofline peer, all in one process. Every form is checked against the float32 reference first. Then the
whole routed-expert sum (``--moe``): the sorted dispatch on the Triton grouped kernel against
``tiled_moe_mx`` (the Mosaic GPU kernel in its tiled layout), each checked against the sorted dispatch on
float32 products rounded to bf16 as the kernels' are.

    python3 benchmarks/grouped_prefill.py [--tokens 2048] [--budget 400] [--forms NAME ...] [--moe]

Shape: `mini`'s routed experts (64, top 8): gate 1024 -> 768, down 768 -> 1024, and gate and up as one
1024 -> 1536 stack; tokens x 8 rows under random top-8 routing. Times: median of 5 host-timed loops
(``mx_matmul.timed``); forms past the time budget are skipped. Table last.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

from mx_matmul import random_bf16, random_mx, rel_err, routing, timed
from k3jax.functional.moe import grouped_matmul, moe_sorted, situ
from pallas_kernels.mx_matmul import MXBlocks, grouped_mx_matmul, grouped_mx_matmul_reference, tiled_moe_mx
from pallas_kernels.mx_matmul.moe_tiled import pair_slots
from pallas_kernels.mx_matmul.mosaic_gpu_grouped import DEFAULT_BM

EXPERTS, TOP_K = 64, 8
SHAPES = [("gate", 768, 1024), ("down", 1024, 768), ("gate+up", 1536, 1024)]
FORMS = {  # name -> blocks
    "triton 128x128x64 w4 s4 (default)": MXBlocks(128, 128, 64, 4, 4),
    "triton 128x128x64 w8 s4": MXBlocks(128, 128, 64, 8, 4),
    "mosaic_gpu bm 128, bk 128, 3 stages": MXBlocks(bm=128, bk=128, num_stages=3, mosaic_gpu=True),
    "mosaic_gpu bm 128, bk 256, 2 stages": MXBlocks(bm=128, bk=256, num_stages=2, mosaic_gpu=True),
    "mosaic_gpu bm 256, bk 128, 2 stages": MXBlocks(bm=256, bk=128, num_stages=2, mosaic_gpu=True),
    "mosaic_gpu bm 64, bk 256, 3 stages": MXBlocks(bm=64, bk=256, num_stages=3, mosaic_gpu=True),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--budget", type=float, default=400.0, help="seconds; later forms are skipped")
    ap.add_argument("--forms", nargs="*", default=list(FORMS), help="forms to run, in this order (names of FORMS)")
    ap.add_argument("--moe", action="store_true", help="time the routed-expert sum only")
    args = ap.parse_args()
    if args.moe:
        return bench_moe(args.tokens)
    unknown = sorted(set(args.forms) - set(FORMS))
    if unknown:
        ap.error(f"unknown forms {unknown}; choose from {list(FORMS)}")
    start = time.perf_counter()
    print(jax.devices()[0].device_kind, jax.__version__, flush=True)
    key = jax.random.key(0)
    sizes = routing(key, args.tokens, EXPERTS, TOP_K)
    m = args.tokens * TOP_K
    dense = jax.jit(lambda x, wb: jnp.dot(x, wb, preferred_element_type=jnp.float32).astype(x.dtype))
    rows = []
    for name, n, k in SHAPES:
        kw, kx = jax.random.split(jax.random.fold_in(key, n))
        w = random_mx(kw, (EXPERTS, n, k))
        x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
        flops = 2.0 * m * n * k
        ref = grouped_mx_matmul_reference(x, w, sizes)
        for form in args.forms:
            blocks = FORMS[form]
            if time.perf_counter() - start > args.budget:
                print(f"budget spent: {name} {form} skipped", flush=True)
                continue
            fn = jax.jit(lambda x, w, gs, b=blocks: grouped_mx_matmul(x, w, gs, blocks=b))
            try:
                err = rel_err(fn(x, w, sizes).astype(jnp.float32), ref)
                seconds = timed(fn, x, w, sizes, max_iters=50)
            except Exception as e:  # a form that does not compile or run is reported, not fatal
                print(f"{name} {form}: FAILED {type(e).__name__}: {str(e)[:400]}", flush=True)
                continue
            rows.append((name, form, seconds * 1e6, flops / seconds / 1e12, err))
            print(rows[-1], flush=True)
        seconds = timed(dense, x, random_bf16(kx, (k, n)), max_iters=50)
        rows.append((name, "XLA dense bf16 dot, same FLOPs", seconds * 1e6, flops / seconds / 1e12, float("nan")))
        print(rows[-1], flush=True)
    print(f"\n{args.tokens} tokens x top {TOP_K} of {EXPERTS} experts = {m} rows; rel err against the float32 "
          "reference (bf16 outputs)\n\n| shape | form | us | TF/s | rel err |\n|---|---|---|---|---|")
    for name, form, us, tflops, err in rows:
        print(f"| {name} | {form} | {us:.1f} | {tflops:.0f} | {err:.1e} |")


SLOTS_LOOP = 50


def slots_loop(slots, reps: int):
    """Jitted experts -> ``reps`` dependent computations of the tiled layout's slots (each call's experts
    depend on the last call's slots, which are never negative, so nothing is hoisted)."""
    @jax.jit
    def run(experts):
        def body(_, carry):
            slot, groups = slots(experts + carry, EXPERTS, DEFAULT_BM)
            return jnp.minimum(jnp.sum(slot) + jnp.sum(groups), 0)
        return jax.lax.fori_loop(0, reps, body, jnp.zeros((), jnp.int32))
    return run


def bench_moe(tokens: int) -> None:
    """The routed experts of one `mini` MoE layer at a prefill chunk: sorted dispatch (Triton grouped kernel)
    against the tiled Mosaic GPU MoE, in one process."""
    f, r = 768, 1024
    keys = jax.random.split(jax.random.key(1), 5)
    w1, w3 = random_mx(keys[0], (EXPERTS, f, r)), random_mx(keys[1], (EXPERTS, f, r))
    w2 = random_mx(keys[2], (EXPERTS, r, f))
    x = jax.random.normal(keys[3], (tokens, r), jnp.float32).astype(jnp.bfloat16)
    weights, experts = jax.lax.top_k(jax.random.uniform(keys[4], (tokens, EXPERTS)), TOP_K)
    decoded = [w.decode(jnp.float32) for w in (w1, w3, w2)]
    rounded = lambda xs, w, sizes: grouped_matmul(xs.astype(jnp.float32), w, sizes).astype(jnp.bfloat16)
    ref = jax.jit(lambda x, wt, ex: moe_sorted(x, *decoded, wt, ex, situ, matmul=rounded))(x, weights, experts)
    forms = {
        "sorted dispatch, Triton grouped kernel": lambda x, wt, ex: moe_sorted(
            x, w1, w3, w2, wt, ex, situ, matmul=lambda xs, w, sizes: grouped_mx_matmul(xs, w, sizes)),
        "tiled_moe_mx (Mosaic GPU, tiled layout)": lambda x, wt, ex: tiled_moe_mx(x, w1, w3, w2, wt, ex, situ),
    }
    rows = []
    for name, fn in forms.items():
        fn = jax.jit(fn)
        err = rel_err(fn(x, weights, experts).astype(jnp.float32), ref.astype(jnp.float32))
        rows.append((name, timed(fn, x, weights, experts, max_iters=50) * 1e6, err))
        print(rows[-1], flush=True)
    slots_us = timed(slots_loop(pair_slots, SLOTS_LOOP), experts) / SLOTS_LOOP * 1e6
    flops = 2.0 * tokens * TOP_K * 3 * f * r
    print(f"\nrouted experts of one `mini` MoE layer: {tokens} tokens x top {TOP_K} of {EXPERTS}; rel err against "
          "the sorted dispatch on float32 products rounded to bf16\n\n| form | us | TF/s | rel err |\n|---|---|---|---|")
    for name, us, err in rows:
        print(f"| {name} | {us:.1f} | {flops / us / 1e6:.0f} | {err:.1e} |")
    print(f"| tiled_moe_mx's pair slots alone (pair_slots, {SLOTS_LOOP} in a loop) | {slots_us:.1f} | - | - |")


if __name__ == "__main__":
    main()
