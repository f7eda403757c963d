"""Readable float32 oracles for the MX matmuls: decode, then an ordinary (or ragged) dot.

These are the CPU fallback and the test oracle of the kernels (``triton.py``, ``mosaic_gpu*.py``,
``tpu.py``). Weights are ``MXTensor`` in the PyTorch [out, in] layout, so ``y = x @ w.T``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from k3jax.mx import MXTensor
from k3jax.typing import Array

_HIGHEST = jax.lax.Precision.HIGHEST


def activations_float32(x: Array | MXTensor) -> Array:
    """x [M, K] float, or an MXFP8 ``MXTensor`` [M, K] -> float32 [M, K]."""
    return x.decode(jnp.float32) if isinstance(x, MXTensor) else x.astype(jnp.float32)


def mx_matmul_reference(x: Array | MXTensor, w: MXTensor) -> Array:
    """x [M, K] (float or MXFP8), w MXFP4 [N, K] -> float32 [M, N] = x @ decode(w).T."""
    return jnp.dot(activations_float32(x), w.decode(jnp.float32).T, precision=_HIGHEST)


def grouped_mx_matmul_reference(x: Array | MXTensor, w: MXTensor, group_sizes: Array) -> Array:
    """x [M, K] rows sorted by group, w MXFP4 [G, N, K], group_sizes int32 [G] -> float32 [M, N].

    Rows of group g multiply w[g]; rows past sum(group_sizes) are zero.
    """
    w_kn = jnp.swapaxes(w.decode(jnp.float32), 1, 2)  # [G, K, N]
    return jax.lax.ragged_dot(
        activations_float32(x), w_kn, group_sizes.astype(jnp.int32), precision=_HIGHEST,
        preferred_element_type=jnp.float32,
    )


__all__ = ["activations_float32", "grouped_mx_matmul_reference", "mx_matmul_reference"]
