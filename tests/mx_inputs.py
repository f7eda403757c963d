"""Random operands shared by the MX matmul and MoE kernel tests: activations bf16 holds exactly, MXFP4 expert
stacks, router logits with a bias-picked expert and a tie."""

import jax
import jax.numpy as jnp

from k3jax.mx import MXTensor


def bf16_normal(key, shape):
    """Random activations that bf16 holds exactly (the kernels feed bf16 to the matrix units)."""
    return jax.random.normal(key, shape, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32)


def expert_stacks(keys, E: int, F: int, R: int) -> tuple[MXTensor, MXTensor, MXTensor]:
    """Random MXFP4 expert stacks w1, w3 [E, F, R] and w2 [E, R, F] from keys[0..2], scaled by fan-in."""
    w1, w3 = (MXTensor.quantize(jax.random.normal(kk, (E, F, R)) * R**-0.5) for kk in keys[:2])
    return w1, w3, MXTensor.quantize(jax.random.normal(keys[2], (E, R, F)) * F**-0.5)


def router_case(tokens: int, E: int = 12):
    """Router logits [T, E] and bias [E] where the bias puts expert 7 first (low score, large bias:
    weighted by its score) and experts 2 and 5 tie on score + bias next (the lower index goes first)."""
    logits = jax.random.normal(jax.random.key(30 + tokens), (tokens, E))
    logits = logits.at[:, 2].set(5.0).at[:, 5].set(5.0).at[:, 7].set(-2.0)
    bias = (jax.random.uniform(jax.random.key(40), (E,)) * 0.1).at[5].set(0.0).at[2].set(0.0).at[7].set(0.9)
    return logits, bias
