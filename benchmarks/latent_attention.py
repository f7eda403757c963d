"""MLA's decode attention between the absorbed products on the GPU: ``pallas_kernels.latent_attention``
against XLA's form of the same middle of ``absorbed_attention`` (scores, mask, softmax, value product),
bf16 caches, one new token per sequence at the cache's last position.

First the check (the kernel against float64 NumPy on the same bf16-rounded operands), then us per call
(the median of 20 timed calls after a warm-up, each call one jitted function) and TB/s of cache bytes read,
at `mini`'s step (16 heads, 192 keys) and longer caches up to K3's (96 heads, 131072 keys); up to 8192 keys
also the kernel with 64-key splits (more programs, and XLA's merge after them).

    python3 benchmarks/latent_attention.py
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.latent_attention import LatentBlocks, latent_attention

R, P, SCALE = 512, 64, 192**-0.5
SHAPES = [(16, 1, 192), (16, 8, 192), (16, 1, 8192), (16, 64, 8192), (96, 1, 131072), (96, 8, 32768)]  # H, B, S


def xla_middle(q_lat, q_pe, c_kv, k_pe, positions):
    """absorbed_attention's middle as XLA runs it in a decode step (operands in the cache's dtype)."""
    f32 = jnp.float32
    scores = (jnp.einsum("bhr,bsr->bhs", q_lat.astype(c_kv.dtype), c_kv, preferred_element_type=f32)
              + jnp.einsum("bhp,bsp->bhs", q_pe.astype(c_kv.dtype), k_pe, preferred_element_type=f32))
    visible = jnp.arange(c_kv.shape[1])[None, None, :] <= positions[:, None, None]
    probs = jax.nn.softmax(jnp.where(visible, scores * SCALE, -jnp.inf), axis=-1)
    return jnp.einsum("bhs,bsr->bhr", probs.astype(c_kv.dtype), c_kv, preferred_element_type=f32)


def inputs(H: int, B: int, S: int, seed: int = 0):
    k = jax.random.split(jax.random.key(seed), 4)
    return (jax.random.normal(k[0], (B, H, R)), jax.random.normal(k[1], (B, H, P)).astype(jnp.bfloat16),
            jax.random.normal(k[2], (B, S, R)).astype(jnp.bfloat16),
            jax.random.normal(k[3], (B, S, P)).astype(jnp.bfloat16), jnp.full((B,), S - 1, jnp.int32))


def numpy_middle(q_lat, q_pe, c_kv, k_pe):
    ql, qp, c, kp = (np.asarray(jnp.asarray(a).astype(jnp.bfloat16), np.float64) for a in (q_lat, q_pe, c_kv, k_pe))
    scores = (np.einsum("bhr,bsr->bhs", ql, c) + np.einsum("bhp,bsp->bhs", qp, kp)) * SCALE
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    return np.einsum("bhs,bsr->bhr", probs / probs.sum(-1, keepdims=True), c)


def per_call_us(fn, args) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(20):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main() -> None:
    print(jax.devices()[0].device_kind, jax.__version__, flush=True)
    kernel = jax.jit(lambda q, qp, c, kp, pos: latent_attention(q, qp, c, kp, pos, SCALE))
    split_64 = jax.jit(lambda q, qp, c, kp, pos: latent_attention(q, qp, c, kp, pos, SCALE,
                                                                  blocks=LatentBlocks(split_keys=64)))
    xla = jax.jit(xla_middle)
    for H, B, S in [(16, 2, 192), (96, 1, 5000)]:
        args = inputs(H, B, S, seed=1)
        want = numpy_middle(*args[:4])
        for name, fn in (("kernel", kernel), ("xla", xla)):
            got = np.asarray(fn(*args), np.float64)
            print(f"check H{H} B{B} S{S} {name}: rel err {np.linalg.norm(got - want) / np.linalg.norm(want):.1e}")
    rows = []
    for H, B, S in SHAPES:
        args = inputs(H, B, S)
        cache_bytes = args[2].nbytes + args[3].nbytes
        forms = (("kernel", kernel), ("xla", xla)) + ((("split 64", split_64),) if S <= 8192 else ())
        times = {name: per_call_us(fn, args) for name, fn in forms}
        rows.append((H, B, S, times["kernel"], times["xla"], cache_bytes, times.get("split 64", float("nan"))))
        print(rows[-1], flush=True)
    print("\nheads | batch | keys | kernel us | XLA us | kernel / XLA | kernel TB/s of cache | kernel, 64-key splits us")
    for H, B, S, k, x, nbytes, k64 in rows:
        print(f"{H} | {B} | {S} | {k:.1f} | {x:.1f} | {k / x:.2f} | {nbytes / k / 1e6:.2f} | {k64:.1f}")


if __name__ == "__main__":
    main()
