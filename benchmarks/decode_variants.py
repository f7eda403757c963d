"""Decode step of a preset on the Pallas path with and without each of the latest step changes, in one
process: every variant's step is traced and compiled first (each from a copy of one prefilled cache),
then the variants are timed round-robin (``--rounds`` rounds of 20 steps, default 15, each under its own
switches; the best and the median round printed), so lease-to-lease drift does not enter the comparison.
Five rounds spread 25-35% on the H200 (twentieth session): a change of a few percent needs the medians of
more rounds; beside them the host's time to dispatch a step (where it is near the step's, the host sets the pace).
Then ``--device-rounds`` rounds (default 3) of 20 steps under the profiler (``kernel_profile.device_us``): the time
a step keeps the GPU busy and its span on the GPU, and the host's busiest events. The profiler makes XLA launch the kernels one by one unless
``XLA_FLAGS=--xla_enable_command_buffers_during_profiling=true`` (on the H200 without it: 183 kernels a B=1 step,
their durations summed 0.94 ms against the 0.86 ms step in its command buffer, thirty-second session).

    python3 benchmarks/decode_variants.py [preset [variant ...]] [--batch N] [--rounds N] [--device-rounds N]
                                          (default mini, every variant, batch 1; tiny runs on a CPU)

Each switch turns one change off (module attributes read while a step is traced):
- short convs by XLA: ``k3jax.layers.kda._short_convs`` set to its XLA form (not ``pallas_kernels.kda.triton_short_conv``);
- block store by select: ``k3jax.model._store_block`` given a traced commit even where the layer index is known;
- latents by XLA: ``MLA._write`` set to ``MLA._write_xla`` (not ``pallas_kernels.mla.triton_cache``);
- activation by XLA: ``k3jax.layers.basic.ACT_PROLOGUE_MAX_WIDTH`` 0 (the shared experts' act(gate, up) is
  an XLA op before their down projection, not the matvec kernel's prologue);
- adds by XLA: ``k3jax.layers.basic.ADD_IN_KERNEL`` False (the residual and shared-expert adds after a
  projection are XLA ops, not the matvec kernel's epilogue);
- serial command buffer: ``k3jax.inference.DECODE_GPU_OPTIONS`` empty (the step's command buffer in
  XLA's default schedule, one kernel after another, not ordered by the buffers they share);
- one-kernel MoE: ``pallas_kernels.mx_matmul.SPLIT_MIN_TOKENS`` out of reach (the fused MoE as its one
  kernel with atomic adds at every batch, not the two kernels without atomics);
- selection kernel: ``MoE._routes_in_kernel`` False (at one token the experts are picked by the selection
  kernel before the fused MoE, not by its hidden programs);
- h interleaved: ``pallas_kernels.moe.triton_split.PLANAR_H_MAX_TOKENS`` 0 (the two-kernel MoE's h stored
  [T*k, F] between its kernels at one token too, not planar);
- conv kernel: ``k3jax.layers.kda.CONV_IN_MAPS`` False (at one row KDA's short convs and SiLU in a kernel of their
  own after the input maps' matvec kernel, not in its epilogue);
- sorted MoE at decode: ``k3jax.layers.moe.TILED_MOE_AT_DECODE`` False (below the prefill's density the routed
  experts by the sorted dispatch or, up to 64 pairs, the fused kernels, not the tiled Mosaic GPU MoE);
- mix by XLA: ``k3jax.layers.basic.MIX_KERNEL_ANY_ROWS`` False (at more than one row the AttnRes mixes and the
  norms after them by XLA's fusions, not ``pallas_kernels.attn_res.triton``; one row keeps the kernel).
Candidates, each on alone (``switches.command_buffer_candidates`` on ``DECODE_GPU_OPTIONS``): no command buffer,
skip temp updates, skip profiled updates, exclusive lock.
Variants: the default, each switch alone, each candidate alone, all the changes off.
Also prints each variant's first logits against the default's (with random bf16 weights the model amplifies
float32 summation order).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import k3jax.inference as inference
import k3jax.layers.kda as kda
import k3jax.layers.moe as moe_layer
import k3jax.model as model_module
import pallas_kernels.mx_matmul as mx_matmul
import pallas_kernels.moe.triton_split as moe_split
from k3jax import Generator, K3Model, preset, use_implementation
from k3jax.layers import basic
from k3jax.layers.mla import MLA
from k3jax.layers.moe import MoE
from inference import warm_up
from kernel_profile import device_rounds_table, device_us
from switches import Switches, command_buffer_candidates

_store = model_module._store_block
OFF = {  # a change's name -> (owner, attribute, value with the change off)
    "short convs by XLA": (kda, "_short_convs", kda._short_convs_xla),
    "block store by select": (model_module, "_store_block",
                              lambda blocks, n, partial, commit: _store(blocks, n, partial, jnp.asarray(commit))),
    "latents by XLA": (MLA, "_write", MLA._write_xla),
    "activation by XLA": (basic, "ACT_PROLOGUE_MAX_WIDTH", 0),
    "adds by XLA": (basic, "ADD_IN_KERNEL", False),
    "serial command buffer": (inference, "DECODE_GPU_OPTIONS", {}),
    "one-kernel MoE": (mx_matmul, "SPLIT_MIN_TOKENS", 1 << 30),
    "selection kernel": (MoE, "_routes_in_kernel", lambda self, tokens: False),
    "h interleaved": (moe_split, "PLANAR_H_MAX_TOKENS", 0),
    "conv kernel": (kda, "CONV_IN_MAPS", False),
    "sorted MoE at decode": (moe_layer, "TILED_MOE_AT_DECODE", False),
    "mix by XLA": (basic, "MIX_KERNEL_ANY_ROWS", False),
}
SWITCHES = Switches(OFF, command_buffer_candidates(inference, "DECODE_GPU_OPTIONS"))


def main() -> None:
    ap = SWITCHES.arguments(__doc__)
    ap.add_argument("--batch", type=int, default=1, help="sequences per decode step")
    ap.add_argument("--rounds", type=int, default=15, help="timed rounds of 20 steps per variant")
    ap.add_argument("--device-rounds", type=int, default=3,
                    help="rounds of 20 steps per variant timed on the device by the profiler (0: none)")
    args = ap.parse_args()
    cfg = preset(args.preset)
    model = K3Model(cfg, rngs=nnx.Rngs(0), param_dtype=jnp.bfloat16)
    prompt, batch = (128 if cfg.hidden_size >= 1024 else 8), args.batch
    prompts = np.random.default_rng(1).integers(0, cfg.vocab_size, (batch, prompt)).tolist()
    pos, key = jnp.full((batch,), prompt, jnp.int32), jax.random.key(0)
    names = SWITCHES.chosen(args.variants)
    runs, prefilled = {}, None
    with use_implementation("pallas"):
        for name in names:
            SWITCHES.use(name)
            gen = Generator(model, max_len=prompt + 64, prefill_chunk=prompt)  # a fresh jit: traced under its switches
            if prefilled is None:  # one prefill: every variant's first step starts from the same cache
                _, prefilled = gen.prefill(prompts, gen.init_cache(batch))
            cache = jax.tree.map(jnp.copy, prefilled)  # each decode step donates its cache
            token, logits, cache = gen.decode_step(jnp.zeros((batch,), jnp.int32), cache, pos, key)
            runs[name] = [gen, jax.block_until_ready(token), cache, logits]
            print(f"compiled: {name}", flush=True)
        SWITCHES.use("default")
        first = runs["default"][3]
        for name, (_, _, _, logits) in runs.items():
            err = float(jnp.linalg.norm(logits - first) / jnp.linalg.norm(first))
            print(f"{name}: first logits rel err vs default {err:.2e}")
        def advance(run):  # one decode step of a variant, from its token and cache
            run[1], _, run[2] = run[0].decode_step(run[1], run[2], pos, key)
            return run[1]

        times = {name: [] for name in names}
        dispatch = {name: [] for name in names}  # the host's time to hand the 20 steps over, per step
        device = {name: [] for name in names}
        warm_up(lambda: advance(runs["default"]))
        for _ in range(args.rounds):
            for name, run in runs.items():
                SWITCHES.use(name)  # a retrace takes this variant's form
                start = time.perf_counter()
                for _ in range(20):
                    advance(run)
                dispatch[name].append((time.perf_counter() - start) / 20)
                jax.block_until_ready(run[1])
                times[name].append((time.perf_counter() - start) / 20)
        for _ in range(args.device_rounds):
            for name, run in runs.items():
                SWITCHES.use(name)
                device[name].append(device_us(lambda: advance(run), calls=20))
    print(f"\n{cfg.name}, B={batch} decode step, ms | best | median | host dispatch (median) | rounds")
    for name, ts in times.items():
        print(f"{name} | {min(ts) * 1e3:.3f} | {np.median(ts) * 1e3:.3f} | {np.median(dispatch[name]) * 1e3:.3f} | "
              f"{' '.join(f'{t * 1e3:.3f}' for t in ts)}")
    report = device_rounds_table(device, f"{cfg.name}, B={batch} decode step on the device (profiler)", "a step")
    if report:
        print(report)


if __name__ == "__main__":
    main()
