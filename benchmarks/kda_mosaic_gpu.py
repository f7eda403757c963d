"""The Mosaic GPU KDA forward (pallas_kernels/kda/mosaic_gpu.py) against the Triton path on the H200.

    python3 benchmarks/kda_mosaic_gpu.py [--budget-s 200] [--intra triton,mosaic]

First a check of each forward against the float32 reference (B=2, T=300, H=4, K=V=128; plain inputs
with an initial state, and fused inputs). Then, at H=96, K=V=128, bf16 inputs, for B1 T8192, B1 T32768,
B8 T4096: the public ``chunk_kda_fused`` (default blocks: on JAX 0.11 the Triton intra kernel and the
Mosaic GPU walk), the Mosaic GPU forward with each intra kernel asked for, from the same fused inputs,
and either the two intra kernels alone ("mosaic" asked for) or the two state walks alone on the same
intra-kernel outputs (Triton ``kernel.state_walk`` at chunk 32, 64 state columns per program; Mosaic
GPU ``state_walk``, 64 too). Times by ``benchmarks.kda.time_jax``. Once --budget-s has passed no new
shape starts; the table is printed last. A forward whose check error is 5e-3 or more is timed all the
same and named before the table.

--intra lists the Mosaic GPU forward's intra kernels: "triton" (default, ``mosaic_gpu.forward``:
``kernel.intra_chunk``) and / or "mosaic" (``mosaic_gpu_intra.intra_chunk``, a whole Mosaic GPU
forward). With "mosaic" the check also compares the six intra outputs with the Triton intra kernel's
(fused inputs, B=2, T=320, H=4; ``intra_*`` errors).
"""

from __future__ import annotations

import argparse
import functools
import time
import traceback

import jax
import jax.numpy as jnp

from benchmarks.kda import H, K, LOWER, SHAPES, V, fused_args, fused_inputs, plain_inputs, rel_err, time_jax
from k3jax.functional import kda as ref
from pallas_kernels.kda import KDABlocks, chunk_kda_fused, mosaic_gpu, mosaic_gpu_intra
from pallas_kernels.kda import reference as kda_reference
from pallas_kernels.kda.kernel import intra_chunk, state_walk


def _pad(arrays, chunk):
    pad = -arrays[0].shape[1] % chunk
    return [jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2)) for a in arrays]


def all_mosaic_forward(q, k, v, g, beta, gate_params, h0, *, seq_len, scale, lower_bound, interpret):
    """``mosaic_gpu.forward``'s contract with both kernels in Mosaic GPU."""
    inter = mosaic_gpu_intra.intra_chunk(q, k, v, g, beta, gate_params, seq_len=seq_len, scale=scale,
                                         lower_bound=lower_bound, interpret=interpret)
    return mosaic_gpu.state_walk(*inter, h0, interpret=interpret)


FORWARDS = {"triton": mosaic_gpu.forward, "mosaic": all_mosaic_forward}


def _gate_params(a_log, dt_bias):
    return jnp.broadcast_to(jnp.exp(a_log)[:, None], dt_bias.shape), dt_bias


@functools.partial(jax.jit, static_argnums=7, static_argnames="intra")
def mosaic_fused(q, k, v, z, a_log, dt_bias, beta_logits, lower_bound, h0, *, intra="triton"):
    """``chunk_kda_fused``'s contract through the Mosaic GPU forward (``intra``: its intra kernel)."""
    T = q.shape[1]
    o, s = FORWARDS[intra](*_pad([q, k, v, z, beta_logits], mosaic_gpu.CHUNK), _gate_params(a_log, dt_bias),
                           h0, seq_len=T, scale=K**-0.5, lower_bound=lower_bound, interpret=False)
    return o[:, :T], s


@functools.partial(jax.jit, static_argnames="intra")
def mosaic_plain(q, k, v, g, beta, h0, *, intra="triton"):
    T = q.shape[1]
    o, s = FORWARDS[intra](*_pad([q, k, v, g, beta], mosaic_gpu.CHUNK), None, h0, seq_len=T,
                           scale=K**-0.5, lower_bound=0.0, interpret=False)
    return o[:, :T], s


@functools.partial(jax.jit, static_argnames="intra")
def intra_fused(q, k, v, z, a_log, dt_bias, beta_logits, *, intra):
    """The intra kernel alone at chunk 32 on fused inputs (T a multiple of 32): "triton" or "mosaic"."""
    kw = dict(seq_len=q.shape[1], scale=K**-0.5, lower_bound=LOWER)
    args = (q, k, v, z, beta_logits, _gate_params(a_log, dt_bias))
    if intra == "triton":
        return intra_chunk(*args, blocks=KDABlocks(chunk=mosaic_gpu.CHUNK), **kw)
    return mosaic_gpu_intra.intra_chunk(*args, interpret=False, **kw)


def check(intra):
    """Largest error of the forward with intra kernel ``intra`` against the float32 reference, and of
    a Mosaic GPU intra kernel's outputs against the Triton intra kernel's."""
    x = fused_inputs(jax.random.PRNGKey(1), 2, 300, heads=4)
    q, k, v, g, beta = plain_inputs(x)
    o, s = mosaic_plain(q, k, v, g, beta, x["h0"], intra=intra)
    ro, rs = jax.jit(ref.chunk_kda)(q, k, v, g, beta, x["h0"])
    fo, fs = mosaic_fused(*fused_args(x), x["h0"], intra=intra)
    rfo, rfs = jax.jit(kda_reference.chunk_kda_fused, static_argnums=7)(*fused_args(x), x["h0"])
    errs = dict(o=rel_err(o, ro), state=rel_err(s, rs), fused_o=rel_err(fo, rfo), fused_state=rel_err(fs, rfs))
    if intra != "triton":
        x = fused_inputs(jax.random.PRNGKey(1), 2, 320, heads=4)
        args = fused_args(x)[:7]
        pairs = zip(("w", "u", "qg", "kg", "aqk", "gend"), intra_fused(*args, intra=intra),
                    intra_fused(*args, intra="triton"))
        errs.update({f"intra_{name}": rel_err(a, b) for name, a, b in pairs})
    listed = ", ".join(f"{n} {e:.2e}" for n, e in errs.items())
    print(f"check B2 T300 H4 (intra {intra}): {listed}", flush=True)
    return max(errs.values())


def walk_inputs(x, T):
    a_exp = jnp.broadcast_to(jnp.exp(x["a_log"])[:, None], x["dt_bias"].shape)
    inter = jax.jit(lambda *a: intra_chunk(*a, (a_exp, x["dt_bias"]), seq_len=T, scale=K**-0.5,
                                           blocks=KDABlocks(chunk=mosaic_gpu.CHUNK), lower_bound=LOWER))(
        x["q"], x["k"], x["v"], x["z"], x["beta_logits"])
    return jax.block_until_ready(inter)


def time_shape(B, T, intras, rows):
    """Rows (B, T, what, ms, baseline ms) for one shape: the public path, the forward with each intra
    kernel, then with "mosaic" among them the two intra kernels alone, else the two walks alone."""
    x = fused_inputs(jax.random.PRNGKey(2), B, T)
    h0 = jnp.zeros((B, H, K, V), jnp.float32)
    base = time_jax(jax.jit(chunk_kda_fused, static_argnums=7), *fused_args(x), h0)
    new = [(B, T, "public chunk_kda_fused", base, base)]
    for intra in intras:
        forward = functools.partial(mosaic_fused, intra=intra)
        ms = time_jax(forward, *fused_args(x), h0)
        new.append((B, T, f"mosaic walk forward, intra {intra}", ms, base))
    if "mosaic" in intras:
        intra_args = fused_args(x)[:7]
        intra_base = time_jax(functools.partial(intra_fused, intra="triton"), *intra_args)
        ms = time_jax(functools.partial(intra_fused, intra="mosaic"), *intra_args)
        new += [(B, T, "intra alone: triton c32", intra_base, intra_base),
                (B, T, "intra alone: mosaic", ms, intra_base)]
    else:
        w, u, qg, kg, aqk, gend = walk_inputs(x, T)
        walk = jax.jit(lambda *a: state_walk(*a, blocks=KDABlocks()))
        walk_base = time_jax(walk, w, u, qg, kg, aqk, gend, h0)
        ms = time_jax(jax.jit(mosaic_gpu.state_walk), w, u, qg, kg, aqk, gend, h0)
        new += [(B, T, "walk alone: triton c32 v64", walk_base, walk_base),
                (B, T, "walk alone: mosaic v64", ms, walk_base)]
    for row in new:
        print(row, flush=True)
    rows.extend(new)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--budget-s", type=float, default=200.0)
    parser.add_argument("--intra", default="triton",
                        help="comma-separated intra kernels of the Mosaic GPU forward: triton, mosaic")
    args = parser.parse_args()
    intras = args.intra.split(",")
    start = time.perf_counter()
    print(f"{jax.devices()[0].device_kind} jax {jax.__version__}", flush=True)
    rows, failed = [], []
    try:
        for intra in intras:
            if check(intra) >= 5e-3:
                failed.append(intra)
        for B, T in SHAPES:
            if time.perf_counter() - start > args.budget_s:
                print("time budget spent: remaining shapes skipped")
                break
            time_shape(B, T, intras, rows)
    except Exception:  # noqa: BLE001 - print what was measured
        print(traceback.format_exc()[-4000:], flush=True)
    if failed:
        print(f"error >= 5e-3 (timed all the same): {', '.join(failed)}")
    print("\n| B | T | what | ms | speed vs baseline (same part) |\n|---|---|---|---|---|")
    for B, T, what, ms, base in rows:
        print(f"| {B} | {T} | {what} | {ms:.3f} | {base / ms:.2f}x |")


if __name__ == "__main__":
    main()
