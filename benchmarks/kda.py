"""Chunked KDA on the H200: the Pallas kernels against flash-linear-attention's Triton ``chunk_kda``.

Run on the GPU machine (fla-core carried as a wheel, see benchmarks/RESULTS.md):
    python3 benchmarks/kda.py [--variants c32_v64,c64w8_v64] [--decode-variants v64w4] [--fla-recorded]
        [--budget-s 230]
First the decode step at B=64 as state traffic (read + write of the float32 state) in TB/s. Then
prefill at H=96, K=V=128, bf16 inputs for B1 T8192, B1 T32768, B8 T4096: per variant (``KDABlocks``)
the intra-chunk kernel alone, the state walk alone (on the intra kernel's outputs) and both together
(the fused-input path), against fla measured in the same run (or, with --fla-recorded, its last
recorded times); the first variant also through the public ``chunk_kda_fused``. Every variant is
checked against the float32 reference on the GPU just before it is first timed. Rows go to
$OUT/kda_table.md as they are measured; once --budget-s has passed no new measurement starts, and the
table is printed last.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse
import dataclasses
import functools
import statistics
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.functional import kda as ref
from pallas_kernels.kda import KDABlocks, chunk_kda, chunk_kda_fused, step_kda, step_kda_fused
from pallas_kernels.kda import reference as kda_reference
from pallas_kernels.kda.triton import intra_chunk, state_walk

H, K, V, LOWER = 96, 128, 128, -5.0
SHAPES = [(1, 8192), (1, 32768), (8, 4096)]
FLA_RECORDED_MS = {(1, 8192): 2.613, (1, 32768): 10.385, (8, 4096): 9.914}  # benchmarks/HISTORY.md, 2026-11-30
PREFILL_VARIANTS = {  # in order of priority: the first (the default) is timed through the public API too
    "c32_v64": KDABlocks(chunk=32, block_v=64),  # 2026-11-30: 2.54 ms at B1 T8192 (intra 1.73, walk 0.74)
    "c32w8_v64": KDABlocks(chunk=32, block_v=64, warps_intra=8),
    "c32_v32": KDABlocks(chunk=32, block_v=32),
    "c32_v128w8": KDABlocks(chunk=32, block_v=128, warps_walk=8),
    "c32w2_v64": KDABlocks(chunk=32, block_v=64, warps_intra=2),  # 2026-11-30: intra 5.05 ms, 2.9x slower
    "c64w8_v64": KDABlocks(chunk=64, block_v=64, warps_intra=8),  # 2026-11-30: intra 7.07 ms, walk no faster
    "c64w4_v64": KDABlocks(chunk=64, block_v=64),
}
DECODE_VARIANTS = {  # "auto": the public default (Mosaic GPU decode on JAX 0.11); the rest Triton (KDA runs 3, 4)
    "auto": KDABlocks(),
    "v32w4": KDABlocks(lowering="triton", decode_block_v=32),
    "v64w4": KDABlocks(lowering="triton", decode_block_v=64),
    "v128w4": KDABlocks(lowering="triton", decode_block_v=128),
    "v128w8": KDABlocks(lowering="triton", decode_block_v=128, warps_decode=8),
    "v64w8": KDABlocks(lowering="triton", decode_block_v=64, warps_decode=8),
    "v64w2": KDABlocks(lowering="triton", decode_block_v=64, warps_decode=2),
    "v32w2": KDABlocks(lowering="triton", decode_block_v=32, warps_decode=2),
    "v32w1": KDABlocks(lowering="triton", decode_block_v=32, warps_decode=1),
}


class OutOfTime(Exception):
    """The run's time budget is spent: no new measurement starts."""


@dataclasses.dataclass
class Report:
    """Log lines and table rows, written to $OUT as they come."""

    budget_s: float
    out_dir: str
    start: float = dataclasses.field(default_factory=time.perf_counter)
    prefill: list = dataclasses.field(default_factory=list)
    decode: list = dataclasses.field(default_factory=list)

    def log(self, msg):
        msg = f"[{time.perf_counter() - self.start:6.1f}s] {msg}"
        print(msg, flush=True)
        with open(os.path.join(self.out_dir, "kda_log.txt"), "a") as f:
            f.write(msg + "\n")

    def require_time(self):
        if time.perf_counter() - self.start > self.budget_s:
            raise OutOfTime

    def add_prefill(self, B, T, variant, part, ms, fla_ms):
        self.prefill.append((B, T, variant, part, ms, fla_ms))
        self.log(f"B{B} T{T} {variant} {part}: {ms:.3f} ms (fla {fla_ms:.3f})")
        self.write_table()

    def add_decode(self, name, ms, tbs):
        self.decode.append((name, ms, tbs))
        self.log(f"decode {name}: {ms:.4f} ms, {tbs:.2f} TB/s")
        self.write_table()

    def table(self):
        lines = ["| B | T | variant | part | ours ms | fla ms | ours/fla speed |",
                 "|---|---|---|---|---|---|---|"]
        for B, T, variant, part, ms, fla_ms in self.prefill:
            lines.append(f"| {B} | {T} | {variant} | {part} | {ms:.3f} | {fla_ms:.3f} | {fla_ms / ms:.2f}x |")
        lines += ["", "| decode B=64 | ms | state TB/s |", "|---|---|---|"]
        lines += [f"| {name} | {ms:.4f} | {tbs:.2f} |" for name, ms, tbs in self.decode]
        return "\n".join(lines)

    def write_table(self):
        with open(os.path.join(self.out_dir, "kda_table.md"), "w") as f:
            f.write(self.table() + "\n")


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


def fused_args(x):
    return (x["q"], x["k"], x["v"], x["z"], x["a_log"], x["dt_bias"], x["beta_logits"], LOWER)


def plain_inputs(x):
    q, k, g, beta = kda_reference.fused_inputs(x["q"], x["k"], x["z"], x["a_log"], x["dt_bias"],
                                               x["beta_logits"], LOWER)
    bf = jnp.bfloat16
    return q.astype(bf), k.astype(bf), x["v"], g, beta


def time_jax(fn, *args, iters=10, reps=5):
    """Median over reps of the mean time of iters back-to-back calls, in ms (after one warm-up call)."""
    jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) / iters * 1e3)
    return statistics.median(samples)


def check_gpu(blocks, report):
    """Kernel vs float32 reference on the GPU (B=2, T=300, H=4): plain with initial state, fused."""
    x = fused_inputs(jax.random.PRNGKey(1), 2, 300, heads=4)
    q, k, v, g, beta = plain_inputs(x)
    o, s = jax.jit(lambda *a: chunk_kda(*a, blocks=blocks))(q, k, v, g, beta, x["h0"])
    ro, rs = jax.jit(ref.chunk_kda)(q, k, v, g, beta, x["h0"])
    fo, fs = jax.jit(lambda *a: chunk_kda_fused(*a, blocks=blocks), static_argnums=7)(*fused_args(x))
    rfo, rfs = jax.jit(kda_reference.chunk_kda_fused, static_argnums=7)(*fused_args(x))
    errs = dict(o=rel_err(o, ro), state=rel_err(s, rs),
                fused_o=rel_err(fo, rfo), fused_state=rel_err(fs, rfs))
    report.log(f"check {blocks}: " + ", ".join(f"{n} {e:.2e}" for n, e in errs.items()))
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


def fla_ms(x, report):
    try:
        return time_fla(fla_runner(x))
    except Exception:  # noqa: BLE001 - report and carry on: the table must print
        report.log(f"fla failed:\n{traceback.format_exc()[-2000:]}")
        return float("nan")


def split_kernels(blocks, T, fused_gate):
    """jitted intra(raw inputs) and walk(intra outputs, h0) for one variant, as chunk_kda_fused runs
    them for T a whole number of chunks."""

    def intra(q, k, v, z, a_log, dt_bias, beta_logits):
        a_exp = jnp.broadcast_to(jnp.exp(a_log)[:, None], dt_bias.shape)
        return intra_chunk(q, k, v, z, beta_logits, (a_exp, dt_bias) if fused_gate else None, seq_len=T,
                           scale=K**-0.5, blocks=blocks, lower_bound=LOWER)

    walk = lambda inter, h0: state_walk(*inter, h0, blocks=blocks)
    return jax.jit(intra), jax.jit(walk)


def bench_variant(name, blocks, inputs, fla, report, is_default):
    """Intra alone, walk alone and both, at every shape; the default also through the public API."""
    report.require_time()
    if check_gpu(blocks, report) >= 5e-3:
        report.log(f"{name}: error too large, not timed")
        return
    for (B, T), x in inputs.items():
        report.require_time()
        args = fused_args(x)[:7]
        intra, walk = split_kernels(blocks, T, fused_gate=True)
        inter = jax.block_until_ready(intra(*args))
        h0 = jnp.zeros((B, H, K, V), jnp.float32)
        both = lambda: walk(intra(*args), h0)
        report.add_prefill(B, T, name, "intra+walk", time_jax(both), fla[B, T])
        report.add_prefill(B, T, name, "intra", time_jax(intra, *args), fla[B, T])
        report.add_prefill(B, T, name, "walk", time_jax(walk, inter, h0), fla[B, T])
        del inter
        if is_default:
            api = jax.jit(functools.partial(chunk_kda_fused, blocks=blocks), static_argnums=7)
            report.add_prefill(B, T, name, "chunk_kda_fused", time_jax(api, *fused_args(x)), fla[B, T])


def decode_inputs(B=64):
    x = fused_inputs(jax.random.PRNGKey(3), B, 1)
    q, k, v, g, beta = (a[:, 0] for a in plain_inputs(x))
    raw = tuple(x[n][:, 0] if n not in ("a_log", "dt_bias") else x[n]
                for n in ("q", "k", "v", "z", "a_log", "dt_bias", "beta_logits"))
    return x, (q, k, v, g, beta), raw, x["h0"]


def time_decode(fn, args, state):
    step = jax.jit(fn, donate_argnums=len(args))
    holder = [jnp.array(state)]

    def one():
        holder[0] = step(*args, holder[0])[1]
        return holder[0]

    return time_jax(one, iters=50)


def bench_decode(report, names, with_fla):
    """Plain (q, k, g, beta given) and fused (raw inputs, gates in the kernel, as fla's) decode steps."""
    x, args, raw, state = decode_inputs()
    state_bytes = 2 * state.size * 4
    expected = {"plain": jax.jit(ref.step_kda)(*args, state)}
    rq, rk, g, beta = kda_reference.fused_inputs(*raw[:2], raw[3], *raw[4:], LOWER)
    expected["fused"] = jax.jit(ref.step_kda)(rq, rk, raw[2], g, beta, state)
    for name in names:
        report.require_time()
        blocks = DECODE_VARIANTS[name]
        plain = functools.partial(step_kda, blocks=blocks)
        fused = lambda *a, blocks=blocks: step_kda_fused(*a[:7], a[7], LOWER, blocks=blocks)
        for kind, fn, fn_args in (("plain", plain, args), ("fused", fused, raw)):
            o, s = jax.jit(fn)(*fn_args, jnp.array(state))
            ro, rs = expected[kind]
            report.log(f"decode {name} {kind} check: o {rel_err(o, ro):.2e} state {rel_err(s, rs):.2e}")
            if max(rel_err(o, ro), rel_err(s, rs)) >= 1e-4:
                continue
            ms = time_decode(fn, fn_args, state)
            report.add_decode(f"pallas {kind} {name}", ms, state_bytes / ms / 1e9)
    ms = time_decode(ref.step_kda, args, state)
    report.add_decode("xla_ref", ms, state_bytes / ms / 1e9)
    ms = time_decode(lambda *a: (None, a[-1] * 1.0001), args, state)  # the memory ceiling, same bytes
    report.add_decode("device copy of the state (x * 1.0001, in place)", ms, state_bytes / ms / 1e9)
    if not with_fla:
        return
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
        report.add_decode("fla fused_recurrent", ms, state_bytes / ms / 1e9)
    except Exception as e:  # noqa: BLE001 - report and carry on: the table must print
        report.log(f"fla decode failed: {e!r}")


def bench_prefill(report, names, fla_recorded):
    inputs = {shape: fused_inputs(jax.random.PRNGKey(2), *shape) for shape in SHAPES}
    if fla_recorded:
        fla = FLA_RECORDED_MS
    else:
        fla = {shape: fla_ms(x, report) for shape, x in inputs.items()}
    report.log(f"fla ms ({'recorded' if fla_recorded else 'measured'}): {fla}")
    for name in names:
        try:
            bench_variant(name, PREFILL_VARIANTS[name], inputs, fla, report, is_default=name == names[0])
        except OutOfTime:
            raise
        except Exception:  # noqa: BLE001 - one variant failing must not lose the others
            report.log(f"{name} failed:\n{traceback.format_exc()[-3000:]}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--variants", default=",".join(PREFILL_VARIANTS), help="comma-separated names, or ''")
    parser.add_argument("--budget-s", type=float, default=230.0, help="no new measurement after this")
    parser.add_argument("--decode-variants", default=",".join(DECODE_VARIANTS), help="comma-separated, or ''")
    parser.add_argument("--fla-recorded", action="store_true",
                        help="use FLA_RECORDED_MS instead of timing fla (its autotuning takes ~2 minutes)")
    args = parser.parse_args()
    report = Report(args.budget_s, os.environ.get("OUT", "."))
    report.log(f"{jax.devices()[0].device_kind} jax {jax.__version__}")
    try:
        if args.decode_variants:
            bench_decode(report, args.decode_variants.split(","), with_fla=not args.fla_recorded)
        if args.variants:
            bench_prefill(report, args.variants.split(","), fla_recorded=args.fla_recorded)
    except OutOfTime:
        report.log("time budget spent: remaining measurements skipped")
    print("\n" + report.table(), flush=True)


if __name__ == "__main__":
    main()
