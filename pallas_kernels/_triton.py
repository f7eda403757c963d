"""What the Pallas Triton kernels share: their compiler parameters."""

from __future__ import annotations


def triton_params(num_warps: int, num_stages: int, interpret: bool):
    """Pallas' Triton compiler parameters, None in interpret mode. On JAX 0.10 and 0.11 they also select
    Pallas' Triton lowering for a GPU kernel."""
    if interpret:
        return None
    from jax.experimental.pallas import triton as pltriton

    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
