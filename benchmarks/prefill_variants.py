"""Prefill of one long prompt on the Pallas path with and without each of the latest prefill changes, in
one process: every variant's generator is traced and compiled first, then the variants are timed
round-robin (five rounds, best round; beside it the host's time until the prefill call returns), each call made
under its own switches (a retrace then takes the variant's form, not the last one set), so lease-to-lease drift
does not enter the comparison. Then ``--device-rounds`` rounds (default 3) under the profiler
(``kernel_profile.device_us``): the time the prefill keeps the GPU busy, its span on the GPU and the host's busiest events. The profiler makes
XLA launch the kernels one by one unless ``XLA_FLAGS=--xla_enable_command_buffers_during_profiling=true``. On the
H200 a 4096-token prompt in chunks of 2048 took 33.9 ms (best of six) while its 1328 kernels ran for 21.8 ms
(thirty-second session): the GPU waited on the host, which made the cache op by op and copied inputs between
chunks (thirty-third session: a 2048-token prompt 19.3-20.3 -> 13.4-14.0 ms without them).

    python3 benchmarks/prefill_variants.py [preset [variant ...]] [--tokens 8192] [--chunk 2048] [--device-rounds 3]
                                           (default mini, every variant; tiny runs on a CPU)

Each switch turns one change off (module attributes read while a prefill chunk is traced):
- absorbed MLA prefill: ``MLA._flash_kernel`` False (prefill chunks attend in the absorbed XLA form, not
  by ``pallas_kernels.mla.triton_attention`` over keys expanded from the latents);
- sorted MoE dispatch: ``k3jax.layers.moe.TILED_MOE_AT_PREFILL`` False (the routed experts of
  `mini`'s 2048-token chunks by the sorted dispatch on the Triton grouped kernel, not by
  ``pallas_kernels.mx_matmul.tiled_moe_mx``, the grouped Mosaic GPU kernel in its tiled layout);
- mix by XLA: ``k3jax.layers.basic.MIX_KERNEL_ANY_ROWS`` False (the AttnRes mixes and the norms after them by
  XLA's fusions, which re-read a block's sublayer outputs in each mix, not ``pallas_kernels.attn_res.triton``);
- short convs by XLA: ``k3jax.layers.kda.CONV_KERNEL_AT_PREFILL`` False (KDA's short convs and their SiLU by XLA's
  fusion, not ``pallas_kernels.kda.triton_short_conv.conv_silu_chunk``);
- dot merger: ``k3jax.inference.PREFILL_GPU_OPTIONS`` empty (XLA's dot merger on: each layer's projections as one
  matmul over their weights, concatenated on every call).
Candidates, each on alone (``switches.command_buffer_candidates`` on ``PREFILL_GPU_OPTIONS``): no command buffer,
skip temp updates, skip profiled updates, exclusive lock.
Variants: the default, each switch alone, each candidate alone, all the changes off. Also prints each
variant's last-token logits against the default's. Each variant compiles its own 8K prefill (80-110 s each on the H200), so
within a 10-minute call name one or two variants.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import k3jax.inference as inference
import k3jax.layers.basic as basic
import k3jax.layers.kda as kda
import k3jax.layers.moe as moe
from k3jax import Generator, K3Model, preset, use_implementation
from k3jax.layers.mla import MLA
from kernel_profile import device_rounds_table, device_us
from switches import Switches, command_buffer_candidates


OFF = {  # a change's name -> (owner, attribute, value with the change off)
    "absorbed MLA prefill": (MLA, "_flash_kernel", lambda self: False),
    "sorted MoE dispatch": (moe, "TILED_MOE_AT_PREFILL", False),
    "mix by XLA": (basic, "MIX_KERNEL_ANY_ROWS", False),
    "short convs by XLA": (kda, "CONV_KERNEL_AT_PREFILL", False),
    "dot merger": (inference, "PREFILL_GPU_OPTIONS", {}),
}
SWITCHES = Switches(OFF, command_buffer_candidates(inference, "PREFILL_GPU_OPTIONS"))


def main() -> None:
    ap = SWITCHES.arguments(__doc__)
    ap.add_argument("--tokens", type=int, default=8192, help="prompt length")
    ap.add_argument("--chunk", type=int, default=2048, help="tokens per prefill call")
    ap.add_argument("--device-rounds", type=int, default=3,
                    help="rounds of each variant's prefill timed on the device by the profiler (0: none)")
    args = ap.parse_args()
    names = SWITCHES.chosen(args.variants)
    cfg = preset(args.preset)
    model = K3Model(cfg, rngs=nnx.Rngs(0), param_dtype=jnp.bfloat16)
    prompt = [np.random.default_rng(0).integers(0, cfg.vocab_size, args.tokens).tolist()]
    gens, logits = {}, {}

    def prefill(gen):  # the prompt from an empty cache: its last-token logits
        return gen.prefill(prompt, gen.init_cache(1))[0]

    with use_implementation("pallas"):
        for name in names:
            SWITCHES.use(name)
            gen = Generator(model, max_len=args.tokens + 16, prefill_chunk=args.chunk)  # a fresh jit per variant
            logits[name] = jax.block_until_ready(prefill(gen))
            gens[name] = gen
            print(f"compiled: {name}", flush=True)
        for name in names:
            err = float(jnp.linalg.norm(logits[name] - logits["default"]) / jnp.linalg.norm(logits["default"]))
            print(f"{name}: last-token logits rel err vs default {err:.2e}")
        times = {name: [] for name in names}
        dispatch = {name: [] for name in names}  # the host's time until the prefill call returns, before its results
        device = {name: [] for name in names}
        for _ in range(5):
            for name, gen in gens.items():
                SWITCHES.use(name)
                start = time.perf_counter()
                out = prefill(gen)
                dispatch[name].append(time.perf_counter() - start)
                jax.block_until_ready(out)
                times[name].append(time.perf_counter() - start)
        for _ in range(args.device_rounds):
            for name, gen in gens.items():
                SWITCHES.use(name)
                device[name].append(device_us(lambda: prefill(gen), calls=2))
        SWITCHES.use("default")
    print(f"\n{cfg.name}, prefill of {args.tokens} tokens in chunks of {args.chunk}, ms | best | host dispatch "
          "(median) | rounds")
    for name, ts in times.items():
        print(f"{name} | {min(ts) * 1e3:.1f} | {np.median(dispatch[name]) * 1e3:.1f} | "
              f"{' '.join(f'{t * 1e3:.1f}' for t in ts)}")
    report = device_rounds_table(device, f"{cfg.name}, the same prefill under the profiler", "a prefill", digits=2)
    if report:
        print(report)


if __name__ == "__main__":
    main()
