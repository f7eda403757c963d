"""Issue 4 (helper o): batch-1 decode step of `mini` on the Pallas path with the tree's fused MoE against the
baseline kernel (scratch/o_moe_base.py patched in as pallas_kernels.mx_matmul.fused_moe_mx, which MoE.__call__
imports while tracing). As benchmarks/decode_variants.py: a fresh Generator per variant, all compiled first, then
three interleaved rounds of 20 steps, best round.

    python3 scratch/o_step.py [batch]
"""

from __future__ import annotations

import sys
import time

sys.path.insert(0, "scratch")
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import o_moe_base
import pallas_kernels.mx_matmul as mx_package
from k3jax import Generator, K3Model, preset, use_implementation

VARIANTS = {"tree fused_moe_mx": mx_package.fused_moe_mx, "baseline (3e4f06f)": o_moe_base.fused_moe_mx}


def main() -> None:
    batch = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    cfg = preset("mini")
    model = K3Model(cfg, rngs=nnx.Rngs(0), param_dtype=jnp.bfloat16)
    prompt = 128 if cfg.hidden_size >= 1024 else 8
    prompts = np.random.default_rng(1).integers(0, cfg.vocab_size, (batch, prompt)).tolist()
    pos, key = jnp.full((batch,), prompt, jnp.int32), jax.random.key(0)
    runs = {}
    with use_implementation("pallas"):
        for name, fn in VARIANTS.items():
            mx_package.fused_moe_mx = fn
            gen = Generator(model, max_len=prompt + 64, prefill_chunk=prompt)
            _, cache = gen.prefill(prompts, gen.init_cache(batch))
            token, logits, cache = gen.decode_step(jnp.zeros((batch,), jnp.int32), cache, pos, key)
            runs[name] = [gen, jax.block_until_ready(token), cache, logits]
            print(f"compiled: {name}", flush=True)
        mx_package.fused_moe_mx = VARIANTS["tree fused_moe_mx"]
        first = runs["tree fused_moe_mx"][3]
        for name, (_, _, _, logits) in runs.items():
            err = float(jnp.linalg.norm(logits - first) / jnp.linalg.norm(first))
            print(f"{name}: first logits rel err vs tree {err:.2e}")
        times = {name: [] for name in runs}
        for _ in range(3):
            for name, run in runs.items():
                gen, token, cache, _ = run
                start = time.perf_counter()
                for _ in range(20):
                    token, _, cache = gen.decode_step(token, cache, pos, key)
                jax.block_until_ready(token)
                times[name].append((time.perf_counter() - start) / 20)
                run[1:3] = [token, cache]
    print(f"\nmini, B={batch} decode step, ms | best | rounds")
    for name, ts in times.items():
        print(f"{name} | {min(ts) * 1e3:.3f} | {' '.join(f'{t * 1e3:.3f}' for t in ts)}")


if __name__ == "__main__":
    main()
