"""A chain of dependent bf16 matrix-vector products, as a batch-1 decode step strings them: each link's
input is the link before's output, each link has its own weights (so they come from DRAM). Times the
chain per link for four forms in one process, with the copy bandwidth measured in the same run:

- XLA: ``x @ w.T`` on x [1, K];
- Triton matvec: ``pallas_kernels.matvec.matvecs`` (the decode step's projections today);
- Mosaic GPU: ``pallas_kernels.matvec_mosaic.matvec_rows8`` without and with programmatic dependent
  launch (weights' first tiles copied before the wait for the link before; issue 4's candidate route
  to fewer exposed kernel boundaries).

    python3 benchmarks/matvec_chain.py [--shapes 6400x2048,2048x2048] [--links 24] [--repeat 4] [--stages 4]
                                       (a CPU runs it in interpret mode, for a check only)

Per link: the time of a chain of R L links (L weight sets, R times over) less that of L links, over (R - 1) L,
so the call's fixed cost (about 100 us of dispatch and synchronization, which varies by tens of us)
drops out; L weight sets of 26 MB are more than L2 holds. Shapes are N x K of every link's weight (N >= K: the next link reads its first K values). The default
6400 x 2048 is about `mini`'s KDA input maps (26 MB), 2048 x 2048 its o_proj (8.4 MB). Before timing,
each form's chain output is checked against a float32 chain of the same bf16 roundings.
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.implementation import pallas_interpret
from pallas_kernels._mosaic_gpu import interpret_argument
from pallas_kernels.matvec import matvecs
from pallas_kernels.matvec_mosaic import X_ROWS, matvec_rows8


def xla_link(x, w):
    return (x[:, : w.shape[1]] @ w.T).astype(jnp.bfloat16)


def triton_link(x, w):
    return matvecs(x[:, : w.shape[1]], [w], [jnp.bfloat16])[0]


def mosaic_link(x, w, pdl: bool, stages: int):
    return matvec_rows8(x, w, stages=stages, pdl=pdl, interpret=interpret_argument(pallas_interpret()))


def chain(link, length: int):
    """jit of (x [rows, N], weights) -> row 0 of the output of ``length`` links, float32; link i takes
    weights[i % len(weights)]."""
    def run(x, weights):
        for i in range(length):
            x = link(x, weights[i % len(weights)])
        return x[0].astype(jnp.float32)

    return jax.jit(run)


def reference(x_row, weights) -> np.ndarray:
    """The chain in float32 with each link's output rounded to bf16, as the kernels round."""
    x = x_row.astype(jnp.float32)
    for w in weights:
        y = jnp.dot(x[: w.shape[1]], w.astype(jnp.float32).T, precision="highest")
        x = y.astype(jnp.bfloat16).astype(jnp.float32)
    return np.asarray(x)


def median_seconds(fn, *args, calls: int = 30) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def copy_bandwidth() -> float:
    x = jax.random.normal(jax.random.key(0), (1 << (29 if jax.default_backend() == "gpu" else 20),))
    copy = jax.jit(lambda x: x * 1.0001)
    return 2 * x.nbytes / median_seconds(copy, x)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="6400x2048,2048x2048", help="N x K of the links' weights, comma separated")
    ap.add_argument("--links", type=int, default=24, help="links of the shorter chain, each with its own weights")
    ap.add_argument("--repeat", type=int, default=4, help="the longer chain is the shorter one this many times")
    ap.add_argument("--stages", type=int, default=4, help="weight tiles in flight per Mosaic GPU program")
    args = ap.parse_args()
    gpu = jax.default_backend() == "gpu"
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    if not gpu:  # interpret mode: small shapes, a check only
        shapes, args.links, args.repeat = [(256, 256)], 1, 2
    forms = {
        "XLA dot": (xla_link, 1),
        "Triton matvec": (triton_link, 1),
        "Mosaic GPU": (functools.partial(mosaic_link, pdl=False, stages=args.stages), X_ROWS),
        "Mosaic GPU + PDL": (functools.partial(mosaic_link, pdl=True, stages=args.stages), X_ROWS),
    }
    bandwidth = copy_bandwidth()
    short, long = args.links, args.repeat * args.links
    print(f"device {jax.devices()[0].device_kind}, JAX {jax.__version__}; copy {bandwidth / 1e12:.2f} TB/s; chains "
          f"of {short} and {long} links (per link: the difference over {long - short} links)")
    rows = []
    for n, k in shapes:
        if n < k:
            raise SystemExit(f"--shapes: N >= K needed (the next link reads the first K outputs), got {n}x{k}")
        keys = jax.random.split(jax.random.key(n * k), short + 1)
        weights = [(jax.random.normal(key, (n, k), jnp.float32) * k**-0.5).astype(jnp.bfloat16) for key in keys[1:]]
        x_row = jax.random.normal(keys[0], (n,), jnp.float32).astype(jnp.bfloat16)
        expected = reference(x_row, weights)
        for name, (link, x_rows) in forms.items():
            fns = [chain(link, length) for length in (short, long)]
            x = jnp.zeros((x_rows, n), jnp.bfloat16).at[0].set(x_row)
            out = np.asarray(fns[0](x, weights))
            err = float(np.linalg.norm(out - expected) / np.linalg.norm(expected))
            if not err < 5e-2:  # bf16 roundings in another summation order stay far below this
                raise SystemExit(f"{name} at {n}x{k}: the chain's output is {err:.1e} from the float32 chain")
            seconds = (median_seconds(fns[1], x, weights) - median_seconds(fns[0], x, weights)) / (long - short)
            tbs = n * k * 2 / seconds / 1e12
            rows.append((f"{n}x{k}", name, err, seconds * 1e6, tbs, tbs * 1e12 / bandwidth))
    print("\nweights | form | rel err vs float32 chain | us per link | TB/s | of copy")
    for shape, name, err, us, tbs, frac in rows:
        print(f"{shape} | {name} | {err:.1e} | {us:.2f} | {tbs:.2f} | {frac:.2f}")


if __name__ == "__main__":
    main()
