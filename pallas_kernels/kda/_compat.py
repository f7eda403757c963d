"""The one version-specific shim: which Pallas lowering the KDA kernels ask for.

On a GPU the kernels are written for Pallas' Triton lowering (plain ``jnp`` bodies, ``pl.ds`` slices,
``lax.fori_loop``). JAX 0.10 picks Triton when no compiler parameters are given unless the
``jax_pallas_use_mosaic_gpu`` flag is set; JAX 0.11 defaults to Mosaic GPU, and Triton is chosen by
passing its ``CompilerParams``, which both versions accept. On a CPU the kernels run in interpret
mode; on a TPU no parameters are passed and Mosaic TPU lowers the same bodies.
"""

from __future__ import annotations

import jax

from k3jax.implementation import pallas_interpret


def interpret() -> bool:
    """True where Pallas must interpret the kernels (no GPU or TPU)."""
    return pallas_interpret()


def compiler_params(num_warps: int, num_stages: int):
    """Triton compiler parameters on a GPU, None elsewhere (interpret mode, TPU)."""
    if jax.default_backend() != "gpu":
        return None
    from jax.experimental.pallas import triton as pltriton

    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


__all__ = ["interpret", "compiler_params"]
