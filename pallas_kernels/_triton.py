"""What the Pallas Triton kernels share: their compiler parameters, the widths Triton's dot takes (and the
check of a tile's widths), the online-softmax step of the flash-attention loops, and the operand sizes
whose offsets wrap (``offsets_wrap``)."""

from __future__ import annotations

import math

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


def offsets_wrap(*arrays) -> bool:
    """Whether a Pallas Triton kernel would read or write one of these operands at wrong addresses. JAX's
    Triton lowering (0.10.2 and 0.11.2, ``_compute_offsets_from_indices``) computes element offsets in 32
    bits for arrays of up to 2**32 bytes, and a 32-bit offset is signed: past 2**31 elements it wraps
    negative. Only arrays of 1-byte elements get there (MXFP4 codes and scales): 2**31 to 2**32 of them.
    Measured on the H200: the grouped MX kernel over 400 and 448 of K3's experts (w1 codes of 2.2e9 and
    2.5e9 bytes) gave relative errors of 0.15 and 0.41-0.55, over 384 (2.1e9) and 896 (4.9e9, 64-bit
    offsets) the right products; K3's bf16 output head (1.2e9 elements) through the matvec kernel was right
    (benchmarks/HISTORY.md, 2026-12-03, MX run 16). Callers take another path for such operands (arrays or
    ``jax.ShapeDtypeStruct``)."""
    for a in arrays:
        elements = math.prod(a.shape)
        if 2**31 < elements and elements * jnp.dtype(a.dtype).itemsize <= 2**32:
            return True
    return False


def check_offsets(remedy: str, **operands) -> None:
    """A ValueError naming the first operand whose offsets would wrap in a Pallas Triton kernel
    (``offsets_wrap``), with ``remedy``: what the caller can do instead."""
    for name, a in operands.items():
        if offsets_wrap(a):
            raise ValueError(f"{name}: {math.prod(a.shape)} one-byte elements, where a Pallas Triton kernel's 32-bit "
                             f"offsets wrap (pallas_kernels._triton.offsets_wrap); {remedy}")


def triton_params(num_warps: int, num_stages: int, interpret: bool):
    """Pallas' Triton compiler parameters, None in interpret mode. On JAX 0.10 and 0.11 they also select
    Pallas' Triton lowering for a GPU kernel."""
    if interpret:
        return None
    from jax.experimental.pallas import triton as pltriton

    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
