"""Random KDA inputs shared by the kernel tests: bf16-rounded q, k, v (both sides of a comparison
see the same values), float32 gates, beta and initial state."""

import jax
import jax.numpy as jnp

from k3jax.functional import kda as ref

GATES = ("random", "floor", "near_zero")  # g in (-5, 0); at the -5 floor; near zero


def plain_inputs(seed, B=2, T=37, H=2, K=32, V=16, gate="random"):
    """(q, k, v, g, beta, h0) of the plain contract: q, k L2-normalized (bf16), g log decays."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 6)
    bf = jnp.bfloat16
    q = ref.l2_normalize(jax.random.normal(ks[0], (B, T, H, K))).astype(bf)
    k = ref.l2_normalize(jax.random.normal(ks[1], (B, T, H, K))).astype(bf)
    v = jax.random.normal(ks[2], (B, T, H, V)).astype(bf)
    u = jax.random.uniform(ks[3], (B, T, H, K))
    g = {"random": -5.0 * u, "floor": -5.0 + 1e-3 * u, "near_zero": -1e-3 * u}[gate]
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, H)))
    h0 = jax.random.normal(ks[5], (B, H, K, V))
    return q, k, v, g, beta, h0


def raw_inputs(seed, B=2, T=37, H=2, K=32, V=16):
    """The layer's inputs before the gates: un-normalized q, k, raw z and beta logits (bf16)."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 8)
    bf = jnp.bfloat16
    q, k = (jax.random.normal(kk, (B, T, H, K), bf) for kk in ks[:2])
    v = jax.random.normal(ks[2], (B, T, H, V), bf)
    z = jax.random.normal(ks[3], (B, T, H, K), bf)
    a_log = jax.random.uniform(ks[4], (H,), minval=-1.0, maxval=1.0)
    dt_bias = 0.5 * jax.random.normal(ks[5], (H, K))
    beta_logits = jax.random.normal(ks[6], (B, T, H), bf)
    h0 = jax.random.normal(ks[7], (B, H, K, V))
    return q, k, v, z, a_log, dt_bias, beta_logits, h0
