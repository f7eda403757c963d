"""A/B of the kernel policy: a preset's decode step or prefill on the Pallas path under the default
``KernelPolicy`` and under each variant that turns one choice off, in one process. Every variant is
compiled first (decode: each from a copy of one prefilled cache), then timed round-robin, each call
under its own policy, so lease-to-lease drift does not enter the comparison; the best and the median
round are printed with the host's time to dispatch. Then ``--device-rounds`` rounds under the profiler
(``kernel_profile.device_us``): the time the GPU is busy and its span. The profiler makes XLA launch the
kernels one by one unless ``XLA_FLAGS=--xla_enable_command_buffers_during_profiling=true``.

    python3 benchmarks/variants.py decode  [preset [variant ...]] [--batch 1] [--rounds 15] [--device-rounds 3]
    python3 benchmarks/variants.py prefill [preset [variant ...]] [--tokens 8192] [--chunk 2048]
                                           (default mini and every variant; tiny runs on a CPU)

Also prints each variant's logits against the default's (random bf16 weights amplify float32 summation
order, so small differences are expected where a kernel sums in another order).
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax import Generator, K3Model, KernelPolicy, preset, use_implementation
from inference import warm_up
from kernel_profile import device_rounds_table, device_us

DEFAULT = KernelPolicy()
DECODE = {  # a variant's name -> the policy fields it changes (each turns one choice off)
    "matvec kernel off": dict(matvec_max_rows=0),
    "activation by XLA": dict(activation_in_matvec_max_width=0),
    "adds by XLA": dict(add_in_matvec=False),
    "mix by XLA": dict(mix_kernel_any_rows=False),
    "conv kernel": dict(conv_in_matvec=False),
    "selection kernel": dict(route_in_moe_kernel=False),
    "h interleaved": dict(split_moe_planar_h_max_tokens=0),
    "sorted MoE at decode": dict(tiled_moe_at_decode=False),
    "tiled MoE at one token": dict(split_moe_max_tokens_beside_tiled=0),
}
PREFILL = {
    "sorted MoE at prefill": dict(tiled_moe_at_prefill=False),
    "mix by XLA": dict(mix_kernel_any_rows=False),
    "short convs by XLA": dict(conv_kernel_at_prefill=False),
}


def policies(changes: dict[str, dict], names: list[str]) -> dict[str, KernelPolicy]:
    """The named variants' policies, 'default' first (all of them when none is named)."""
    known = {"default": {}, **changes}
    unknown = sorted(set(names) - set(known))
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; choose from {sorted(known)}")
    names = ["default"] + [n for n in (names or list(changes)) if n != "default"]
    return {name: dataclasses.replace(DEFAULT, **known[name]) for name in names}


def rel_err(a, b) -> float:
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def timed_rounds(calls: dict[str, tuple[KernelPolicy, callable]], rounds: int, per_round: int):
    """Round-robin: each variant's ``call`` ``per_round`` times a round under its policy -> (seconds a call,
    host dispatch seconds a call), per variant, per round."""
    times = {name: [] for name in calls}
    dispatch = {name: [] for name in calls}
    for _ in range(rounds):
        for name, (policy, call) in calls.items():
            with use_implementation("pallas", policy=policy):
                start = time.perf_counter()
                for _ in range(per_round):
                    out = call()
                dispatch[name].append((time.perf_counter() - start) / per_round)
                jax.block_until_ready(out)
                times[name].append((time.perf_counter() - start) / per_round)
    return times, dispatch


def device_rounds(calls: dict, rounds: int, per_round: int) -> dict:
    device = {name: [] for name in calls}
    for _ in range(rounds):
        for name, (policy, call) in calls.items():
            with use_implementation("pallas", policy=policy):
                device[name].append(device_us(call, calls=per_round))
    return device


def decode(args, model, variants: dict[str, KernelPolicy]) -> None:
    cfg, batch = model.cfg, args.batch
    prompt = 128 if cfg.hidden_size >= 1024 else 8
    prompts = np.random.default_rng(1).integers(0, cfg.vocab_size, (batch, prompt)).tolist()
    pos, key = jnp.full((batch,), prompt, jnp.int32), jax.random.key(0)
    runs, prefilled, first = {}, None, {}
    for name, policy in variants.items():
        with use_implementation("pallas", policy=policy):
            gen = Generator(model, max_len=prompt + 64, prefill_chunk=prompt)  # a fresh jit per variant
            if prefilled is None:  # one prefill: every variant's first step starts from the same cache
                _, prefilled = gen.prefill(prompts, gen.init_cache(batch))
            token, first[name], cache = gen.decode_step(jnp.zeros((batch,), jnp.int32),
                                                        jax.tree.map(jnp.copy, prefilled), pos, key)
            runs[name] = [gen, jax.block_until_ready(token), cache]
        print(f"compiled: {name}; first logits rel err vs default {rel_err(first[name], first['default']):.2e}",
              flush=True)

    def advance(run):  # one decode step of a variant, from its token and cache (the cache is donated)
        run[1], _, run[2] = run[0].decode_step(run[1], run[2], pos, key)
        return run[1]

    calls = {name: (variants[name], lambda run=run: advance(run)) for name, run in runs.items()}
    with use_implementation("pallas", policy=variants["default"]):
        warm_up(calls["default"][1])
    times, dispatch = timed_rounds(calls, args.rounds, 20)
    report(f"{cfg.name}, B={batch} decode step", times, dispatch, 3)
    device = device_rounds(calls, args.device_rounds, 20)
    table = device_rounds_table(device, f"{cfg.name}, B={batch} decode step on the device (profiler)", "a step")
    if table:
        print(table)


def prefill(args, model, variants: dict[str, KernelPolicy]) -> None:
    cfg = model.cfg
    prompt = [np.random.default_rng(0).integers(0, cfg.vocab_size, args.tokens).tolist()]
    calls, logits = {}, {}
    for name, policy in variants.items():
        with use_implementation("pallas", policy=policy):
            gen = Generator(model, max_len=args.tokens + 16, prefill_chunk=args.chunk)  # a fresh jit per variant
            call = lambda gen=gen: gen.prefill(prompt, gen.init_cache(1))[0]
            logits[name] = jax.block_until_ready(call())
        calls[name] = (policy, call)
        print(f"compiled: {name}; last-token logits rel err vs default {rel_err(logits[name], logits['default']):.2e}",
              flush=True)
    times, dispatch = timed_rounds(calls, args.rounds, 1)
    report(f"{cfg.name}, prefill of {args.tokens} tokens in chunks of {args.chunk}", times, dispatch, 1)
    device = device_rounds(calls, args.device_rounds, 2)
    table = device_rounds_table(device, f"{cfg.name}, the same prefill under the profiler", "a prefill", digits=2)
    if table:
        print(table)


def report(title: str, times: dict, dispatch: dict, digits: int) -> None:
    print(f"\n{title}, ms | best | median | host dispatch (median) | rounds")
    ms = lambda t: f"{t * 1e3:.{digits}f}"
    for name, ts in times.items():
        print(f"{name} | {ms(min(ts))} | {ms(np.median(ts))} | {ms(np.median(dispatch[name]))} | "
              f"{' '.join(map(ms, ts))}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("form", choices=["decode", "prefill"])
    ap.add_argument("preset", nargs="?", default="mini")
    ap.add_argument("variants", nargs="*", help=f"decode: {sorted(DECODE)}; prefill: {sorted(PREFILL)} (default: all)")
    ap.add_argument("--batch", type=int, default=1, help="decode: sequences per step")
    ap.add_argument("--tokens", type=int, default=8192, help="prefill: prompt length")
    ap.add_argument("--chunk", type=int, default=2048, help="prefill: tokens per prefill call")
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds per variant (decode 15 of 20 steps, "
                    "prefill 5)")
    ap.add_argument("--device-rounds", type=int, default=3, help="rounds timed by the profiler (0: none)")
    args = ap.parse_args()
    args.rounds = args.rounds or (15 if args.form == "decode" else 5)
    variants = policies(DECODE if args.form == "decode" else PREFILL, args.variants)
    model = K3Model(preset(args.preset), rngs=nnx.Rngs(0), param_dtype=jnp.bfloat16)
    (decode if args.form == "decode" else prefill)(args, model, variants)


if __name__ == "__main__":
    main()
