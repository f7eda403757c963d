"""What the Pallas Triton kernels share: their compiler parameters, the widths Triton's dot takes (and the
check of a tile's widths), and the online-softmax step of the flash-attention loops."""

from __future__ import annotations

import jax.numpy as jnp

MIN_DOT = 16  # Triton's smallest dot dimension


def dot_width(n: int) -> bool:
    """Whether n is a width Triton's dot takes: a power of two >= ``MIN_DOT``."""
    return n >= MIN_DOT and not n & (n - 1)


def check_dot_widths(blocks, *names: str) -> None:
    """A ValueError naming ``blocks``' class and field where a named field is not a width Triton's dot takes."""
    for name in names:
        n = getattr(blocks, name)
        if not dot_width(n):
            raise ValueError(f"{type(blocks).__name__}.{name} must be a power of two >= {MIN_DOT}, got {n}")


def online_softmax_step(acc, m, l, s, values):
    """One key block of FlashAttention-2's loop in base 2: scores s [q, k] (log2 units, -inf where
    hidden) and values [k, d] update the float32 sum acc [q, d], the running maximum m and total l [q];
    the probabilities are rounded to the values' dtype for their product. Returns (acc, m, l)."""
    m_next = jnp.maximum(m, jnp.max(s, axis=1))
    p = jnp.exp2(s - m_next[:, None])
    correction = jnp.exp2(m - m_next)
    acc = acc * correction[:, None] + jnp.dot(p.astype(values.dtype), values, preferred_element_type=jnp.float32)
    return acc, m_next, l * correction + jnp.sum(p, axis=1)


def triton_params(num_warps: int, num_stages: int, interpret: bool):
    """Pallas' Triton compiler parameters, None in interpret mode. On JAX 0.10 and 0.11 they also select
    Pallas' Triton lowering for a GPU kernel."""
    if interpret:
        return None
    from jax.experimental.pallas import triton as pltriton

    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
