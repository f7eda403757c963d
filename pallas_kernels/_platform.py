"""Where the kernels run: interpret mode off GPU and TPU, the JAX version's Pallas backends.

Every op folder imports this module; it imports nothing of theirs."""

from __future__ import annotations

import jax


def interpret() -> bool:
    """True where Pallas must interpret the kernels (no GPU or TPU): CI checks every kernel this way."""
    return jax.default_backend() == "cpu"


def on_tpu() -> bool:
    return jax.default_backend() == "tpu"


def jax_at_least(major: int, minor: int) -> bool:
    """Whether the running JAX is at least version major.minor (Pallas' GPU backends differ between
    JAX 0.10, where Triton is the default lowering, and 0.11, where Mosaic GPU is)."""
    return tuple(int(p) for p in jax.__version__.split(".")[:2]) >= (major, minor)


def mosaic_gpu_runs() -> bool:
    """Whether the Mosaic GPU kernels run compiled: on a GPU under JAX >= 0.11, where they were measured
    (Pallas' Mosaic GPU backend of JAX 0.10 is untried)."""
    return jax_at_least(0, 11) and jax.default_backend() == "gpu"


__all__ = ["interpret", "jax_at_least", "mosaic_gpu_runs", "on_tpu"]
