"""Issue 4 (p): KDA's batch-1 decode with z = f_b_proj(f_a) inside the Triton decode kernel, and the gated
output norm as its epilogue, at mini's shapes (H 16, K = V = R = 128, bf16 inputs, eps 1e-5) on the GPU.

(a) every variant against the XLA composition (einsum z, current kernel, gated_rms_norm, cast) and the
    float32 reference, B 1 and 8;
(c) the whole batch-1 step A/B: benchmarks/decode_variants.py mini default "f_b and norm by XLA" "norm by XLA"
    (a subprocess, preallocating as usual);
(b) per variant one jit of N chained steps (each step's normed o is the next step's v, so the norm is
    materialized as in the layer; each step its own f_a argument, so no einsum is shared), time per step;
tables last. Budgeted: no new timing starts after P_BUDGET_S seconds.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import time

os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"  # leave the GPU's memory to (c)'s subprocess

import jax
import jax.numpy as jnp

from benchmarks.kda import time_jax
from k3jax.functional import kda as ref
from k3jax.functional.norms import gated_rms_norm
from pallas_kernels.kda import KDABlocks, reference, step_kda_fused
from pallas_kernels.kda.ops import GatedNorm

H, K, R, EPS, LB = 16, 128, 128, 1e-5, -5.0
N = int(os.environ.get("P_STEPS", 16))  # fewer for a CPU dry run
BUDGET_S = float(os.environ.get("P_BUDGET_S", 200))
AB = [os.environ.get("P_AB_PRESET", "mini"), "default", "f_b and norm by XLA", "norm by XLA"]
BF = jnp.bfloat16
T0 = time.perf_counter()


def rel_err(a, b):
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def inputs(B, seed):
    ks = jax.random.split(jax.random.key(seed), 12)
    q, k, v = (jax.random.normal(ks[i], (B, H, K), BF) for i in range(3))
    f_a = [jax.random.normal(kk, (B, R), BF) for kk in jax.random.split(ks[3], N)]
    f_b = (R**-0.5 * jax.random.normal(ks[4], (H * K, R))).astype(BF)
    a_log = jax.random.uniform(ks[5], (H,), minval=-1.0, maxval=1.0).astype(BF)
    dt_bias = jax.random.normal(ks[6], (H, K)).astype(BF)
    beta = jax.random.normal(ks[7], (B, H), BF)
    gate = jax.random.normal(ks[8], (B, H, K), BF)
    w = (1.0 + 0.1 * jax.random.normal(ks[9], (K,))).astype(BF)
    state = 0.1 * jax.random.normal(ks[10], (B, H, K, K))
    return dict(q=q, k=k, v=v, f_a=f_a, f_b=f_b, a_log=a_log, dt_bias=dt_bias, beta=beta, gate=gate, w=w, state=state)


def step(variant, x, f_a, v, state):
    """One decode step of a variant -> (normed o bf16 [B, H, V], state)."""
    kind, bv, warps = variant
    blocks = KDABlocks(decode_block_v=bv, warps_decode=warps)
    args = (x["a_log"], x["dt_bias"], x["beta"], state, LB)
    if kind == "xla":
        z = jnp.einsum("bi,oi->bo", f_a, x["f_b"], precision=jax.lax.Precision.HIGHEST).reshape(x["q"].shape)
        o, state = step_kda_fused(x["q"], x["k"], v, z, *args, blocks=blocks)
    else:
        norm = GatedNorm(x["gate"], x["w"], EPS, BF) if kind == "z+norm" else None
        o, state = step_kda_fused(x["q"], x["k"], v, (f_a, x["f_b"]), *args, norm=norm, blocks=blocks)
        if norm is not None:
            return o, state
    return gated_rms_norm(o, x["gate"], x["w"], EPS).astype(BF), state


def chain(variant, x):
    v, state = x["v"], x["state"]
    for f_a in x["f_a"]:
        v, state = step(variant, x, f_a, v, state)
    return v, state


def reference_step(x):
    q, k, g, beta = reference.fused_inputs(
        x["q"], x["k"], jnp.einsum("bi,oi->bo", x["f_a"][0].astype(jnp.float32), x["f_b"].astype(jnp.float32),
                                   precision="highest").reshape(x["q"].shape),
        x["a_log"], x["dt_bias"], x["beta"], LB)
    o, state = ref.step_kda(q, k, x["v"], g, beta, x["state"])
    return gated_rms_norm(o, x["gate"], x["w"], EPS), state


VARIANTS = {
    "XLA z + kernel bv64 w4 + XLA norm (before)": ("xla", 64, 4),
    "z in kernel bv64 w4 + XLA norm": ("z", 64, 4),
    "z in kernel bv64 w8 + XLA norm": ("z", 64, 8),
    "z + norm in kernel bv128 w4": ("z+norm", 128, 4),
    "z + norm in kernel bv128 w8": ("z+norm", 128, 8),
    "z + norm in kernel bv128 w16": ("z+norm", 128, 16),
}


def check(B):
    x = inputs(B, seed=B)
    ref_o, ref_s = reference_step(x)
    base_o = base_s = None
    for name, var in VARIANTS.items():
        try:
            o, s = jax.jit(functools.partial(step, var))(x, x["f_a"][0], x["v"], x["state"])
        except Exception as e:  # a variant that does not compile is reported, the others go on
            print(f"B={B} check {name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
            continue
        if base_o is None:
            base_o, base_s = o, s
        print(f"B={B} check {name}: o vs XLA {rel_err(o, base_o):.2e} state {rel_err(s, base_s):.2e}; "
              f"vs f32 reference o {rel_err(o, ref_o):.2e} state {rel_err(s, ref_s):.2e}; "
              f"dtype {o.dtype} finite {bool(jnp.isfinite(o.astype(jnp.float32)).all())}", flush=True)


def whole_step():
    env = {k: v for k, v in os.environ.items() if k != "XLA_PYTHON_CLIENT_PREALLOCATE"}
    print("$ python3 benchmarks/decode_variants.py " + " ".join(repr(a) for a in AB), flush=True)
    run = subprocess.run([sys.executable, "benchmarks/decode_variants.py", *AB], env=env, capture_output=True,
                         text=True)
    print(run.stdout + run.stderr[-3000:], flush=True)
    return run.stdout[run.stdout.find(", B=1 decode"):] if ", B=1 decode" in run.stdout else "(decode_variants failed)"


def timings():
    rows = []
    for B in (1, 8):
        x = inputs(B, seed=B)
        for name, var in VARIANTS.items():
            if time.perf_counter() - T0 > BUDGET_S:
                print(f"budget: skipped B={B} {name}", flush=True)
                continue
            try:
                fn = jax.jit(functools.partial(chain, var))
                us = [time_jax(fn, x, iters=20, reps=5) * 1e3 / N for _ in range(2)]
            except Exception as e:
                print(f"B={B} {name}: FAILED {type(e).__name__}", flush=True)
                continue
            rows.append((B, name, us))
            print(f"B={B} {name}: {us[0]:.2f} / {us[1]:.2f} us per step", flush=True)
    return rows


def main():
    print(jax.devices()[0].device_kind, jax.__version__, flush=True)
    for B in (1, 8):
        check(B)
    ab = whole_step()
    rows = timings()
    print(f"\nKDA decode step + f_b + gated norm, H{H} K{K}, {N} chained steps per jit, us per step "
          "(two timings: median of 5 x 20 calls each)")
    print("| B | variant | us per step |\n|---|---|---|")
    for B, name, us in rows:
        print(f"| {B} | {name} | {us[0]:.2f} / {us[1]:.2f} |")
    print("\n" + ab)


if __name__ == "__main__":
    main()
