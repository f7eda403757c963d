"""A decode step's MLA attention over the latent cache: the absorbed XLA form against the one-pass kernel
(``pallas_kernels.mla_decode``, between the same absorbed query and output products), at `mini`'s and
K3's head counts, short and long caches, in one run.

    python3 benchmarks/mla_decode.py [--cases heads:batch:keys,...] [--splits auto,1]   (a CPU runs it in
                                                         interpret mode, small cases, for a check only)

Per case (bf16 cache of ``keys`` rows, every row visible; nope 128, rope 64, value 128, R 512): each form's
relative error against float32 absorbed attention from the same bf16 inputs, then its time per call in a
jitted chain (a call's query depends on the last call's output through one small reduction, the same in
both forms; us per call = the difference between chains of 30 and 10 calls over 20, best of 5 rounds of a
median of 10), and the cache's bytes over that time (each form reads the cache at least once). The kernel
runs at each of ``--splits`` (auto: ``default_splits``; 1: one program a sequence and head group, no merge).
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.functional.mla import absorbed_attention, absorbed_output, absorbed_query
from launch_floor import ROUNDS, median_seconds
from pallas_kernels.mla_decode import latent_attention

N, P, V, R = 128, 64, 128, 512
CASES = "16:1:192,16:1:8192,16:64:8192,96:1:131072,96:8:32768"
SHORT, LONG = 10, 30


def xla_form(q_nope, q_pe, c_kv, k_pe, kv_b, scale):
    visible = jnp.ones((c_kv.shape[0], 1, c_kv.shape[1]), bool)
    return absorbed_attention(q_nope, q_pe, c_kv, k_pe, kv_b, visible, scale)


def kernel_form(q_nope, q_pe, c_kv, k_pe, kv_b, scale, splits=None):
    q_lat = absorbed_query(q_nope, kv_b, c_kv.dtype)
    lengths = jnp.full((c_kv.shape[0],), c_kv.shape[1], jnp.int32)
    o_lat = latent_attention(q_lat[:, 0], q_pe[:, 0], c_kv, k_pe, lengths, scale, splits=splits)
    return absorbed_output(o_lat[:, None], kv_b, N, c_kv.dtype)


def chain(form, calls: int):
    def run(q_nope, q_pe, c_kv, k_pe, kv_b, scale):
        for _ in range(calls):
            o = form(q_nope, q_pe, c_kv, k_pe, kv_b, scale)
            q_nope = q_nope + (jnp.sum(o) * 1e-30).astype(q_nope.dtype)
        return o

    return jax.jit(run, static_argnames="scale")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default=CASES, help="heads:batch:keys, comma-separated")
    ap.add_argument("--splits", default="auto,1", help="the kernel's split counts, comma-separated (auto: the default)")
    args = ap.parse_args()
    scale, bf16 = (N + P) ** -0.5, jnp.bfloat16
    print(f"device {jax.devices()[0].device_kind}, JAX {jax.__version__}")
    rows = []
    for case in args.cases.split(","):
        H, B, S = (int(v) for v in case.split(":"))
        keys = jax.random.split(jax.random.key(S + H + B), 5)
        q_nope, q_pe = (jax.random.normal(k, (B, 1, H, d)).astype(bf16) for k, d in zip(keys[:2], (N, P)))
        c_kv, k_pe = (jax.random.normal(k, (B, S, d)).astype(bf16) for k, d in zip(keys[2:4], (R, P)))
        kv_b = (jax.random.normal(keys[4], (H * (N + V), R)) * R ** -0.5).astype(bf16)
        inputs = (q_nope, q_pe, c_kv, k_pe, kv_b)
        f32 = [a.astype(jnp.float32) for a in inputs]
        exact = np.asarray(jax.jit(xla_form, static_argnames="scale")(*f32, scale=scale), np.float64)
        megabytes = (c_kv.nbytes + k_pe.nbytes) / 1e6
        kernels = {f"kernel, splits {n}": functools.partial(kernel_form, splits=None if n == "auto" else int(n))
                   for n in args.splits.split(",")}
        for name, form in {"XLA absorbed": xla_form, **kernels}.items():
            out = np.asarray(jax.jit(form, static_argnames="scale")(*inputs, scale=scale), np.float64)
            err = float(np.linalg.norm(out - exact) / np.linalg.norm(exact))
            fns = [functools.partial(chain(form, n), scale=scale) for n in (SHORT, LONG)]
            times = [min(median_seconds(lambda x, f=f: f(*x), inputs, calls=10) for _ in range(ROUNDS)) for f in fns]
            per = (times[1] - times[0]) / (LONG - SHORT)
            rows.append((case, name, err, per * 1e6, megabytes / (per * 1e6)))
            print(f"{case} {name}: rel err {err:.1e}, {per * 1e6:.1f} us", flush=True)
    print("\nheads:batch:keys | form | rel err vs float32 | us per call | cache TB/s")
    for case, name, err, us, rate in rows:
        print(f"{case} | {name} | {err:.1e} | {us:.1f} | {rate:.2f}")


if __name__ == "__main__":
    main()
