"""Gradients for kernels that have no backward kernel yet: the reference's, recomputed in the backward pass.

    f = with_reference_gradient(kernel, reference)
    y = f(*args)   # kernel(*args); jax.grad through f differentiates reference(*args) instead

Every op entry that runs a kernel on a path a model's full forward takes (and so a training step's
``jax.grad``) goes through this one helper. Imports nothing of the op folders.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np


def _is_array(leaf) -> bool:
    return isinstance(leaf, (jax.Array, np.ndarray))


def with_reference_gradient(kernel: Callable, reference: Callable) -> Callable:
    """``f(*args)`` runs ``kernel(*args)``; its VJP is ``jax.vjp(reference, *args)``, the reference run
    again in the backward pass from the inputs saved by the forward (a ``jax.custom_vjp``).

    ``args`` are pytrees (tuples, lists, None). Their array leaves (JAX or NumPy arrays, tracers) are the
    differentiated inputs: integer and boolean ones (expert ids, positions, lengths, masks) get float0
    (zero) cotangents. Every other leaf (Python or NumPy scalars, dtypes, functions) is static: both
    functions receive it as given (a traced value is an array, so never static). ``kernel`` and ``reference`` take
    the same arguments and return the same leaves in the same order; the containers (tuple or list) and
    the floating dtypes may differ, since the cotangents are cast to the reference's outputs' dtypes
    before its VJP (which returns each input's gradient in that input's dtype)."""

    def wrapped(*args):
        leaves, treedef = jax.tree.flatten(args)
        arrays = [_is_array(leaf) for leaf in leaves]
        static = [None if is_array else leaf for is_array, leaf in zip(arrays, leaves)]

        def call(fn, inputs):
            it = iter(inputs)
            return fn(*jax.tree.unflatten(treedef, [next(it) if a else s for a, s in zip(arrays, static)]))

        @jax.custom_vjp
        def f(*inputs):
            return call(kernel, inputs)

        def fwd(*inputs):
            return call(kernel, inputs), inputs

        def bwd(inputs, cotangents):
            out, vjp = jax.vjp(lambda *xs: call(reference, xs), *inputs)
            outs, out_tree = jax.tree.flatten(out)
            cts = jax.tree.leaves(cotangents)
            if len(cts) != len(outs):
                raise ValueError(f"with_reference_gradient: the kernel returns {len(cts)} arrays, the reference "
                                 f"{len(outs)}")
            cts = [c.astype(o.dtype) if jnp.issubdtype(o.dtype, jnp.inexact)
                   else np.zeros(o.shape, jax.dtypes.float0) for c, o in zip(cts, outs)]
            return vjp(jax.tree.unflatten(out_tree, cts))

        f.defvjp(fwd, bwd)
        return f(*[leaf for is_array, leaf in zip(arrays, leaves) if is_array])

    return wrapped


__all__ = ["with_reference_gradient"]
