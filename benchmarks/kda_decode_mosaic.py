"""KDA decode step on the H200: the Mosaic GPU kernel against the Triton kernel and an in-place copy.

Run on the GPU machine (repo root):
    python3 benchmarks/kda_decode_mosaic.py [--variants s3p2,v32s5p2,...] [--budget-s 120]
B=64, H=96, K=V=128: state read + write 805 MB, reported as TB/s of that traffic. Every kernel is
first checked on the GPU against the float32 reference step (plain and fused contracts; relative
error of o and of the state < 1e-4), then timed with the state donated (``benchmarks.kda.time_decode``:
median of 5 x mean of 50 steps): the Triton kernel (``kernel.decode_step``, default blocks), the
Mosaic GPU variants (``VARIANTS``, by default ``DEFAULT_VARIANTS``) and an in-place copy of the same
bytes (``x * 1.0001``). The Triton, first two Mosaic GPU and copy rows are timed again at the end
(run-to-run spread). Lines go to stdout and $OUT/decode_log.txt as they come; once --budget-s has
passed no new variant starts; the table is printed last.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse
import dataclasses
import functools
import time
import traceback

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from benchmarks.kda import LOWER, decode_inputs, rel_err, time_decode
from k3jax.functional import kda as ref
from pallas_kernels.kda import mosaic_gpu_decode
from pallas_kernels.kda import reference as kda_reference
from pallas_kernels.kda.kernel import KDABlocks, decode_step
from pallas_kernels.kda.ops import _gate_params

K = 128
TOL = 1e-4
_PARAMS = mosaic_gpu_decode.COMPILER_PARAMS
_SCRATCH_4K = dataclasses.replace(_PARAMS, reduction_scratch_bytes=4096)
# keyword arguments of mosaic_gpu_decode.decode_step. With several programs per SM, all of their
# shared memory (slots x (state block + vectors) + reduction scratch) must fit the SM's 228 KB.
VARIANTS = {
    "s3p2": dict(slots=3, programs_per_sm=2, compiler_params=_SCRATCH_4K),  # 64 columns, 2 programs/SM
    "v32s5p2": dict(block_v=32, slots=5, programs_per_sm=2, compiler_params=_SCRATCH_4K),
    "v32s3p3": dict(block_v=32, slots=3, programs_per_sm=3, compiler_params=_SCRATCH_4K),
    "v32s12": dict(block_v=32, slots=12, compiler_params=_SCRATCH_4K),
    "s6": dict(slots=6),  # 64 columns, one program per SM
    "s4": dict(slots=4),
    "s2p3": dict(slots=2, programs_per_sm=3, compiler_params=_SCRATCH_4K),
    "s6_no_auto_barriers": dict(slots=6, compiler_params=dataclasses.replace(_PARAMS,
                                                                             unsafe_no_auto_barriers=True)),
    "s6_warpgroup": dict(slots=6, compiler_params=dataclasses.replace(
        _PARAMS, lowering_semantics=plgpu.LoweringSemantics.Warpgroup)),
    "v128s3": dict(block_v=128, slots=3),
}
DEFAULT_VARIANTS = "s3p2,v32s5p2,v32s3p3,v32s12"


def log(msg, start=time.perf_counter()):
    msg = f"[{time.perf_counter() - start:6.1f}s] {msg}"
    print(msg, flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "decode_log.txt"), "a") as f:
        f.write(msg + "\n")


def plain_step(kernel):
    return lambda q, k, v, g, beta, state: kernel(q, k, v, g, beta, state, None, scale=K**-0.5)


def fused_step(kernel):
    """Raw inputs, as ``ops.step_kda_fused``: exp(A_log) and dt_bias rows by XLA, the rest in the kernel."""
    def step(q, k, v, z, a_log, dt_bias, beta_logits, state):
        return kernel(q, k, v, z, beta_logits, state, _gate_params(a_log, dt_bias, K), scale=K**-0.5,
                      lower_bound=LOWER)

    return step


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--variants", default=DEFAULT_VARIANTS, help="comma-separated names of VARIANTS")
    parser.add_argument("--budget-s", type=float, default=120.0, help="no new variant after this")
    args = parser.parse_args()
    start = time.perf_counter()
    log(f"{jax.devices()[0].device_kind} jax {jax.__version__}")
    _, plain_args, raw_args, state = decode_inputs()
    state_bytes = 2 * state.size * 4
    rq, rk, g, beta = kda_reference.fused_inputs(*raw_args[:2], raw_args[3], *raw_args[4:], LOWER)
    expected = {"plain": jax.jit(ref.step_kda)(*plain_args, state),
                "fused": jax.jit(ref.step_kda)(rq, rk, raw_args[2], g, beta, state)}
    inputs = {"plain": plain_args, "fused": raw_args}
    triton = functools.partial(decode_step, blocks=KDABlocks())
    rows = []

    def measure(name, kind, fn):
        """Check against the reference, then time; a row of the table, or a logged failure."""
        try:
            o, s = jax.jit(fn)(*inputs[kind], jnp.array(state))
            errs = rel_err(o, expected[kind][0]), rel_err(s, expected[kind][1])
            log(f"{name} {kind} check: o {errs[0]:.2e} state {errs[1]:.2e}")
            if not max(errs) < TOL:
                return
            ms = time_decode(fn, inputs[kind], state)
            rows.append((name, kind, ms, state_bytes / ms / 1e9))
            log(f"{name} {kind}: {ms:.4f} ms, {rows[-1][3]:.2f} TB/s")
        except Exception:  # noqa: BLE001 - one variant failing must not lose the others
            log(f"{name} {kind} failed:\n{traceback.format_exc()[-3000:]}")

    def copy():
        ms = time_decode(lambda *a: (None, a[-1] * 1.0001), plain_args, state)
        rows.append(("in-place copy (x * 1.0001)", "-", ms, state_bytes / ms / 1e9))
        log(f"copy: {ms:.4f} ms, {rows[-1][3]:.2f} TB/s")

    names = args.variants.split(",")
    default = mosaic_gpu_decode.decode_step
    for kind, wrap in (("plain", plain_step), ("fused", fused_step)):
        measure("triton", kind, wrap(triton))
        measure(f"mosaic {names[0]}", kind, wrap(functools.partial(default, **VARIANTS[names[0]])))
    copy()
    for name in names[1:]:
        if time.perf_counter() - start > args.budget_s:
            log(f"time budget spent: {name} and later variants skipped")
            break
        for kind, wrap in (("plain", plain_step), ("fused", fused_step)):
            measure(f"mosaic {name}", kind, wrap(functools.partial(default, **VARIANTS[name])))
    measure("triton (again)", "plain", plain_step(triton))
    for name in names[:2]:
        measure(f"mosaic {name} (again)", "plain", plain_step(functools.partial(default, **VARIANTS[name])))
    copy()
    lines = ["| decode B=64 H=96 K=V=128 | contract | ms | state TB/s |", "|---|---|---|---|"]
    lines += [f"| {name} | {kind} | {ms:.4f} | {tbs:.2f} |" for name, kind, ms, tbs in rows]
    print("\n" + "\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
