"""What one kernel of a decode step costs when it does almost nothing: a chain of dependent tiny kernels
in one jitted call, timed at two chain lengths, so the difference per extra kernel is the fixed cost
that each kernel on the critical path of `mini`'s batch-1 step pays (issue 4: in XLA's concurrent
command buffer, kernels beside that path cost nothing; benchmarks/RESULTS.md, eighteenth session).

    python3 benchmarks/launch_floor.py [--lengths 50,150] [--width 2048]   (a CPU runs it in interpret
                                                                           mode, for a check only)

Each link reads a float32 vector of ``width`` values (8 KB at 2048, an AttnRes mix's input row) and
writes x * 1.0001 + 1; the next link reads that. Forms:
- XLA: one elementwise fusion a link (an optimization barrier between links keeps XLA from fusing them);
- Pallas Triton, one program: the whole vector in one block;
- Pallas Triton, 128 programs: the vector split over 128 programs (the grid a small matvec launches).
Times are the best of 5 rounds, each the median of 20 calls of the jitted chain (XLA's command buffers on,
as in a decode step), the two chains in turn; us per link = (time at the longer chain - time at the
shorter) / the difference in links.
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from k3jax.implementation import pallas_interpret
from pallas_kernels._triton import triton_params


def _link_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 1.0001 + 1.0


def pallas_link(x, programs: int):
    block = x.shape[0] // programs
    interpret = pallas_interpret()
    return pl.pallas_call(
        _link_kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(programs,),
        in_specs=[pl.BlockSpec((block,), lambda i: (i,))],
        out_specs=pl.BlockSpec((block,), lambda i: (i,)),
        compiler_params=triton_params(num_warps=4, num_stages=1, interpret=interpret),
        interpret=interpret,
    )(x)


def xla_link(x):
    return jax.lax.optimization_barrier(x * 1.0001 + 1.0)


FORMS = {
    "XLA fusion": xla_link,
    "Pallas Triton, 1 program": functools.partial(pallas_link, programs=1),
    "Pallas Triton, 128 programs": functools.partial(pallas_link, programs=128),
}


def chain(link, length: int):
    def run(x):
        for _ in range(length):
            x = link(x)
        return x

    return jax.jit(run)


ROUNDS = 5  # the two chains timed in turn, each round a median of 20 calls; the best round each (one
# session's single medians put the same link at 1.1-2.3 us)


def median_seconds(fn, x, calls: int = 20) -> float:
    jax.block_until_ready(fn(x))
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        jax.block_until_ready(fn(x))
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="50,150", help="two chain lengths, shorter first")
    ap.add_argument("--width", type=int, default=2048, help="float32 values per link (a multiple of 128)")
    args = ap.parse_args()
    short, long = (int(n) for n in args.lengths.split(","))
    if not 0 < short < long or args.width % 128:
        raise SystemExit(f"--lengths must be two increasing positive counts and --width a multiple of 128, got "
                         f"{args.lengths!r} and {args.width}")
    x = jax.random.normal(jax.random.key(0), (args.width,), jnp.float32)
    expected = np.asarray(x, np.float64)
    for _ in range(short):
        expected = expected * 1.0001 + 1.0
    print(f"device {jax.devices()[0].device_kind}; chains of {short} and {long} links, {args.width * 4} bytes a link")
    rows = []
    for name, link in FORMS.items():
        fns = [chain(link, n) for n in (short, long)]
        out = np.asarray(fns[0](x), np.float64)
        err = float(np.linalg.norm(out - expected) / np.linalg.norm(expected))
        if err > 1e-5:
            raise SystemExit(f"{name}: the chain's output is {err:.1e} from the float64 chain")
        seconds = [min(ts) for ts in zip(*([median_seconds(fn, x) for fn in fns] for _ in range(ROUNDS)))]
        rows.append((name, *(s * 1e6 for s in seconds), (seconds[1] - seconds[0]) / (long - short) * 1e6))
    print(f"\nform | {short} links, us | {long} links, us | us per link")
    for name, a, b, per in rows:
        print(f"{name} | {a:.1f} | {b:.1f} | {per:.2f}")


if __name__ == "__main__":
    main()
