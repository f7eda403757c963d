"""Runs the baseline and a few scratch/o_ab.py variants for ncu: 1 token (2 expert sets) and 8 tokens (1 set)."""
import sys
sys.path.insert(0, "scratch")
import jax, jax.numpy as jnp
import o_ab

NAMES = ["base (3e4f06f, CUDA cores)", "dot bf32 bk1024 br256 w8", "dot bf32 bk256 br256 w8 s4 one loop"]
stacks = tuple(o_ab.random_mx(k, s) for k, s in zip(jax.random.split(jax.random.key(1), 3),
               ((o_ab.E, o_ab.F, o_ab.R), (o_ab.E, o_ab.F, o_ab.R), (o_ab.E, o_ab.R, o_ab.F))))
fns = o_ab.variants()
for name in NAMES:
    fn = jax.jit(fns[name])
    for tokens, sets in ((1, 2), (8, 1)):
        for s in range(sets):
            key = jax.random.key(100 * tokens + s)
            x = jax.random.normal(key, (tokens, o_ab.R), jnp.float32).astype(jnp.bfloat16)
            _, ex = jax.lax.top_k(jax.random.uniform(jax.random.fold_in(key, 1), (tokens, o_ab.E)), o_ab.K)
            wt = jnp.full((tokens, o_ab.K), 1.0 / o_ab.K, jnp.float32)
            jax.block_until_ready(fn(x, wt, ex.astype(jnp.int32), *stacks))
            print(f"ran {name} T={tokens} set {s}", flush=True)
