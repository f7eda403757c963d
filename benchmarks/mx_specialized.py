"""The warp-specialized MXFP4 kernel (``pallas_kernels/mx_matmul/mosaic_gpu_ws.py``) against the Mosaic GPU
kernel the dense default runs (``mosaic_gpu.py``) and a bf16 dot, at the dense decode shape, in one run.

    python3 benchmarks/mx_specialized.py [--configs 3:6:256,2:6:256] [--rounds 3] [--m 1,16]

A config is consumers:stages:bk[:registers[:x_resident]] (registers 0: no ``setmaxnreg``; x_resident 1: x
loaded into shared memory once per program). First every config is checked on this GPU against the float32 reference
(awkward M, N and K; scale bytes 100..140, which take the decode's two-multiply branch) and, at the decode
shape, against XLA's decode-then-dot. Then x [M, 3584] @ MXFP4 [49152, 3584]^T (88 MB of codes, 5.5 MB of
scales) is timed for each kernel as 50 calls in one jitted loop (``mx_matmul.looped``), the kernels in
turn for ``--rounds`` rounds; each row is the best round. Weight bandwidth = MXFP4 bytes / time. The table
is printed last.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from k3jax.mx import MXTensor  # noqa: E402
from mx_matmul import looped, random_mx, rel_err, timed  # noqa: E402
from pallas_kernels.mx_matmul import mx_matmul_reference  # noqa: E402
from pallas_kernels.mx_matmul.mosaic_gpu import MosaicBlocks, mx_matmul_mosaic  # noqa: E402
from pallas_kernels.mx_matmul.mosaic_gpu_ws import SpecializedBlocks, mx_matmul_specialized  # noqa: E402

N, K = 16 * 3072, 3584
REPS = 50


def parse_configs(text: str) -> list[tuple[int, ...]]:
    return [tuple(int(v) for v in c.split(":")) for c in text.split(",") if c]


def kernels(m: int, configs) -> dict:
    """name -> fn(x, codes, scales): the committed kernel and each config (out_mn at M = 1, as the default)."""
    out_mn = m == 1
    fns = {"mosaic_gpu 64x256 s2 (default)": functools.partial(
        mx_matmul_mosaic, blocks=MosaicBlocks(256, 2, out_mn=out_mn))}
    for consumers, stages, bk, *flags in configs:
        registers, x_resident = (flags + [1, 0][len(flags):])[:2]
        blocks = SpecializedBlocks(consumers=consumers, stages=stages, bk=bk, out_mn=out_mn,
                                   set_registers=bool(registers), x_resident=bool(x_resident))
        name = (f"specialized C{consumers} s{stages} bk{bk}{'' if blocks.set_registers else ' no setmaxnreg'}"
                f"{' x resident' if blocks.x_resident else ''}")
        fns[name] = functools.partial(mx_matmul_specialized, blocks=blocks)
    return fns


def check(configs) -> None:
    print("== checks on this GPU against the float32 reference", flush=True)
    cases = [(1, 1000, 1056, (110, 135)), (7, 4160, 3488, (110, 135)), (16, 700, 512, (100, 141))]
    for i, (m, n, k, (lo, hi)) in enumerate(cases):
        kc, ks, kx = jax.random.split(jax.random.key(10 + i), 3)
        scales = jax.random.randint(ks, (n, k // 32), lo, hi).astype(jnp.uint8)
        w = MXTensor(jax.random.bits(kc, (n, k // 2), jnp.uint8), scales, "mxfp4")
        x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
        ref = mx_matmul_reference(x, w)
        for name, fn in kernels(m, configs).items():
            try:
                out = jax.jit(fn)(x, w.codes, w.scales)
                print(f"  M={m} N={n} K={k} scale bytes {lo}..{hi - 1}: {name}: "
                      f"rel err {rel_err(out, ref):.2e}", flush=True)
            except Exception as e:  # a config that does not fit is reported and skipped
                print(f"  {name}: FAILED {type(e).__name__}: {str(e)[:400]}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default="3:6:256,3:4:256,2:6:256,2:8:256,3:8:128,4:4:256")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--m", default="1,16")
    args = parser.parse_args()
    configs = parse_configs(args.configs)
    print(f"device: {jax.devices()[0].device_kind}, JAX {jax.__version__}", flush=True)
    check(configs)
    w = random_mx(jax.random.key(0), (N, K))
    w_bf16 = w.decode(jnp.bfloat16)
    table = []
    for m in (int(v) for v in args.m.split(",")):
        x = jax.random.normal(jax.random.key(1), (m, K), jnp.float32).astype(jnp.bfloat16)
        ref = jnp.dot(x, w_bf16.T, preferred_element_type=jnp.float32)
        runs = {}
        for name, fn in kernels(m, configs).items():
            try:
                err = rel_err(jax.jit(fn)(x, w.codes, w.scales), ref)
                runs[name] = (looped(fn, REPS), (x, w.codes, w.scales), f"rel err {err:.1e} vs decode-then-dot")
            except Exception as e:
                print(f"  M={m} {name}: FAILED {type(e).__name__}: {str(e)[:400]}", flush=True)
        runs["XLA bf16 dot"] = (looped(lambda x, wb: jnp.dot(x, wb.T, preferred_element_type=jnp.float32), REPS),
                                (x, w_bf16), "bf16 weights")
        best = {name: float("inf") for name in runs}
        for r in range(args.rounds):
            for name, (fn, fn_args, _) in runs.items():
                t = timed(fn, *fn_args, max_iters=3) / REPS
                best[name] = min(best[name], t)
                print(f"  round {r} M={m} {name}: {t * 1e6:.1f} us", flush=True)
        for name, (_, _, note) in runs.items():
            table.append((m, name, best[name], best["XLA bf16 dot"] / best[name], note))
    print("\n| M | kernel | us | weight TB/s | x the bf16 dot | note |\n|---|---|---|---|---|---|")
    for m, name, t, ratio, note in table:
        print(f"| {m} | {name} | {t * 1e6:.1f} | {w.nbytes / t / 1e12:.2f} | {ratio:.2f} | {note} |")


if __name__ == "__main__":
    main()
