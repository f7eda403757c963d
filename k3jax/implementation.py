"""The one implementation switch: the pure-JAX reference path or the Pallas kernels.

    with k3jax.use_implementation("pallas"):
        logits = forward(...)

"reference" (the default) is float32-accurate pure JAX and runs everywhere. "pallas" routes the ops
that have kernels (chunked KDA, MX matmuls) to ``pallas_kernels``; on a CPU those kernels run in
Pallas interpret mode, which is how CI checks them. The switch is read at trace time, so a function
jitted under one setting keeps it; and since ``jax.jit`` caches traces by function, jitting the same
function again under another setting reuses the old trace too: jit a fresh function per setting.
Choosing "pallas" imports the kernel modules at once, before anything is traced on that path.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
from typing import Iterator, Literal

import jax

Implementation = Literal["reference", "pallas"]
KERNEL_MODULES = ("depth_mix", "kda", "latent_cache", "matvec", "mx_matmul", "prefill_attention", "route", "short_conv")
_CURRENT: contextvars.ContextVar[str] = contextvars.ContextVar("k3jax_implementation", default="reference")


def get_implementation() -> Implementation:
    return _CURRENT.get()  # type: ignore[return-value]


def _ready(name: str) -> str:
    """``name`` checked, and for "pallas" the kernel modules imported."""
    if name not in ("reference", "pallas"):
        raise ValueError(f"implementation: {name!r}; expected 'reference' or 'pallas'")
    if name == "pallas":
        _import_kernels()
    return name


def _import_kernels() -> None:
    """Import every kernel module the layers take on the Pallas path before anything is traced there.

    The layers import them when first traced, and on JAX 0.11 one of those imports (Pallas TPU's, which
    ``pallas_kernels.kda`` makes) registers a config value that is part of every jit's cache key. Made
    during a first trace, it left that trace's cache entry unmatched, so the function's next call traced
    and compiled it again (a second compile of a 2048-token prefill chunk of `mini`: about 40 s).
    """
    for module in KERNEL_MODULES:
        importlib.import_module(f"pallas_kernels.{module}")


def set_implementation(name: Implementation) -> None:
    """Set the implementation for this context (prefer ``use_implementation`` in code)."""
    _CURRENT.set(_ready(name))


@contextlib.contextmanager
def scoped(switch: contextvars.ContextVar, value) -> Iterator[None]:
    """Hold a trace-time switch at ``value`` for the duration of a with-block."""
    token = switch.set(value)
    try:
        yield
    finally:
        switch.reset(token)


def use_implementation(name: Implementation) -> contextlib.AbstractContextManager:
    """``with use_implementation("pallas"): ...`` traces the kernels' path inside the block."""
    return scoped(_CURRENT, _ready(name))


def jax_at_least(major: int, minor: int) -> bool:
    """Whether the running JAX is at least version major.minor (kernels whose Pallas backend differs
    between the CI's JAX 0.10 and the GPU machine's 0.11 ask this)."""
    return tuple(int(p) for p in jax.__version__.split(".")[:2]) >= (major, minor)


def triton_kernels() -> bool:
    """The Pallas path off TPU: where the layers may take the Triton-only kernels (decode MoE, expert
    selection, matvecs, the decode step's small kernels), on a GPU or in interpret mode on a CPU."""
    return get_implementation() == "pallas" and jax.default_backend() != "tpu"


def pallas_interpret() -> bool:
    """Pallas kernels run in interpret mode when no GPU or TPU is present."""
    return jax.default_backend() == "cpu"


__all__ = ["Implementation", "get_implementation", "set_implementation", "use_implementation", "pallas_interpret",
           "triton_kernels", "jax_at_least", "scoped"]
