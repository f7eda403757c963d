"""MX matmul benchmark on one GPU: our Pallas kernels against XLA peers, in one run.

    python3 benchmarks/mx_matmul.py [--quick] [--skip check,dense,grouped,moe] [--only decode] [--moe-sweep]
                                    [--moe-shape K3|mini] [--moe-tokens 256,2048] [--moe-bm 8,16,32,64]

``--only decode``: the batch-1 question in about three minutes: a shorter correctness section (default,
one-row gemv and Mosaic GPU paths), dense M = 1 and 16 (the Triton default tiles, the default gemv,
the Mosaic GPU kernel's configurations with its in-jit loop, its 64x256 s2 tiles with and without
``MosaicBlocks.out_mn`` in a jitted loop with their error against decode-then-dot, XLA decode-then-dot,
bf16 dot) and
grouped at 1 token (default, gemv variants, ragged_dot); no decode-only or W4A8 timing rows.

``--profile``: one call each of the Triton default, the one-row gemv and the Mosaic GPU kernel at the
dense decode shape (M = 1 and 16), after a warm-up call, for a profiler (``ncu``) to count their
instructions.

1. Correctness on this GPU: the Pallas decode (PTX and arith, and the PTX emulation run in
   interpret mode) bit for bit against XLA's decode; every kernel path (one-row gemv included) vs
   the float32 references (reference.py) on small random shapes; vs XLA decode-then-dot at the
   benchmark shapes.
2. Dense: x [M, 3584] @ MXFP4 w [49152, 3584]^T (16 x 3072 outputs), M = 1, 16 (weight-streaming;
   effective weight bandwidth = MXFP4 bytes / time) and M = 4096 (TFLOP/s). Peers: XLA
   decode-then-dot and a bf16 dot of the same shape.
   M = 512 too (where the dispatch between the fused kernel and decode-then-dot sits), and the
   decode kernel alone (GB/s of MXFP4 read + bf16 written).
3. Grouped: K3 routed experts (896 experts, 16 per token): gate+up 3584 -> 2 x 3072 and down
   3072 -> 3584, decode batch 1, 8, 64 and prefill 8192 tokens. Peer: ``jax.lax.ragged_dot`` on
   bf16 weights.
4. MoE: one layer's routed experts (K3 for 1-8 tokens, `mini` for 1 and 8), the two-kernel MoE
   (``pallas_kernels.moe``'s split form) against the sorted dispatch through the grouped kernel, and the tiled
   Mosaic GPU MoE in tiles of ``--moe-bm`` pairs, each timed inside a jitted loop (``--moe-sweep``: the split
   form's tile configurations too, at one token; ``--moe-tokens``:
   other token counts, e.g. K3's 2048-token prefill chunk). The loop calls the op on the same experts, so their
   weights stay in L2, and its own small kernels cost about 15 us an iteration on the H200: at one
   token the rows compare L2-hot kernels near that floor, not the decode step's DRAM-bound MoE
   (benchmarks/HISTORY.md, 2026-12-01).

Each kernel runs a few tile configurations (a failing one is printed and skipped); the best of the
dot kernels and the best of the one-row gemv kernels (``MXBlocks.gemv``) are reported apart. Times
are medians of repeated host-timed runs of back-to-back asynchronous calls (``loop`` rows: the call
repeated inside one jitted ``fori_loop``, which removes host dispatch from the time). The table is
printed last.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
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
from k3jax.functional.moe import moe_sorted, situ  # noqa: E402
from pallas_kernels._platform import interpret as pallas_interpret, mosaic_gpu_runs  # noqa: E402
from pallas_kernels.moe.mosaic_gpu_tiled import tiled_moe_mx  # noqa: E402
from pallas_kernels.moe.triton_split import (SPLIT_MOE_BLOCKS, SPLIT_MOE_DOWN_BLOCKS_ONE_TOKEN,  # noqa: E402
                                             fused_moe_mx_split)
from pallas_kernels.mx_matmul import (  # noqa: E402
    MXBlocks,
    default_blocks,
    grouped_mx_matmul,
    grouped_mx_matmul_reference,
    mx_matmul,
    mx_matmul_reference,
)
from pallas_kernels.mx_matmul.layout import kernel_weight_layout  # noqa: E402
from pallas_kernels.mx_matmul.triton import decode_mxfp4_pallas  # noqa: E402

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


def label(b: MXBlocks) -> str:
    """Short name of a configuration: tiles, launch settings, method."""
    if b.decode_then_dot:
        return f"decode {b.bn}x{b.bk} w{b.num_warps} {b.decode} + XLA dot"
    if b.mosaic_gpu:
        return f"mosaic_gpu 64x{b.bk} s{b.num_stages}"
    if b.gemv:
        return f"gemv 1x{b.bn}x{b.bk} w{b.num_warps} s{b.num_stages} {b.decode}"
    return f"{b.bm}x{b.bn}x{b.bk} w{b.num_warps} s{b.num_stages} {b.decode}{' lhs' if b.weights_lhs else ''}"


def same_bits(a, b) -> bool:
    return bool(np.array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16)))


def check_decode(key) -> None:
    """Pallas decode (PTX, arith, PTX emulation in interpret mode) vs XLA's decode, bit for bit, on
    every code byte and scale bytes 1..254."""
    n, k = 256, 1024
    kc, ks = jax.random.split(key)
    w = MXTensor(jax.random.bits(kc, (n, k // 2), jnp.uint8),
                 jax.random.randint(ks, (n, k // 32), 1, 255).astype(jnp.uint8), "mxfp4")
    ref = w.decode(jnp.bfloat16)
    ref_planar = jnp.stack([ref[:, 0::2], ref[:, 1::2]], axis=1)
    for decode, interpret in [("ptx", False), ("arith", False), ("ptx", True)]:
        out = decode_mxfp4_pallas(*kernel_weight_layout(w, n), blocks=MXBlocks(bn=32, bk=256, decode=decode),
                                  interpret=interpret or pallas_interpret())
        print(f"  decode {decode}{' emulated' if interpret else ''}: bit-exact vs XLA decode: "
              f"{same_bits(out, ref_planar)}", flush=True)


def guarded(what: str, fn) -> None:
    """Run one check; a failure is printed and the remaining checks still run."""
    try:
        fn()
    except Exception as e:
        print(f"  {what}: FAILED {type(e).__name__}: {str(e)[:600]}", flush=True)


def gemv(bn: int, bk: int, num_warps: int, decode: str = "ptx") -> MXBlocks:
    return MXBlocks(1, bn, bk, num_warps, 3, decode=decode, gemv=True)


def mosaic(bk: int, stages: int) -> MXBlocks:
    return MXBlocks(bk=bk, num_stages=stages, mosaic_gpu=True)


MOSAIC_GPU = tuple(int(p) for p in jax.__version__.split(".")[:2]) >= (0, 11)  # Mosaic GPU kernel runs


def mosaic_configs(m: int) -> list[MXBlocks]:
    """Mosaic GPU kernel configurations timed at dense M <= 64 rows (JAX >= 0.11 only)."""
    if not MOSAIC_GPU or m > 64:
        return []
    return [mosaic(bk, s) for bk, s in [(256, 2), (256, 3), (128, 3)]]


def mosaic_option_configs(m: int) -> list:
    """The Mosaic GPU kernel at 64x256 s2 with and without ``out_mn`` (``mosaic_gpu.MosaicBlocks``; the
    default takes it at M = 1 only), each timed in the same run; M <= 64, JAX >= 0.11 only."""
    if not MOSAIC_GPU or m > 64:
        return []
    from pallas_kernels.mx_matmul.mosaic_gpu import MosaicBlocks

    return [MosaicBlocks(256, 2), MosaicBlocks(256, 2, out_mn=True)]


def mosaic_option_label(b) -> str:
    return f"mosaic_gpu 64x{b.bk} s{b.stages} {'out_mn' if b.out_mn else 'plain'}"


def bench_mosaic_options(case: str, x, w: MXTensor, ref, flops: float, wbytes: float) -> None:
    """Each option configuration: rel err vs XLA decode-then-dot, then its time inside a jitted loop."""
    from pallas_kernels.mx_matmul.mosaic_gpu import mx_matmul_mosaic

    reps = 50
    for b in mosaic_option_configs(x.shape[0]):
        name = mosaic_option_label(b)
        fn = lambda x, codes, scales, b=b: mx_matmul_mosaic(x, codes, scales, blocks=b, out_dtype=x.dtype)
        try:
            err = rel_err(jax.jit(fn)(x, w.codes, w.scales), ref)
            t = timed(looped(fn, reps), x, w.codes, w.scales, max_iters=3) / reps
            record(case, "pallas mosaic_gpu option, in-jit loop", t, flops, wbytes, f"{name} (rel err {err:.1e})")
        except Exception as e:
            print(f"  {case} {name}: FAILED {type(e).__name__}: {str(e)[:600]}", flush=True)


def check_mosaic_large_scales(key) -> None:
    """The Mosaic GPU kernel on scale bytes 100..140: warps whose bytes stay <= 128 take the one-multiply
    decode, the others the two-multiply one."""
    kc, ks, kx = jax.random.split(key, 3)
    n, kk = 256, 512
    w = MXTensor(jax.random.bits(kc, (n, kk // 2), jnp.uint8),
                 jax.random.randint(ks, (n, kk // 32), 100, 141).astype(jnp.uint8), "mxfp4")
    x = jax.random.normal(kx, (16, kk), jnp.float32).astype(jnp.bfloat16)
    ref = mx_matmul_reference(x, w)
    for blocks in (mosaic(128, 3), mosaic(256, 2)):
        out = mx_matmul(x, w, blocks=blocks, out_dtype=jnp.float32)
        print(f"  {label(blocks)} scale bytes 100..140: rel err {rel_err(out, ref):.2e}", flush=True)


def check_correctness(key, focus: bool) -> None:
    """focus: only the default and one-row gemv paths (dense, W4A8, grouped)."""
    print("== correctness on device", flush=True)
    k = jax.random.split(key, 8)
    guarded("decode", lambda: check_decode(k[7]))
    if MOSAIC_GPU:
        guarded("mosaic large scales", lambda: check_mosaic_large_scales(k[6]))
    one_row, decode_then_dot = gemv(64, 256, 4), MXBlocks(bn=32, bk=256, decode_then_dot=True)
    mosaics = [mosaic(128, 3), mosaic(256, 2)] if MOSAIC_GPU else []
    paths = [None, one_row, *mosaics] if focus else [*mosaics, 
        None, MXBlocks(16, 64, 256, weights_lhs=False), MXBlocks(16, 64, 256, weights_lhs=True, decode="arith"),
        one_row, gemv(32, 512, 4, "arith"), decode_then_dot]
    w4a8_paths = ([None, one_row] if focus else [None, one_row, decode_then_dot]) + mosaics[:1]

    def dense(x, w, blocks, ref, what):
        out = mx_matmul(x, w, out_dtype=jnp.float32, blocks=blocks)
        name = "default " + label(default_blocks(x.shape[0])) if blocks is None else label(blocks)
        print(f"  {what} {name}: rel err {rel_err(out, ref):.2e}", flush=True)

    for m, n, kk in [(1, 96, 160), (7, 4160, 3584), (16, 200, 1056), (100, 352, 96)]:
        x = jax.random.normal(k[0], (m, kk), jnp.float32).astype(jnp.bfloat16)
        w = MXTensor.quantize(jax.random.normal(k[1], (n, kk)))
        ref = mx_matmul_reference(x, w)
        for blocks in paths:
            if blocks is not None and blocks.mosaic_gpu and m > 64:
                continue
            guarded(f"M={m} {blocks}", lambda: dense(x, w, blocks, ref, f"mx_matmul M={m} N={n} K={kk}"))
        xq = MXTensor.quantize(jax.random.normal(k[2], (m, kk)), "mxfp8")
        ref = mx_matmul_reference(xq, w)
        for blocks in w4a8_paths:
            if blocks is not None and blocks.mosaic_gpu and m > 64:
                continue
            guarded(f"W4A8 M={m} {blocks}", lambda: dense(xq, w, blocks, ref, f"W4A8 M={m} N={n} K={kk}"))
    g, n, kk, m = 9, 352, 224, 300
    w = MXTensor.quantize(jax.random.normal(k[3], (g, n, kk)))
    sizes = jnp.array([40, 0, 1, 77, 0, 0, 100, 17, 50], jnp.int32)  # sums to 285 < 300
    x = jax.random.normal(k[4], (m, kk), jnp.float32).astype(jnp.bfloat16)
    ref = grouped_mx_matmul_reference(x, w, sizes)

    def grouped(x, blocks, ref, what):
        out = grouped_mx_matmul(x, w, sizes, out_dtype=jnp.float32, blocks=blocks)
        print(f"  {what}: rel err {rel_err(out, ref):.2e}, tail max {float(jnp.max(jnp.abs(out[285:]))):.1e}",
              flush=True)

    grouped_paths = [None, gemv(64, 64, 4)] if focus else [
        MXBlocks(16, 64, 64, weights_lhs=True), MXBlocks(16, 64, 64), MXBlocks(64, 32, 32), gemv(64, 64, 4)]
    for blocks in grouped_paths:
        name = "default" if blocks is None else label(blocks)
        guarded(f"grouped {blocks}", lambda: grouped(x, blocks, ref, f"grouped {name}"))
    xq = MXTensor.quantize(jax.random.normal(k[5], (m, kk)), "mxfp8")
    ref = grouped_mx_matmul_reference(xq, w, sizes)
    for blocks in (None, gemv(64, 64, 4)):
        name = "default" if blocks is None else label(blocks)
        guarded(f"grouped W4A8 {blocks}", lambda: grouped(xq, blocks, ref, f"grouped W4A8 {name}"))


def best_kernel(case, fn_of_blocks, configs, args, flops, wbytes, loop: bool = False, impl: str = "pallas mx"):
    """Time fn_of_blocks(blocks) over configs; record the best as impl; optionally its in-jit loop
    time. Returns the best blocks, or None when configs is empty or none compiled."""
    best = None
    for blocks in configs:
        name = label(blocks)
        try:
            t = timed(jax.jit(fn_of_blocks(blocks)), *args)
        except Exception as e:  # a tile config that does not compile is skipped, not fatal
            print(f"  {case} {name}: FAILED {type(e).__name__}: {str(e)[:600]}", flush=True)
            continue
        print(f"    {case} {name}: {t * 1e6:.1f} us", flush=True)
        if best is None or t < best[0]:
            best = (t, blocks, name)
    if best is None:
        return None
    record(case, f"{impl} (best tiles)", best[0], flops, wbytes, best[2])
    if loop:
        reps = 50
        t = timed(looped(fn_of_blocks(best[1]), reps), *args, max_iters=3) / reps
        record(case, f"{impl}, in-jit loop", t, flops, wbytes, best[2])
    return best[1]


def gemv_configs(m: int) -> list[MXBlocks]:
    """One-row (gemv) configurations timed at dense M rows: six at M = 1, two more rows at M <= 16,
    none above (each row of x decodes every weight tile again)."""
    if m == 1:
        return [gemv(bn, bk, w) for bn, bk, w in
                [(32, 256, 4), (32, 512, 4), (64, 256, 4), (64, 512, 8), (128, 256, 8), (128, 512, 8)]]
    return [gemv(64, 256, 4), gemv(128, 256, 8)] if m <= 16 else []


def dense_configs(m: int) -> list[MXBlocks]:
    """Tile configurations of the dot kernels timed at M rows (default_blocks first)."""
    if m <= 16:
        return [default_blocks(m)] + [MXBlocks(16, bn, bk, w, 3, weights_lhs=True)
                                      for bn, bk, w in [(64, 256, 4), (128, 256, 4), (128, 512, 8)]] + [
            MXBlocks(16, 32, 512, 4, 3), MXBlocks(16, 64, 512, 4, 3, weights_lhs=True, decode="arith"),
            MXBlocks(16, 32, 512, 4, 3, decode="arith")]
    if m <= 1024:
        return [default_blocks(m), MXBlocks(64, 128, 128, 4, 3, weights_lhs=True),
                MXBlocks(bn=32, bk=512, decode_then_dot=True)]
    return [default_blocks(m), MXBlocks(bn=64, bk=256, decode_then_dot=True),
            MXBlocks(bn=64, bk=512, num_warps=8, decode_then_dot=True),
            MXBlocks(bn=32, bk=512, decode="arith", decode_then_dot=True),
            MXBlocks(128, 128, 64, 4, 4), MXBlocks(128, 256, 64, 8, 3)]


def bench_decode(w: MXTensor, quick: bool) -> None:
    """The decode kernel alone: MXFP4 bytes read + bf16 bytes written per second."""
    n, k = w.shape
    layout = kernel_weight_layout(w, n)
    moved = w.nbytes + 2 * n * k
    configs = [MXBlocks(bn=32, bk=512), MXBlocks(bn=64, bk=256), MXBlocks(bn=64, bk=512, num_warps=8)]
    for blocks in configs[:1] if quick else configs:
        try:
            t = timed(jax.jit(functools.partial(decode_mxfp4_pallas, blocks=blocks, interpret=False)), *layout)
        except Exception as e:
            print(f"  decode {label(blocks)}: FAILED {type(e).__name__}: {str(e)[:600]}", flush=True)
            continue
        print(f"  decode only {blocks.bn}x{blocks.bk} w{blocks.num_warps}: {t * 1e6:.1f} us, "
              f"{moved / t / 1e12:.2f} TB/s moved", flush=True)
        record("decode only [49152, 3584]", f"pallas decode {blocks.bn}x{blocks.bk} w{blocks.num_warps}", t, 0.0,
               w.nbytes, f"{moved / t / 1e12:.2f} TB/s read+written")
    t = timed(jax.jit(lambda w: w.decode(jnp.bfloat16)), w)
    record("decode only [49152, 3584]", "XLA decode", t, 0.0, w.nbytes, f"{moved / t / 1e12:.2f} TB/s read+written")


def bench_dense(key, quick: bool, focus: bool) -> None:
    """focus: M = 1, 16 only; default tiles, gemv variants and the XLA peers (no decode-only or W4A8
    rows; in-jit loop rows for the Mosaic GPU kernel and the bf16 dot only)."""
    print("== dense: x [M, 3584] @ MXFP4 [49152, 3584]^T", flush=True)
    n, k = 16 * 3072, 3584
    kw, kx = jax.random.split(key)
    w = random_mx(kw, (n, k))
    w_bf16 = w.decode(jnp.bfloat16)
    wbytes = w.nbytes
    if not focus:
        bench_decode(w, quick)
    decode_dot = jax.jit(lambda x, w: jnp.dot(x, w.decode(jnp.bfloat16).T, preferred_element_type=jnp.float32).astype(x.dtype))
    bf16_dot = jax.jit(lambda x, wb: jnp.dot(x, wb.T, preferred_element_type=jnp.float32).astype(x.dtype))
    for m in ([1, 16] if quick or focus else [1, 16, 512, 4096]):
        x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
        case, flops = f"dense M={m}", 2.0 * m * n * k
        configs = dense_configs(m)[:1 if focus else 2 if quick else None]
        gemvs = gemv_configs(m)[:1 if focus else 2 if quick else None]
        mosaics = mosaic_configs(m)[:2 if quick else None]
        ref = decode_dot(x, w)
        for blocks in dict.fromkeys(configs[:1] + configs[-1:] + gemvs[:1] + mosaics):
            guarded(f"{case} {label(blocks)}", lambda: print(
                f"  {case} {label(blocks)}: rel err vs XLA decode-then-dot "
                f"{rel_err(mx_matmul(x, w, blocks=blocks), ref):.2e}", flush=True))
        fn_of_blocks = lambda b: (lambda x, w: mx_matmul(x, w, blocks=b))
        best = best_kernel(case, fn_of_blocks, configs, (x, w), flops, wbytes, loop=m <= 16 and not focus)
        best_kernel(case, fn_of_blocks, gemvs, (x, w), flops, wbytes, loop=m <= 16 and not focus, impl="pallas gemv")
        best_kernel(case, fn_of_blocks, mosaics, (x, w), flops, wbytes, loop=m <= 16, impl="pallas mosaic_gpu")
        bench_mosaic_options(case, x, w, ref, flops, wbytes)
        record(case, "XLA decode-then-dot", timed(decode_dot, x, w), flops, wbytes)
        record(case, "XLA bf16 dot (bf16 weights)", timed(bf16_dot, x, w_bf16), flops, wbytes)
        if m <= 16:
            t = timed(looped(lambda x, wb: bf16_dot(x, wb), 50), x, w_bf16, max_iters=3) / 50
            record(case, "XLA bf16 dot, in-jit loop", t, flops, wbytes)
        if focus:
            continue
        xq = MXTensor.quantize(x, "mxfp8")
        try:
            record(case, "pallas W4A8 (MXFP8 x)", timed(jax.jit(lambda x, w: mx_matmul(x, w, blocks=best)), xq, w),
                   flops, wbytes, label(best) if best else "default")
        except Exception as e:
            print(f"  {case} W4A8 FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)


def routing(key, tokens: int, experts: int = 896, top_k: int = 16) -> jax.Array:
    """Random top-k routing of tokens -> group_sizes int32 [E] (rows = tokens * top_k)."""
    scores = jax.random.uniform(key, (tokens, experts))
    _, idx = jax.lax.top_k(scores, top_k)
    return jnp.bincount(idx.reshape(-1), length=experts).astype(jnp.int32)


def bench_grouped(key, quick: bool, focus: bool) -> None:
    """focus: 1 token only (default tiles, gemv variants, ragged_dot; no in-jit loop rows)."""
    e = 896
    shapes = [("gate+up", 2 * 3072, 3584), ("down", 3584, 3072)]
    batches = [1] if focus else [1, 64] if quick else [1, 64, 8192]
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
                configs = [default_blocks(m, grouped=True), MXBlocks(16, 128, 256, 4, 3, weights_lhs=True),
                           MXBlocks(16, 64, 256, 4, 3)]
            else:
                configs = [default_blocks(m, grouped=True), MXBlocks(128, 128, 128, 8, 3),
                           MXBlocks(64, 128, 64, 4, 4, weights_lhs=True)]
            gemvs = [gemv(64, 256, 4), gemv(32, 512, 4), gemv(128, 256, 8)] if tokens == 1 else []
            configs, gemvs = configs[:1 if focus else 2 if quick else None], gemvs[:1 if quick else None]
            fn_of_blocks = lambda b: (lambda x, w, gs: grouped_mx_matmul(x, w, gs, blocks=b))
            loop = tokens <= 64 and not focus
            best_kernel(case, fn_of_blocks, configs, (x, w, sizes), flops, wbytes, loop=loop)
            best_kernel(case, fn_of_blocks, gemvs, (x, w, sizes), flops, wbytes, loop=loop, impl="pallas gemv")
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


MOE_SHAPES = {"K3": ((896, 3072, 3584, 16), (1, 2, 4, 8, 16, 64)), "mini": ((64, 768, 1024, 8), (1, 8, 16, 64))}
# The split MoE is timed up to this many tokens: at K3 never (slower than the sorted dispatch from one token; its
# unrolled Triton programs took 6.4 minutes to compile there: benchmarks/HISTORY.md, 2026-12-03)
FUSED_MOE_MAX_TOKENS = {"K3": 0, "mini": 8}
TILED_MOE_BM = (8, 16)  # pair rows per tile of the tiled Mosaic GPU MoE at decode
# The two-kernel MoE at one token: (hidden units, contracted elements, warps) of the hidden kernel with the
# default down kernel, then (output rows, hidden units, warps) of the down kernel with the default hidden kernel
MOE_SPLIT_SWEEP = (
    [(dataclasses.replace(SPLIT_MOE_BLOCKS, bn=bn, bk=bk, num_warps=nw), SPLIT_MOE_DOWN_BLOCKS_ONE_TOKEN)
     for bn, bk, nw in [(8, 512, 4), (16, 512, 4), (16, 1024, 8), (32, 512, 8), (32, 1024, 8), (8, 1024, 8)]]
    + [(SPLIT_MOE_BLOCKS, dataclasses.replace(SPLIT_MOE_DOWN_BLOCKS_ONE_TOKEN, bn=bn, bk=bk, num_warps=nw))
       for bn, bk, nw in [(1, 256, 1), (2, 256, 2), (4, 256, 4), (8, 256, 4), (1, 128, 2), (2, 128, 2)]])
MOE_LOOP = 20  # calls per jitted loop: small kernels are timed without host dispatch


def bench_moe(key, quick: bool, sweep: bool, shapes: tuple[str, ...] = tuple(MOE_SHAPES),
              tokens_given: tuple[int, ...] = (), tiles: tuple[int, ...] = TILED_MOE_BM) -> None:
    """One MoE layer's routed experts at decode sizes (K3: 896 experts, 16 per token, latent 3584,
    hidden 3072; `mini`: 64, 8, 1024, 768; SiTU): the two-kernel MoE against the sorted dispatch through
    the grouped kernel (argsort, gather, three grouped calls, scatter), each repeated ``MOE_LOOP`` times
    inside one jitted loop. ``sweep``: at one token, the two-kernel form's tiles too (``MOE_SPLIT_SWEEP``).
    ``tokens_given``: these token counts
    instead of the shape's; ``tiles``: the tiled MoE's pair rows per tile (K3's prefill chunk, 2048 tokens, puts
    37 pairs on an expert: between the decode tiles and `mini`'s prefill density, unmeasured)."""
    for name in shapes:
        (e, f, r, top_k), token_counts = MOE_SHAPES[name]
        print(f"== MoE layer (routed, {name}): {e} experts, top {top_k}, {r} -> {f} -> {r}", flush=True)
        k1, k3, k2, kx, kr = jax.random.split(jax.random.fold_in(key, 7), 5)
        stacks = (random_mx(k1, (e, f, r)), random_mx(k3, (e, f, r)), random_mx(k2, (e, r, f)))
        matmul = lambda x, w, gs: grouped_mx_matmul(x, w, gs)
        split = lambda blocks, down: lambda x, wt, ex, *w: fused_moe_mx_split(x, *w, wt, ex, situ, blocks=blocks,
                                                                               down_blocks=down)
        tiled = lambda bm: lambda x, wt, ex, *w: tiled_moe_mx(x, *w, wt, ex, situ, bm=bm)
        base = {"pallas sorted dispatch": lambda x, wt, ex, *w: moe_sorted(x, *w, wt, ex, situ, matmul=matmul),
                "pallas two-kernel MoE (default)": split(SPLIT_MOE_BLOCKS, None)}
        if mosaic_gpu_runs():
            base |= {f"pallas tiled Mosaic GPU MoE bm {bm}": tiled(bm) for bm in tiles}
        swept = {f"pallas 2k MoE h {b.bn}x{b.bk} w{b.num_warps} d {d.bn}x{d.bk} w{d.num_warps}": split(b, d)
                  for b, d in MOE_SPLIT_SWEEP}
        for tokens in tokens_given or (token_counts[:2] if quick else token_counts):
            variants = {**base, **swept} if sweep and tokens == 1 else base  # the sweep: batch-1 decode only
            if tokens > FUSED_MOE_MAX_TOKENS[name]:
                variants = {impl: fn for impl, fn in variants.items() if "two-kernel" not in impl and "2k" not in impl}
            x = jax.random.normal(jax.random.fold_in(kx, tokens), (tokens, r), jnp.float32).astype(jnp.bfloat16)
            _, experts = jax.lax.top_k(jax.random.uniform(jax.random.fold_in(kr, tokens), (tokens, e)), top_k)
            weights = jnp.full((tokens, top_k), 1.0 / top_k, jnp.float32)
            active = len(np.unique(np.asarray(experts)))
            wbytes = active * sum(w.nbytes for w in stacks) / e
            flops = 2.0 * tokens * top_k * 3 * f * r
            case = f"MoE {name} tokens={tokens}"
            args = (x, weights, experts, *stacks)  # stacks as arguments, not constants of the jitted loops
            expected = jax.jit(variants["pallas sorted dispatch"])(*args)
            for impl, fn in variants.items():
                def one(impl=impl, fn=fn):
                    err = rel_err(jax.jit(fn)(*args), expected)
                    if err > 1e-2:
                        raise AssertionError(f"rel err {err:.2e} against the sorted dispatch")
                    seconds = timed(looped(fn, MOE_LOOP), *args) / MOE_LOOP
                    record(case, impl, seconds, flops, wbytes, f"{active} experts, err {err:.1e}")
                guarded(f"{case} {impl}", one)
        del stacks


def profile_calls() -> None:
    """Each decode-shape kernel compiled and run once, then once more for the profiler to read."""
    n, k = 16 * 3072, 3584
    kw, kx = jax.random.split(jax.random.key(0))
    w = random_mx(kw, (n, k))
    for m in (1, 16):
        x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
        for blocks in [default_blocks(16), gemv(32, 256, 4), *mosaic_configs(m)[:1]]:
            fn = jax.jit(lambda x, w, b=blocks: mx_matmul(x, w, blocks=b))
            jax.block_until_ready(fn(x, w))
            print(f"profile call M={m} {label(blocks)}", flush=True)
            jax.block_until_ready(fn(x, w))


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(t) for t in text.split(",") if t)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer shapes and tile configs")
    parser.add_argument("--skip", default="", help="comma list of sections to skip: check,dense,grouped,moe")
    parser.add_argument("--only", choices=["decode"], help="decode: batch-1 rows only (module docstring)")
    parser.add_argument("--profile", action="store_true", help="one call per decode kernel, for ncu")
    parser.add_argument("--moe-sweep", action="store_true", help="section moe: the fused MoEs' tiles too")
    parser.add_argument("--moe-shape", choices=sorted(MOE_SHAPES), action="append",
                        help="section moe: only this layer shape (repeatable; default all)")
    parser.add_argument("--moe-tokens", default="",
                        help="section moe: comma-separated token counts (default the shape's)")
    parser.add_argument("--moe-bm", default=",".join(map(str, TILED_MOE_BM)),
                        help="section moe: the tiled MoE's pair rows per tile, comma-separated")
    args = parser.parse_args()
    if args.profile:
        profile_calls()
        return
    skip = set(filter(None, args.skip.split(",")))
    focus = args.only == "decode"
    print(f"jax {jax.__version__}, devices {jax.devices()}", flush=True)
    key = jax.random.key(0)
    for name, fn in [("check", lambda: check_correctness(key, focus)),
                     ("dense", lambda: bench_dense(key, args.quick, focus)),
                     ("grouped", lambda: bench_grouped(key, args.quick, focus)),
                     ("moe", lambda: bench_moe(key, args.quick, args.moe_sweep, tuple(args.moe_shape or MOE_SHAPES),
                                               _ints(args.moe_tokens), _ints(args.moe_bm)))]:
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
