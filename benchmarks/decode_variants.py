"""Batch-1 decode step of a preset on the Pallas path with and without the latest step changes, in one
process: every variant's step is traced and compiled first, then the variants are timed round-robin
(three rounds of 20 steps, best round), so lease-to-lease drift does not enter the comparison.

    python3 benchmarks/decode_variants.py [preset]      (default mini; tiny runs on a CPU)

Variants (module switches read while a step is traced): the default; KDA's short convs by XLA
(``k3jax.layers.kda._short_convs`` set to its XLA form, instead of ``pallas_kernels.short_conv``);
the AttnRes block store as a select even where the layer index is known (``k3jax.model._store_block``
given a traced commit); MLA's new latents written by XLA (``MLA._write`` set to ``MLA._write_xla``,
instead of ``pallas_kernels.latent_cache``); all three off. Also prints each variant's first logits
against the default's (with random bf16 weights the model amplifies float32 summation order).
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import k3jax.layers.kda as kda
import k3jax.model as model_module
from k3jax import Generator, K3Model, preset, use_implementation
from k3jax.layers.mla import MLA

ORIGINAL = {"convs": kda._short_convs, "store": model_module._store_block, "write": MLA._write}
XLA_CONVS = {"convs": kda._short_convs_xla}
SELECT_STORE = {"store": lambda blocks, n, partial, commit: ORIGINAL["store"](blocks, n, partial, jnp.asarray(commit))}
XLA_LATENTS = {"write": MLA._write_xla}
VARIANTS = {"default": {}, "short convs by XLA": XLA_CONVS, "block store by select": SELECT_STORE,
            "latents by XLA": XLA_LATENTS, "all three off": {**XLA_CONVS, **SELECT_STORE, **XLA_LATENTS}}


def use(variant: dict) -> None:
    """Set the module switches the next trace reads."""
    settings = {**ORIGINAL, **variant}
    kda._short_convs, model_module._store_block, MLA._write = settings["convs"], settings["store"], settings["write"]


def main() -> None:
    cfg = preset(sys.argv[1] if len(sys.argv) > 1 else "mini")
    model = K3Model(cfg, rngs=nnx.Rngs(0), param_dtype=jnp.bfloat16)
    prompt = 128 if cfg.hidden_size >= 1024 else 8
    prompts = np.random.default_rng(1).integers(0, cfg.vocab_size, (1, prompt)).tolist()
    pos, key = jnp.full((1,), prompt, jnp.int32), jax.random.key(0)
    runs = {}
    with use_implementation("pallas"):
        for name, variant in VARIANTS.items():
            use(variant)
            gen = Generator(model, max_len=prompt + 64, prefill_chunk=prompt)  # a fresh jit: traced under `variant`
            _, cache = gen.prefill(prompts, gen.init_cache(1))
            token, logits, cache = gen.decode_step(jnp.zeros((1,), jnp.int32), cache, pos, key)
            runs[name] = [gen, jax.block_until_ready(token), cache, logits]
        use({})
        first = runs["default"][3]
        for name, (_, _, _, logits) in runs.items():
            err = float(jnp.linalg.norm(logits - first) / jnp.linalg.norm(first))
            print(f"{name}: first logits rel err vs default {err:.2e}")
        times = {name: [] for name in VARIANTS}
        for _ in range(3):
            for name, run in runs.items():
                gen, token, cache, _ = run
                start = time.perf_counter()
                for _ in range(20):
                    token, _, cache = gen.decode_step(token, cache, pos, key)
                jax.block_until_ready(token)
                times[name].append((time.perf_counter() - start) / 20)
                run[1:3] = [token, cache]
    print(f"\n{cfg.name}, B=1 decode step, ms | best | rounds")
    for name, ts in times.items():
        print(f"{name} | {min(ts) * 1e3:.3f} | {' '.join(f'{t * 1e3:.3f}' for t in ts)}")


if __name__ == "__main__":
    main()
