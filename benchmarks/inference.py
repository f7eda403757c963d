"""Decode-step time of the `mini` preset against its memory floor, and 8K-token prefill throughput
against the GPU's measured bf16 matmul rate. Ceilings are measured in the same run, as the steps are timed: calls
dispatched ahead, the best round (the copy scales a 2 GiB array in place). Each batch's rounds follow 6 s of its
decode steps (``warm_up``), so that none meets the clocks of a GPU just woken.

    python3 benchmarks/inference.py [--impl pallas] [--batches 1,8,64] [--rounds 10] [--steps-per-call 8]
                                    [--generate 48] [--matvec-rows N]

At batch 1 it also times the steps ``--steps-per-call`` to a call (``Generator.decode_steps``: one dispatch from the
host for them all) and ``Generator.generate`` (tokens per second after its first call, best of two after a compiling
call): the step as a user meets it, the host's work between calls included.

Floor per decode step = (bytes of weights touched + cache bytes read and written) / copy bandwidth,
where the weights touched are every non-expert weight (bf16), one embedding row, and the distinct
routed experts the batch selects (expected count under uniform routing) in MXFP4.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax import Generator, K3Model, KernelPolicy, preset, use_implementation
from k3jax.memory import MXFP4_BYTES
from k3jax.param_count import count_params

from kernel_profile import (chain_listing, chain_table, critical_path, device_times, dumped_hlo, kernel_table,
                            source_paths, weight_only, weight_only_table)


def warm_up(step, seconds: float = 6.0) -> None:
    """Calls ``step()`` (a decode step returning an array to wait on) for ``seconds`` before timed rounds. An H200
    lease idles at 345 MHz, and a GPU's decode steps stay slow for seconds after it wakes: `mini`'s B=1 step read
    1.1-1.5 ms in processes that timed 3-5 rounds right after compiling, and after 2 s of steps the first 3-4
    rounds of a variant comparison still read 1.0-1.14 ms; after 6 s every round read 0.85-0.95
    (benchmarks/HISTORY.md, 2026-12-02). The clock starts after a first call (which may compile)."""
    jax.block_until_ready(step())
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        jax.block_until_ready(step())


def best_round(fn, state, calls: int = 10, rounds: int = 5) -> float:
    """Seconds per call of ``state = fn(state)``: the best of ``rounds`` rounds of ``calls`` chained calls
    (dispatched ahead, as the decode steps are, so the host's launch cost hides behind the device)."""
    state = jax.block_until_ready(fn(state))
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(calls):
            state = fn(state)
        jax.block_until_ready(state)
        best = min(best, (time.perf_counter() - t) / calls)
    return best


def ceilings() -> tuple[float, float]:
    """The copy bandwidth (a 2 GiB float32 array scaled in place, read and written) and the bf16 matmul rate,
    each the best round, as the decode steps are."""
    x = jax.random.normal(jax.random.key(0), (1 << (29 if jax.default_backend() == "gpu" else 24),))  # 2 GiB on GPU
    nbytes = x.nbytes
    bw = 2 * nbytes / best_round(jax.jit(lambda x: x * 1.0001, donate_argnums=0), x)
    n = 8192 if jax.default_backend() == "gpu" else 512
    a = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(2), (n, n), jnp.bfloat16)
    rate = 2 * n**3 / best_round(jax.jit(lambda a: (a @ b) * n**-0.5), a)  # the scale keeps a at unit size
    return bw, rate


def decode_floor_bytes(cfg, counts, batch: int, context: int) -> float:
    E, k = cfg.moe.num_experts, cfg.moe.experts_per_token
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    per_expert = counts.routed_experts / (E * moe_layers)
    distinct = E * (1 - (1 - k / E) ** batch)
    weights = (counts.total - counts.routed_experts - counts.embedding) * 2 + moe_layers * distinct * per_expert * MXFP4_BYTES
    kd = cfg.kda
    kda = cfg.layer_types.count("kda") * batch * kd.num_heads * kd.head_dim**2 * 4 * 2
    mla = cfg.layer_types.count("mla") * batch * context * (cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim) * 2
    return weights + kda + mla


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", default="pallas", choices=["pallas", "reference"])
    ap.add_argument("--batches", default="1,8,64", help="comma-separated decode batch sizes ('': no decode timing)")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--prefill", type=int, default=8192, help="prompt tokens of the prefill timing (0: skip)")
    ap.add_argument("--prefill-chunk", type=int, default=2048, help="tokens per prefill call of the prefill timing")
    ap.add_argument("--generate", type=int, default=48,
                    help="new tokens of a batch-1 `generate` timed after the batch-1 step (0: skip; at most 63)")
    ap.add_argument("--steps-per-call", type=int, default=8,
                    help="at batch 1 also time decode steps this many per call (Generator.decode_steps; 1: skip)")
    ap.add_argument("--preset", default="mini")
    ap.add_argument("--matvec-rows", type=int, default=None,
                    help="rows up to which the layers' projections take the one-kernel matvecs on the Pallas path "
                    "(KernelPolicy.matvec_max_rows; default: the library's)")
    ap.add_argument("--rounds", type=int, default=10,
                    help="timed rounds of 20 decode steps per batch size (the best is reported, the median beside it)")
    ap.add_argument("--profile", default="", help="XLA dump folder (set XLA_FLAGS to dump there; see "
                    "kernel_profile.py): print where the device time of a decode step and a prefill chunk goes, "
                    "what of it is work on the weights alone, and the step's critical path")
    ap.add_argument("--profile-top", type=int, default=25, help="rows per profile table")
    ap.add_argument("--profile-chain", action="store_true", help="also list the decode step's critical path link by link")
    ap.add_argument("--profile-gap", type=float, default=0.7,
                    help="us a dependent kernel launch costs on the decode step's critical path (the H200: about 0.7)")
    args = ap.parse_args()
    policy = KernelPolicy() if args.matvec_rows is None else KernelPolicy(matvec_max_rows=args.matvec_rows)
    bw, rate = ceilings()
    print(f"device {jax.devices()[0].device_kind}: copy {bw / 1e12:.2f} TB/s, bf16 matmul {rate / 1e12:.0f} TF/s")
    cfg = preset(args.preset)
    counts = count_params(cfg)
    model = K3Model(cfg, rngs=nnx.Rngs(0), param_dtype=jnp.bfloat16)
    print(f"\n{cfg.name} ({counts.total / 1e9:.2f}B params, {counts.active / 1e9:.2f}B active), impl={args.impl}")
    row = lambda *cells: print(" | ".join(f"{c:>18}" for c in cells), flush=True)  # each as soon as measured
    with use_implementation(args.impl, policy=policy):
        for batch in [int(b) for b in args.batches.split(",") if b]:
            gen = Generator(model, max_len=args.prompt + 64, prefill_chunk=args.prompt)
            prompts = np.random.default_rng(batch).integers(0, cfg.vocab_size, (batch, args.prompt)).tolist()
            _, cache = gen.prefill(prompts, gen.init_cache(batch))
            token = jnp.zeros((batch,), jnp.int32)
            pos = jnp.full((batch,), args.prompt, jnp.int32)
            key = jax.random.key(0)
            state = {"token": token, "cache": cache}

            def once():
                state["token"], _, state["cache"] = gen.decode_step(state["token"], state["cache"], pos, key)
                return state["token"]

            warm_up(once)
            steps, rounds = 20, []
            for _ in range(args.rounds):
                t = time.perf_counter()
                for _ in range(steps):
                    once()
                jax.block_until_ready(state["token"])
                rounds.append((time.perf_counter() - t) / steps)
            step = min(rounds)
            median = float(np.median(rounds))
            if args.profile:
                print(f"\n## decode B={batch}, step {step * 1e6:,.0f} us")
                hlo, times = dumped_hlo(args.profile, "decode"), device_times(once)
                paths = source_paths(hlo)
                print(kernel_table(times, paths, top=args.profile_top))
                if hlo:
                    print(weight_only_table(weight_only(hlo), times, paths, top=args.profile_top))
                    chain = critical_path(hlo, times, args.profile_gap)
                    print(chain_table(chain, paths, top=args.profile_top))
                    if args.profile_chain:
                        print(chain_listing(chain, paths))
            floor = decode_floor_bytes(cfg, counts, batch, args.prompt + 1) / bw
            row(f"decode B={batch}", f"{step * 1e3:.2f} ms", f"floor {floor * 1e3:.2f} ms", f"{step / floor:.1f}x floor",
                f"{batch / step:,.0f} tok/s", f"median {median * 1e3:.2f} ms")
            if batch == 1 and args.steps_per_call > 1:  # the same steps, several per call: one dispatch for them all
                k = args.steps_per_call

                def several():
                    tokens, _, state["cache"] = gen.decode_steps(state["token"], state["cache"], pos, key, k)
                    state["token"] = tokens[-1]
                    return tokens

                several()
                per_token = best_round(lambda _: several(), None, calls=max(1, 160 // k), rounds=args.rounds) / k
                row(f"decode B=1, {k} a call", f"{per_token * 1e3:.2f} ms a token",
                    f"{per_token / floor:.1f}x floor", f"{1 / per_token:,.0f} tok/s", f"{per_token / step:.2f}x the step")
            if batch == 1 and args.generate:  # what a user of generate sees: steps with the host's work between them
                runs = [gen.generate(prompts, args.generate) for _ in range(3)]  # the first compiles its windowed call of steps
                token_s = min(r.decode_seconds / r.decode_tokens for r in runs[1:])
                row("generate B=1", f"{token_s * 1e3:.2f} ms a token", f"{1 / token_s:,.0f} tok/s",
                    f"{token_s / step:.2f}x the step")
        T = args.prefill
        if T:
            C = min(args.prefill_chunk, T)
            gen = Generator(model, max_len=T + 16, prefill_chunk=C)
            prompt = [np.random.default_rng(0).integers(0, cfg.vocab_size, T).tolist()]
            jax.block_until_ready(gen.prefill(prompt, gen.init_cache(1))[0])
            rounds = []
            for _ in range(3):  # best of three: one prefill spreads by 10% between calls
                t = time.perf_counter()
                jax.block_until_ready(gen.prefill(prompt, gen.init_cache(1))[0])
                rounds.append(time.perf_counter() - t)
            seconds = min(rounds)
            if args.profile:
                chunk = jnp.asarray(np.asarray(prompt)[:, :C])
                start, lengths = jnp.zeros((1,), jnp.int32), jnp.full((1,), T, jnp.int32)
                print(f"\n## prefill chunk of {C} tokens (of {T})")
                index, last = jnp.full((1,), C - 1, jnp.int32), jnp.zeros((1, cfg.hidden_size), jnp.bfloat16)
                times = device_times(lambda: gen._chunk(gen._weights, chunk, gen.init_cache(1), start, lengths, index,
                                                        last, jnp.ones((1,), bool), window=gen.window(C))[0],
                                     calls=2)
                hlo = dumped_hlo(args.profile, "_chunk_fn")
                paths = source_paths(hlo)
                print(kernel_table(times, paths, top=args.profile_top))
                if hlo:
                    print(weight_only_table(weight_only(hlo), times, paths, top=args.profile_top))
            mla = cfg.mla
            head = cfg.vocab_size * cfg.hidden_size  # the output head runs on each prompt's last token only
            flops = 2 * (counts.active - head) * T + 2 * head + cfg.layer_types.count("mla") * 2 * T * T * (
                mla.num_heads * (mla.qk_head_dim + mla.v_head_dim))
            row(f"prefill T={T}", f"{seconds * 1e3:.0f} ms", f"{T / seconds:,.0f} tok/s",
                f"{flops / seconds / 1e12:.0f} TF/s", f"{flops / seconds / rate:.1%} of matmul")


if __name__ == "__main__":
    main()
