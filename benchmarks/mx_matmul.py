"""MX matmul benchmark on one GPU: our Pallas kernels against XLA peers, in one run.

    python3 benchmarks/mx_matmul.py [--quick]

1. Correctness on this GPU: kernels vs the float32 references (reference.py) on small random
   shapes, and vs XLA decode-then-dot at the decode shape.
2. Dense: x [M, 3584] @ MXFP4 w [49152, 3584]^T (16 x 3072 outputs), M = 1, 16 (weight-streaming;
   effective weight bandwidth = MXFP4 bytes / time) and M = 4096 (TFLOP/s). Peers: XLA
   decode-then-dot and a bf16 dot of the same shape.
3. Grouped: K3 routed experts (896 experts, 16 per token): gate+up 3584 -> 2 x 3072 and down
   3072 -> 3584, decode batch 1, 8, 64 and prefill 8192 tokens. Peer: ``jax.lax.ragged_dot`` on
   bf16 weights.

Each kernel runs a few tile configurations; the best is reported. Times are medians of repeated
host-timed runs of back-to-back asynchronous calls (``loop`` rows: the call repeated inside one
jitted ``fori_loop``, which removes host dispatch from the time). The table is printed last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from k3jax.mx import MXTensor  # noqa: E402
from pallas_kernels.mx_matmul import (  # noqa: E402
    MXBlocks,
    grouped_mx_matmul,
    grouped_mx_matmul_reference,
    mx_matmul,
    mx_matmul_reference,
)

ROWS: list[dict] = []


def timed(fn, *args, budget_s: float = 0.25, max_iters: int = 200) -> float:
    """Median seconds per call of jitted ``fn(*args)`` over 5 runs of back-to-back calls."""
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    once = time.perf_counter() - start
    iters = int(max(1, min(max_iters, budget_s / 5 / max(once, 1e-6))))
    samples = []
    for _ in range(5):
        start = time.perf_counter()
        out = None
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - start) / iters)
    return statistics.median(samples)


def looped(fn, reps: int):
    """Jitted (x, *rest) -> fn applied reps times in a fori_loop; x depends on the carry so XLA
    cannot hoist the call out of the loop."""

    @jax.jit
    def run(x, *rest):
        out0 = fn(x, *rest)

        def body(_, acc):
            xi = x + (acc[:1, :1] * 0).astype(x.dtype)
            return acc + fn(xi, *rest).astype(jnp.float32)

        return jax.lax.fori_loop(0, reps, body, jnp.zeros(out0.shape, jnp.float32))

    return run


def record(case: str, impl: str, seconds: float, flops: float, weight_bytes: float, note: str = ""):
    row = dict(case=case, impl=impl, us=seconds * 1e6, tflops=flops / seconds / 1e12,
               wbw_tbs=weight_bytes / seconds / 1e12, note=note)
    ROWS.append(row)
    print(f"  {case:28s} {impl:34s} {row['us']:10.1f} us  {row['tflops']:7.1f} TF/s  "
          f"{row['wbw_tbs']:6.2f} TB/s(w) {note}", flush=True)


def random_mx(key, shape) -> MXTensor:
    """Random MXFP4 tensor: uniform code bytes, scales around 2**-7; a 3-D one is generated one
    matrix at a time (generating 10 GB of uint8 bits at once takes 4x that in uint32)."""
    if len(shape) == 3:
        parts = jax.lax.map(lambda kk: random_mx(kk, shape[1:]), jax.random.split(key, shape[0]))
        return MXTensor(parts.codes, parts.scales, "mxfp4")
    kc, ks = jax.random.split(key)
    codes = jax.random.bits(kc, (*shape[:-1], shape[-1] // 2), jnp.uint8)
    scales = jax.random.randint(ks, (*shape[:-1], shape[-1] // 32), 118, 122).astype(jnp.uint8)
    return MXTensor(codes, scales, "mxfp4")


def random_bf16(key, shape) -> jax.Array:
    """Random bf16 of magnitude 2**-7..2**-6 with random sign, generated as bits (no f32 copy)."""
    bits = jax.random.bits(key, shape, jnp.uint16)
    return jax.lax.bitcast_convert_type((bits & 0x807F) | 0x3C00, jnp.bfloat16)


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def check_correctness(key) -> None:
    print("== correctness on device", flush=True)
    k = jax.random.split(key, 8)
    for m, n, kk in [(1, 96, 160), (7, 4160, 3584), (100, 352, 96)]:
        x = jax.random.normal(k[0], (m, kk), jnp.float32).astype(jnp.bfloat16)
        w = MXTensor.quantize(jax.random.normal(k[1], (n, kk)))
        out = mx_matmul(x, w, out_dtype=jnp.float32)
        print(f"  mx_matmul M={m} N={n} K={kk}: rel err {rel_err(out, mx_matmul_reference(x, w)):.2e}")
        xq = MXTensor.quantize(jax.random.normal(k[2], (m, kk)), "mxfp8")
        out = mx_matmul(xq, w, out_dtype=jnp.float32)
        print(f"  W4A8 M={m} N={n} K={kk}: rel err {rel_err(out, mx_matmul_reference(xq, w)):.2e}")
    g, n, kk, m = 9, 352, 224, 300
    w = MXTensor.quantize(jax.random.normal(k[3], (g, n, kk)))
    sizes = jnp.array([40, 0, 1, 77, 0, 0, 100, 17, 50], jnp.int32)  # sums to 285 < 300
    x = jax.random.normal(k[4], (m, kk), jnp.float32).astype(jnp.bfloat16)
    ref = grouped_mx_matmul_reference(x, w, sizes)
    for blocks in [MXBlocks(bm=16, bn=64, bk=64), MXBlocks(bm=64, bn=32, bk=32)]:
        out = grouped_mx_matmul(x, w, sizes, out_dtype=jnp.float32, blocks=blocks)
        print(f"  grouped {blocks.bm}x{blocks.bn}x{blocks.bk}: rel err {rel_err(out, ref):.2e}, "
              f"tail max {float(jnp.max(jnp.abs(out[285:]))):.1e}")
    xq = MXTensor.quantize(jax.random.normal(k[5], (m, kk)), "mxfp8")
    out = grouped_mx_matmul(xq, w, sizes, out_dtype=jnp.float32)
    print(f"  grouped W4A8: rel err {rel_err(out, grouped_mx_matmul_reference(xq, w, sizes)):.2e}")


def best_kernel(case, fn_of_blocks, configs, args, flops, wbytes, loop: bool = False):
    """Time fn_of_blocks(blocks) over configs; record the best; optionally its in-jit loop time."""
    best = None
    for blocks in configs:
        label = f"{blocks.bm}x{blocks.bn}x{blocks.bk} w{blocks.num_warps} s{blocks.num_stages}"
        try:
            t = timed(jax.jit(fn_of_blocks(blocks)), *args)
        except Exception as e:  # a tile config that does not compile is skipped, not fatal
            print(f"  {case} {label}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
            continue
        print(f"    {case} {label}: {t * 1e6:.1f} us", flush=True)
        if best is None or t < best[0]:
            best = (t, blocks, label)
    if best is None:
        return None
    record(case, "pallas mx (best tiles)", best[0], flops, wbytes, best[2])
    if loop:
        reps = 50
        t = timed(looped(fn_of_blocks(best[1]), reps), *args, max_iters=3) / reps
        record(case, "pallas mx, in-jit loop", t, flops, wbytes, best[2])
    return best[1]


def bench_dense(key, quick: bool) -> None:
    print("== dense: x [M, 3584] @ MXFP4 [49152, 3584]^T", flush=True)
    n, k = 16 * 3072, 3584
    kw, kx = jax.random.split(key)
    w = random_mx(kw, (n, k))
    w_bf16 = w.decode(jnp.bfloat16)
    wbytes = w.nbytes
    decode_dot = jax.jit(lambda x, w: jnp.dot(x, w.decode(jnp.bfloat16).T, preferred_element_type=jnp.float32).astype(x.dtype))
    bf16_dot = jax.jit(lambda x, wb: jnp.dot(x, wb.T, preferred_element_type=jnp.float32).astype(x.dtype))
    for m in ([1, 16] if quick else [1, 16, 4096]):
        x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
        case, flops = f"dense M={m}", 2.0 * m * n * k
        err = rel_err(mx_matmul(x, w), decode_dot(x, w))
        print(f"  {case}: rel err vs XLA decode-then-dot {err:.2e}", flush=True)
        if m <= 16:
            configs = [MXBlocks(16, bn, bk, 4, 3) for bn in (32, 64, 128) for bk in (256, 512, 1024)]
        else:
            configs = [MXBlocks(128, 128, 64, 8, 3), MXBlocks(128, 256, 64, 8, 3), MXBlocks(128, 128, 128, 8, 3),
                       MXBlocks(64, 128, 64, 4, 4), MXBlocks(128, 128, 64, 4, 4), MXBlocks(64, 256, 64, 8, 4)]
        if quick:
            configs = configs[:2]
        best_kernel(case, lambda b: (lambda x, w: mx_matmul(x, w, blocks=b)), configs, (x, w), flops, wbytes,
                    loop=m <= 16)
        record(case, "XLA decode-then-dot", timed(decode_dot, x, w), flops, wbytes)
        record(case, "XLA bf16 dot (bf16 weights)", timed(bf16_dot, x, w_bf16), flops, wbytes)
        if m <= 16:
            t = timed(looped(lambda x, wb: bf16_dot(x, wb), 50), x, w_bf16, max_iters=3) / 50
            record(case, "XLA bf16 dot, in-jit loop", t, flops, wbytes)
        xq = MXTensor.quantize(x, "mxfp8")
        try:
            best = MXBlocks(16, 64, 256, 4, 4) if m <= 16 else MXBlocks(128, 128, 64, 8, 3)
            record(case, "pallas W4A8 (MXFP8 x)", timed(jax.jit(lambda x, w: mx_matmul(x, w, blocks=best)), xq, w),
                   flops, wbytes)
        except Exception as e:
            print(f"  {case} W4A8 FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
    del w, w_bf16


def routing(key, tokens: int, experts: int = 896, top_k: int = 16) -> jax.Array:
    """Random top-k routing of tokens -> group_sizes int32 [E] (rows = tokens * top_k)."""
    scores = jax.random.uniform(key, (tokens, experts))
    _, idx = jax.lax.top_k(scores, top_k)
    return jnp.bincount(idx.reshape(-1), length=experts).astype(jnp.int32)


def bench_grouped(key, quick: bool) -> None:
    e = 896
    shapes = [("gate+up", 2 * 3072, 3584), ("down", 3584, 3072)]
    batches = [1, 64] if quick else [1, 8, 64, 8192]
    ragged = jax.jit(lambda x, wb, gs: jax.lax.ragged_dot(x, wb, gs, preferred_element_type=jnp.float32).astype(x.dtype))
    dense = jax.jit(lambda x, wb: jnp.dot(x, wb, preferred_element_type=jnp.float32).astype(x.dtype))
    for name, n, k in shapes:
        print(f"== grouped {name}: {e} experts, {k} -> {n}", flush=True)
        kw, kb, kx, kr = jax.random.split(jax.random.fold_in(key, n), 4)
        w = random_mx(kw, (e, n, k))
        for tokens in batches:
            sizes = routing(jax.random.fold_in(kr, tokens), tokens)
            m = tokens * 16
            x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
            active = int(jnp.sum(sizes > 0))
            flops = 2.0 * m * n * k
            wbytes = active * w.nbytes / e  # bytes of the experts this batch touches
            case = f"{name} tokens={tokens}"
            if tokens <= 64:
                configs = [MXBlocks(16, 32, 512, 4, 3), MXBlocks(16, 64, 256, 4, 3)]
            else:
                configs = [MXBlocks(128, 128, 64, 4, 4), MXBlocks(128, 128, 64, 8, 3)]
            if quick:
                configs = configs[:2]
            best_kernel(case, lambda b: (lambda x, w, gs: grouped_mx_matmul(x, w, gs, blocks=b)), configs,
                        (x, w, sizes), flops, wbytes, loop=tokens <= 64)
            if tokens > 64:  # XLA's ragged_dot lowering asked for 672 GiB here (H200 run, 2026-11-30)
                print(f"  {case}: ragged_dot peer skipped (does not fit)", flush=True)
                wd = random_bf16(kb, (k, n))
                record(case, "XLA dense bf16 dot, same FLOPs", timed(dense, x, wd, max_iters=20), flops, wbytes,
                       "roofline peer, one weight")
                del wd
            else:  # peer: ragged_dot over bf16 weights of only the active experts (its best case)
                w_bf16 = jax.lax.map(lambda kk: random_bf16(kk, (k, n)), jax.random.split(kb, active))
                compact = sizes[sizes > 0]
                record(case, "XLA ragged_dot bf16 weights", timed(ragged, x, w_bf16, compact, max_iters=20),
                       flops, wbytes, f"{active} active experts only")
                del w_bf16
        del w


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer shapes and tile configs")
    parser.add_argument("--skip", default="", help="comma list of sections to skip: check,dense,grouped")
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    print(f"jax {jax.__version__}, devices {jax.devices()}", flush=True)
    key = jax.random.key(0)
    for name, fn in [("check", lambda: check_correctness(key)), ("dense", lambda: bench_dense(key, args.quick)),
                     ("grouped", lambda: bench_grouped(key, args.quick))]:
        if name in skip:
            continue
        try:
            fn()
        except Exception:
            traceback.print_exc()
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "mx_matmul.json"), "w") as f:
            json.dump(ROWS, f, indent=1)
    print("\n== table (times are medians; ratios = peer time / this time, same case; w TB/s = MXFP4 bytes of the weights touched / time)")
    print(f"{'case':28s} {'impl':34s} {'time us':>10s} {'TF/s':>7s} {'w TB/s':>7s} {'vs XLA decode':>13s} {'vs bf16':>8s} {'vs dense':>8s}")
    for row in ROWS:
        peers = {r["impl"]: r["us"] for r in ROWS if r["case"] == row["case"]}
        dec = peers.get("XLA decode-then-dot")
        bf = peers.get("XLA bf16 dot (bf16 weights)", peers.get("XLA ragged_dot bf16 weights"))
        dn = peers.get("XLA dense bf16 dot, same FLOPs")
        ratio = lambda p: f"{p / row['us']:.2f}x" if p else "-"
        print(f"{row['case']:28s} {row['impl']:34s} {row['us']:10.1f} {row['tflops']:7.1f} {row['wbw_tbs']:7.2f} "
              f"{ratio(dec):>13s} {ratio(bf):>8s} {ratio(dn):>8s}  {row['note']}")


if __name__ == "__main__":
    main()
