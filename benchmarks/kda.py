"""Chunked KDA on the H200: the Pallas kernels against flash-linear-attention's Triton ``chunk_kda``.

Run on the GPU machine (fla-core carried as a wheel, see benchmarks/RESULTS.md):
    python3 benchmarks/kda.py [--quick]
Checks the kernels against the float32 reference on the GPU first (and against fla), then times
prefill at H=96, K=V=128, bf16 inputs for B1 T8192, B1 T32768, B8 T4096, and the decode step at
B=64 as state traffic (read + write of the float32 state) in TB/s. Prints a table last.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse
import statistics
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.functional import kda as ref
from pallas_kernels.kda import KDABlocks, chunk_kda, chunk_kda_fused, step_kda
from pallas_kernels.kda import reference as kda_reference
from pallas_kernels.kda.kernel import intra_chunk

H, K, V, LOWER = 96, 128, 128, -5.0
SHAPES = [(1, 8192), (1, 32768), (8, 4096)]
FLA_PREVIOUS_MS = {(1, 8192): 2.61, (1, 32768): 10.4, (8, 4096): 9.9}
VARIANTS = {  # 64-token chunks measured 2.6x slower than 32 on 2026-11-30 (see benchmarks/RESULTS.md)
    "c32_v64": KDABlocks(chunk=32, block_v=64),
    "c16_v64": KDABlocks(chunk=16, block_v=64),
    "c32_v32": KDABlocks(chunk=32, block_v=32),
}


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def fused_inputs(key, B, T, heads=H):
    """Raw layer inputs, bf16 like the layer's activations; parameters float32."""
    ks = jax.random.split(key, 8)
    bf = jnp.bfloat16
    return dict(
        q=jax.random.normal(ks[0], (B, T, heads, K), bf), k=jax.random.normal(ks[1], (B, T, heads, K), bf),
        v=jax.random.normal(ks[2], (B, T, heads, V), bf), z=jax.random.normal(ks[3], (B, T, heads, K), bf),
        a_log=jax.random.uniform(ks[4], (heads,), minval=-1.0, maxval=1.0),
        dt_bias=0.5 * jax.random.normal(ks[5], (heads, K)),
        beta_logits=jax.random.normal(ks[6], (B, T, heads), bf),
        h0=jax.random.normal(ks[7], (B, heads, K, V)),
    )


def plain_inputs(x):
    q, k, g, beta = kda_reference.fused_inputs(x["q"], x["k"], x["z"], x["a_log"], x["dt_bias"],
                                               x["beta_logits"], LOWER)
    bf = jnp.bfloat16
    return q.astype(bf), k.astype(bf), x["v"], g, beta


def time_jax(fn, *args, iters=10, reps=5):
    jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) / iters * 1e3)
    return statistics.median(samples)


def check_gpu(blocks, log):
    """Kernel vs float32 reference on the GPU: plain (with state), fused, decode."""
    x = fused_inputs(jax.random.PRNGKey(1), 2, 300, heads=4)
    q, k, v, g, beta = plain_inputs(x)
    o, s = jax.jit(lambda *a: chunk_kda(*a, blocks=blocks))(q, k, v, g, beta, x["h0"])
    ro, rs = jax.jit(ref.chunk_kda)(q, k, v, g, beta, x["h0"])
    args = (x["q"], x["k"], x["v"], x["z"], x["a_log"], x["dt_bias"], x["beta_logits"], LOWER)
    fo, fs = jax.jit(lambda *a: chunk_kda_fused(*a, blocks=blocks), static_argnums=7)(*args)
    rfo, rfs = jax.jit(kda_reference.chunk_kda_fused, static_argnums=7)(*args)
    errs = dict(o=rel_err(o, ro), state=rel_err(s, rs), fused_o=rel_err(fo, rfo), fused_state=rel_err(fs, rfs))
    log(f"check {blocks}: {errs}")
    return max(errs.values())


def fla_runner(x):
    import torch
    from fla.ops.kda import chunk_kda as fla_chunk_kda

    t = lambda a: torch.from_dlpack(a).clone()
    tq, tk, tv, tz, tb = (t(x[n]) for n in ("q", "k", "v", "z", "beta_logits"))
    a_log, dt_bias = t(x["a_log"]), t(x["dt_bias"]).reshape(-1)

    def run():
        return fla_chunk_kda(tq, tk, tv, tz, tb, A_log=a_log, dt_bias=dt_bias, safe_gate=True,
                             lower_bound=LOWER, use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True,
                             use_beta_sigmoid_in_kernel=True, output_final_state=True)

    return run


def time_fla(run):
    import triton

    return triton.testing.do_bench(run, warmup=50, rep=300, return_mode="median")


def bench_decode(log, B=64):
    x = fused_inputs(jax.random.PRNGKey(3), B, 1)
    q, k, v, g, beta = (a[:, 0] for a in plain_inputs(x))
    state = x["h0"]
    state_bytes = 2 * state.size * 4
    ro, rs = jax.jit(ref.step_kda)(q, k, v, g, beta, state)
    o, s = jax.jit(step_kda)(q, k, v, g, beta, jnp.array(state))
    log(f"decode check: o {rel_err(o, ro):.2e} state {rel_err(s, rs):.2e}")
    rows = {}
    for name, fn in (("pallas", step_kda), ("xla_ref", ref.step_kda)):
        step = jax.jit(fn, donate_argnums=5)
        holder = [jnp.array(state)]

        def one():
            holder[0] = step(q, k, v, g, beta, holder[0])[1]
            return holder[0]

        ms = time_jax(lambda: one(), iters=50)
        rows[name] = (ms, state_bytes / ms / 1e9)
    try:
        import torch
        from fla.ops.kda import fused_recurrent_kda

        t = lambda a: torch.from_dlpack(a).clone()
        tq, tk, tv, tz, tb, h = (t(x[n]) for n in ("q", "k", "v", "z", "beta_logits", "h0"))
        a_log, dt_bias = t(x["a_log"]), t(x["dt_bias"]).reshape(-1)
        run = lambda: fused_recurrent_kda(tq, tk, tv, tz, tb, A_log=a_log, dt_bias=dt_bias,
                                          initial_state=h, output_final_state=True, lower_bound=LOWER,
                                          use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                          use_beta_sigmoid_in_kernel=True)
        ms = time_fla(run)
        rows["fla"] = (ms, state_bytes / ms / 1e9)
    except Exception as e:  # noqa: BLE001 - report and carry on: the table must print
        log(f"fla decode failed: {e!r}")
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="default blocks only")
    parser.add_argument("--log", default=os.path.join(os.environ.get("OUT", "."), "kda_log.txt"))
    args = parser.parse_args()
    logf = open(args.log, "w")

    def log(msg):
        print(msg, flush=True)
        logf.write(msg + "\n")
        logf.flush()

    log(f"{jax.devices()[0].device_kind} jax {jax.__version__}")
    variants = {"c32_v64": VARIANTS["c32_v64"]} if args.quick else VARIANTS
    good = {}
    for name, blocks in variants.items():
        try:
            err = check_gpu(blocks, log)
            if err < 5e-3:
                good[name] = blocks
            else:
                log(f"{name}: error {err:.2e} too large, not timed")
        except Exception:  # noqa: BLE001
            log(f"{name} failed:\n{traceback.format_exc()[-3000:]}")

    table = []
    for B, T in SHAPES:
        x = fused_inputs(jax.random.PRNGKey(2), B, T)
        fused_args = (x["q"], x["k"], x["v"], x["z"], x["a_log"], x["dt_bias"], x["beta_logits"], LOWER)
        fla_ms = float("nan")
        try:
            run = fla_runner(x)
            if (B, T) == SHAPES[0]:
                fo = run()[0].float().cpu().numpy()
                ro = kda_reference.chunk_kda_fused(*fused_args)[0]
                log(f"fla vs reference o: {rel_err(fo, ro):.2e}")
            fla_ms = time_fla(run)
        except Exception:  # noqa: BLE001
            log(f"fla failed:\n{traceback.format_exc()[-2000:]}")
        plain = plain_inputs(x)
        for name, blocks in good.items():
            fused = jax.jit(lambda *a, b=blocks: chunk_kda_fused(*a, blocks=b), static_argnums=7)
            ms = time_jax(fused, *fused_args)
            table.append((B, T, f"fused {name}", ms, fla_ms))
            log(f"B{B} T{T} fused {name}: {ms:.3f} ms (fla {fla_ms:.3f})")
        if good:
            name, blocks = next(iter(good.items()))
            plain_fn = jax.jit(lambda *a, b=blocks: chunk_kda(*a, blocks=b))
            table.append((B, T, f"plain {name}", time_jax(plain_fn, *plain), fla_ms))
            intra = jax.jit(lambda q, k, v, g, beta, b=blocks: intra_chunk(
                q, k, v, g, beta, None, seq_len=T, scale=K**-0.5, blocks=b))
            table.append((B, T, f"  intra only {name}", time_jax(intra, *plain), fla_ms))
        del x, plain

    decode = bench_decode(log)
    log("\n| B | T | variant | ours ms | fla ms | fla prev ms | Mtok/s ours | ours/fla speed |")
    log("|---|---|---|---|---|---|---|---|")
    for B, T, name, ms, fla_ms in table:
        log(f"| {B} | {T} | {name} | {ms:.3f} | {fla_ms:.3f} | {FLA_PREVIOUS_MS[(B, T)]} | "
            f"{B * T / ms / 1e3:.2f} | {fla_ms / ms:.2f}x |")
    log("\n| decode B=64 | ms | state TB/s |")
    log("|---|---|---|")
    for name, (ms, tbs) in decode.items():
        log(f"| {name} | {ms:.4f} | {tbs:.2f} |")


if __name__ == "__main__":
    main()
