"""The one version-specific shim: which Pallas lowering the KDA kernels use.

Three lowerings (``KDABlocks.lowering``; "auto" picks by backend and JAX version):

- "triton": the bodies in ``kernel.py`` (plain ``jnp``, ``pl.ds`` slices, ``lax.fori_loop``) through
  Pallas' Triton lowering, on JAX 0.10 and 0.11. JAX 0.10 picks Triton when no compiler parameters
  are given unless the ``jax_pallas_use_mosaic_gpu`` flag is set; JAX 0.11 defaults to Mosaic GPU,
  and Triton is chosen by passing its ``CompilerParams``, which both versions accept.
- "mosaic_gpu": ``mosaic_gpu.py``'s state walk (Hopper wgmma, TMA) after the Triton intra kernel;
  the decode step is ``mosaic_gpu_decode.py`` (TMA-streamed state, written in place). "auto" on a GPU
  under JAX >= 0.11 when K and V are multiples of 64 (for decode: and a large state,
  ``resolve_decode_lowering``).
- "mosaic_tpu": ``tpu.py``'s kernels ("auto" on a TPU).

On a CPU every lowering runs in its interpret mode ("auto": the Triton bodies).
"""

from __future__ import annotations

import jax

from k3jax.implementation import jax_at_least, pallas_interpret


LOWERINGS = ("auto", "triton", "mosaic_gpu", "mosaic_tpu")


def check_lowering(name: str) -> None:
    if name not in LOWERINGS:
        raise ValueError(f"lowering {name!r}; expected one of {LOWERINGS}")


def resolve_lowering(name: str, key_dim: int, value_dim: int) -> str:
    """The lowering "auto" stands for here (see the module docstring); others are returned as given."""
    check_lowering(name)
    if name != "auto":
        return name
    backend = jax.default_backend()
    if backend == "tpu":
        return "mosaic_tpu"
    from pallas_kernels.kda import mosaic_gpu

    newer = jax_at_least(0, 11)
    fits = key_dim % mosaic_gpu.WGMMA_ROWS == 0 and value_dim % mosaic_gpu.BLOCK_V == 0
    if backend == "gpu" and newer and fits:
        return "mosaic_gpu"
    return "triton"


MOSAIC_DECODE_MIN_STATE_BYTES = 256 << 20


def resolve_decode_lowering(name: str, key_dim: int, value_dim: int, state_bytes: int) -> str:
    """The decode step's lowering: as ``resolve_lowering``, except that "auto" keeps the Triton decode
    for states under ``MOSAIC_DECODE_MIN_STATE_BYTES``. Measured on the H200 (benchmarks/RESULTS.md):
    the Mosaic GPU decode is faster at B=64, H=96 (805 MB of state read and written: 3.59 against
    3.52 TB/s), slower at `mini`'s batch 1 (B*H = 16: 39 us plus ~45 us of operand copies and
    padding per step against 32 us); the threshold lies between the two, unmeasured there."""
    lowering = resolve_lowering(name, key_dim, value_dim)
    if name == "auto" and lowering == "mosaic_gpu" and state_bytes < MOSAIC_DECODE_MIN_STATE_BYTES:
        return "triton"
    return lowering


def interpret() -> bool:
    """True where Pallas must interpret the kernels (no GPU or TPU)."""
    return pallas_interpret()


__all__ = ["LOWERINGS", "check_lowering", "resolve_lowering", "interpret"]
