"""Train-step speed: tokens per second and model FLOPs utilisation (MFU) against the same run's bf16 matmul
rate, for each preset and implementation asked for; the baseline of the training-speed work.

    python3 benchmarks/train.py [--presets mini,nano] [--impls reference,pallas] [--batch 8] [--seq-len 1024]
                                [--compute-dtype bfloat16] [--steps 10]

Each row builds ``k3jax.train.Trainer`` (the jitted step ``k3jax train`` runs: AdamW, clipping, the router
bias update, donated state), compiles it, runs two steps, then times ``--steps`` chained steps (the best of
three rounds). Model FLOPs per token = 6 x the matmul parameters a token passes through (routed experts
counted k of E, the output head included, the embedding not) + the causal MLA attention's 6 x T/2 x H x
(192 + 128)-style products (qk and pv) per MLA layer; KDA's state products are left out (they are small
beside the projections at these widths), so MFU is slightly understated. The bf16 rate is an 8192^3 matmul
timed in the same process.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

from k3jax.param_count import count_params
from k3jax.presets import preset
from k3jax.train import TrainConfig, Trainer, init_state


def matmul_rate(n: int = 8192, calls: int = 20) -> float:
    """bf16 FLOP/s of an n x n x n matmul (best of three rounds)."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    f = jax.jit(lambda x: (x @ a) * 0.01)
    x = jax.block_until_ready(f(a))
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        y = x
        for _ in range(calls):
            y = f(y)
        jax.block_until_ready(y)
        best = min(best, (time.perf_counter() - start) / calls)
    return 2 * n**3 / best


def model_flops_per_token(name: str, seq_len: int) -> float:
    """6 x active matmul parameters (no embedding) + causal MLA attention, forward and backward."""
    cfg = preset(name)
    mla = cfg.mla
    attention = 6 * (seq_len / 2) * mla.num_heads * (mla.qk_head_dim + mla.v_head_dim) * cfg.layer_types.count("mla")
    return 6 * count_params(cfg).active + attention


def time_steps(trainer: Trainer, state, tokens, mask, steps: int) -> tuple[float, dict]:
    """Seconds per step (best of three rounds of ``steps`` chained steps) and the last metrics."""
    for _ in range(2):
        state, metrics = trainer.step(state, tokens, mask)
    jax.block_until_ready(state)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(steps):
            state, metrics = trainer.step(state, tokens, mask)
        jax.block_until_ready(state)
        best = min(best, (time.perf_counter() - start) / steps)
    return best, {k: float(v) for k, v in metrics.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default="mini")
    ap.add_argument("--impls", default="reference,pallas")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--compute-dtype", default="bfloat16")
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    rate = matmul_rate()
    device = jax.devices()[0].device_kind
    print(f"{device}: bf16 matmul {rate / 1e12:.0f} TFLOP/s", flush=True)
    rows = []
    for name in args.presets.split(","):
        for impl in args.impls.split(","):
            cfg = TrainConfig(preset=name, batch=args.batch, seq_len=args.seq_len, compute_dtype=args.compute_dtype,
                              implementation=impl, steps=1000, warmup_steps=10)
            start = time.perf_counter()
            try:
                trainer = Trainer(cfg)
                state = init_state(cfg, trainer.model_cfg)
                windows = jax.random.randint(jax.random.key(1), (1, args.batch, args.seq_len + 1), 0, 256)
                mask = jnp.ones((1, args.batch, args.seq_len), jnp.float32)
                seconds, metrics = time_steps(trainer, state, windows, mask, args.steps)
            except Exception as err:  # a row that cannot run (memory, a lowering) is reported, not fatal
                rows.append((name, impl, f"failed: {type(err).__name__}: {str(err)[:160]}"))
                print(rows[-1], flush=True)
                continue
            tokens = args.batch * args.seq_len
            mfu = model_flops_per_token(name, args.seq_len) * tokens / seconds / rate
            rows.append((name, impl, f"{seconds * 1e3:9.1f} ms/step  {tokens / seconds:12,.0f} tokens/s  MFU "
                         f"{100 * mfu:5.1f}%  loss {metrics['loss']:.3f}  (built+compiled+timed in "
                         f"{time.perf_counter() - start:.0f} s)"))
            print(rows[-1], flush=True)
    print(f"\n{device}, batch {args.batch} x {args.seq_len} tokens, compute {args.compute_dtype}, bf16 matmul "
          f"{rate / 1e12:.0f} TFLOP/s")
    for name, impl, text in rows:
        print(f"{name:6s} {impl:9s} {text}")


if __name__ == "__main__":
    main()
