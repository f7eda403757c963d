"""MLA prefill attention at `mini`'s shapes (H 16, nope 128, rope 64, value 128, one 2048-token chunk):
the flash-attention kernel over expanded keys against the absorbed XLA form it replaces, cuDNN's
causal attention through ``jax.nn.dot_product_attention`` where the chunk is the whole sequence
(T = S; v padded to the 192 of q and k), and PyTorch's scaled_dot_product_attention on the same
expanded keys (the peer), in one run.

    python3 benchmarks/prefill_attention.py [--chunk 2048] [--keys 2048,8192]

Per case (a chunk at the end of S keys): relative error of each form against float32 attention
from the same bf16 inputs (``causal_attention`` on the expanded keys), then median times and rates counted on the
visible (query, key) pairs only: 2 * pairs * H * (nope + rope + value). The JAX forms are timed in rounds of calls
dispatched ahead (``benchmarks.kda.time_jax``; until 2026-12-02, one synchronized call at a time, which counted the
host's dispatch in), the peer by CUDA events around each call.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave room for the PyTorch peer

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from k3jax.functional.mla import absorbed_attention, causal_attention, mla_expand, mla_keys_values  # noqa: E402
from pallas_kernels.mla.triton_attention import AttentionBlocks, prefill_attention  # noqa: E402

from benchmarks.kda import time_jax  # noqa: E402

H, N, P, V, R = 16, 128, 64, 128, 512
SWEEP = [AttentionBlocks(128, 64, 8, 2), AttentionBlocks(128, 64, 4, 3), AttentionBlocks(64, 64, 4, 3),
         AttentionBlocks(128, 128, 8, 2), AttentionBlocks(64, 32, 4, 4), AttentionBlocks(128, 32, 4, 3)]


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--keys", default="2048,8192")
    args = ap.parse_args()
    T, scale, bf16 = args.chunk, (N + P) ** -0.5, jnp.bfloat16
    rows = []
    print(f"device {jax.devices()[0].device_kind}, JAX {jax.__version__}")
    for S in [int(s) for s in args.keys.split(",")]:
        keys = jax.random.split(jax.random.key(S), 5)
        q_nope = jax.random.normal(keys[0], (1, T, H, N), bf16)
        q_pe = jax.random.normal(keys[1], (1, T, H, P), bf16)
        c_kv = jax.random.normal(keys[2], (1, S, R), bf16)
        k_pe = jax.random.normal(keys[3], (1, S, P), bf16)
        kv_b = (jax.random.normal(keys[4], (H * (N + V), R)) * R**-0.5).astype(bf16)
        pos = (S - T + jnp.arange(T))[None]
        pairs = float(np.sum(np.minimum(np.asarray(pos[0]) + 1, S)))
        flops = 2 * pairs * H * (N + P + V)

        absorbed = jax.jit(lambda qn, qp, c, kp, w: absorbed_attention(
            qn, qp, c, kp, w, jnp.arange(S)[None, None, :] <= pos[:, :, None], scale))
        expand = jax.jit(lambda c, w: mla_expand(c, w, H, N))
        k_nope, v = expand(c_kv, kv_b)
        q, (k, _) = jnp.concatenate([q_nope, q_pe], -1), mla_keys_values(c_kv, k_pe, kv_b, H, N)  # [.., 192]
        f32 = lambda a: a.astype(jnp.float32)
        want = jax.jit(causal_attention, static_argnums=3)(f32(q), f32(k), f32(v), scale)  # the last T of S keys
        t_expand = seconds_per_call(expand, c_kv, kv_b)
        t_abs = seconds_per_call(absorbed, q_nope, q_pe, c_kv, k_pe, kv_b)
        rows.append((S, "absorbed XLA (before)", rel(absorbed(q_nope, q_pe, c_kv, k_pe, kv_b), want), t_abs, flops))
        rows.append((S, "expand keys (XLA einsum)", float("nan"), t_expand, 2 * S * R * H * (N + V)))
        for blocks in SWEEP:
            run = jax.jit(lambda qn, qp, kn, kp, vv, b=blocks: prefill_attention(qn, qp, kn, kp, vv, pos, scale,
                                                                                  blocks=b))
            out = jax.block_until_ready(run(q_nope, q_pe, k_nope, k_pe, v))
            rows.append((S, f"kernel {blocks.block_q}x{blocks.block_k} w{blocks.num_warps} s{blocks.num_stages}",
                         rel(out, want), seconds_per_call(run, q_nope, q_pe, k_nope, k_pe, v), flops))
        if T == S:
            rows += _cudnn(q, k, v, scale, want, flops)
        rows += _torch_peer(q, k, v, pos, scale, want, flops)
    print(f"\nchunk T={T}, H={H}, nope {N}, rope {P}, value {V}; rates over visible pairs")
    print(f"{'S':>6} | {'form':<34} | {'rel err':>9} | {'ms':>8} | {'TF/s':>6}")
    for S, name, err, seconds, flops in rows:
        print(f"{S:>6} | {name:<34} | {err:9.2e} | {seconds * 1e3:8.3f} | {flops / seconds / 1e12:6.1f}")


def seconds_per_call(fn, *args) -> float:
    """Seconds per call of ``fn(*args)`` (``time_jax``: the median of rounds of calls dispatched ahead)."""
    return time_jax(fn, *args) / 1e3


def _cudnn(q, k, v, scale, want, flops):
    """cuDNN's causal attention through ``jax.nn.dot_product_attention`` on the [B, L, H, 192] queries and
    keys and v zero-padded to 192 (one head width for all three): the route the design notes name for a
    chunk whose keys are its own queries (T = S)."""
    def run(q, k, v):
        padded = jnp.pad(v, [(0, 0)] * 3 + [(0, q.shape[-1] - v.shape[-1])])
        o = jax.nn.dot_product_attention(q, k, padded, scale=scale, is_causal=True, implementation="cudnn")
        return o[..., : v.shape[-1]]

    run = jax.jit(run)
    args = (q, k, v)
    try:
        err = rel(run(*args), want)
    except Exception as e:  # no cuDNN attention here (a CPU, or an unsupported shape): say why
        print(f"cuDNN attention skipped: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
        return []
    return [(k.shape[1], "cuDNN causal, v padded to 192", err, seconds_per_call(run, *args), flops)]


def _torch_peer(q, k, v, pos, scale, want, flops):
    """PyTorch SDPA on the same [B, L, H, 192] queries and keys (as [B, H, L, 192]), values [.., 128]:
    is_causal when the chunk is the whole sequence, else a boolean mask."""
    try:
        import torch
        import torch.nn.functional as F
    except ImportError as e:
        print(f"PyTorch peer skipped: {e}")
        return []
    t = lambda a: torch.from_numpy(np.asarray(a.astype(jnp.float32))).to("cuda", torch.bfloat16)
    T, S = q.shape[1], k.shape[1]
    q, k, v = (t(a).transpose(1, 2).contiguous() for a in (q, k, v))
    if T == S:
        call = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    else:
        mask = torch.from_numpy(np.arange(S)[None, :] <= np.asarray(pos[0])[:, None]).to("cuda")
        call = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    out = call()
    err = rel(out.transpose(1, 2).float().cpu().numpy(), want)
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    name = "torch SDPA " + ("causal" if T == S else "masked") + f" {torch.__version__.split('+')[0]}"
    return [(S, name, err, float(np.median(times)), flops)]


if __name__ == "__main__":
    main()
