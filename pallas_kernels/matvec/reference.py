"""The oracle and CPU fallback of the matvec kernel: ``k3jax.functional.linear.project`` (a layer's maps
of one input as einsums, the input's mix, rounding, activation and norm before them, addends after)
and, for its short-conv epilogue, ``k3jax.functional.conv.short_convs``."""

from k3jax.functional.conv import short_convs
from k3jax.functional.linear import project

__all__ = ["project", "short_convs"]
