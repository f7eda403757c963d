"""How fast one bf16 matvec kernel streams its weight from DRAM, by weight size: what a decode step's
projections (4-26 MB at `mini`) can reach against the output head (671 MB), which reads at about 4.5 TB/s.

For weights [N, 2048] of 4 to 671 MB, each form runs in a jitted fori_loop over enough distinct weight
sets that the weights come from DRAM (at least 400 MB a pass; the H200's L2 holds 50 MB), each call's x
made from the call before's output (a dependent chain, as in a decode step). Forms: XLA's einsum (the
output head's form: a reduce fusion) and ``pallas_kernels.matvec.matvecs`` (the step's projections, its
default tiles). Prints us per call and TB/s of weight bytes, then a fit per form of the time as a fixed
part plus bytes over a rate (least squares over the sizes).

    python3 benchmarks/stream_sizes.py
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.matvec import matvecs

D, BF, F32 = 2048, jnp.bfloat16, jnp.float32
ROWS = (1024, 2048, 4096, 6400, 12288, 24576, 49152, 163840)  # 4.2 MB to 671 MB of bf16
PASS_BYTES, MIN_CALLS = 400e6, 16
FORMS = {
    "xla einsum": lambda x, w: jnp.einsum("md,nd->mn", x, w, precision=jax.lax.Precision.HIGHEST,
                                          preferred_element_type=F32),
    "matvecs": lambda x, w: matvecs(x, [w], [F32])[0],
}


def chained(form, passes: int):
    """`passes` passes of form over the weight sets in turn, each call's x from the last output."""
    @jax.jit
    def loop(x, weights):
        def body(_, x):
            for w in weights:
                x = (x.astype(F32) + 1e-9 * form(x, w)[:, :1]).astype(BF)
            return x
        return jax.lax.fori_loop(0, passes, body, x)
    return loop


def main() -> None:
    print(jax.devices()[0].device_kind, jax.__version__, flush=True)
    x = jax.random.normal(jax.random.key(0), (1, D), F32).astype(BF)
    rows = []
    for n in ROWS:
        nbytes = n * D * 2
        sets = max(2, int(np.ceil(PASS_BYTES / nbytes)))
        passes = max(1, MIN_CALLS // sets)
        calls = passes * sets
        weights = tuple((0.02 * jax.random.normal(jax.random.key(s), (n, D), F32)).astype(BF) for s in range(sets))
        for name, form in FORMS.items():
            loop = chained(form, passes)
            jax.block_until_ready(loop(x, weights))
            times = []
            for _ in range(7):
                t0 = time.perf_counter()
                jax.block_until_ready(loop(x, weights))
                times.append(time.perf_counter() - t0)
            us = statistics.median(times) / calls * 1e6
            rows.append((name, nbytes, us))
            print(f"{name:12} {nbytes / 1e6:7.1f} MB {us:8.2f} us {nbytes / us / 1e6:5.2f} TB/s", flush=True)
        del weights
    print(f"\n{'form':12} | {'MB':>7} | {'us/call':>8} | {'TB/s':>5}")
    for name, nbytes, us in rows:
        print(f"{name:12} | {nbytes / 1e6:7.1f} | {us:8.2f} | {nbytes / us / 1e6:5.2f}")
    for name in FORMS:
        b = np.array([r[1] for r in rows if r[0] == name])
        t = np.array([r[2] for r in rows if r[0] == name])
        slope, fixed = np.polyfit(b, t, 1)
        print(f"fit {name}: {fixed:.2f} us + bytes / {1e-6 / slope:.2f} TB/s")


if __name__ == "__main__":
    main()
