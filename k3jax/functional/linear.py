"""The maps that read one input, as the layers use them: a layer's projections (several weights, one
input), with the input's preparation before them and addends after.

An input may be an array, a Block AttnRes ``DepthMix`` (mixed when read) or an ``Activated`` gated
activation act(gate, up) (applied when read): deferred so that a kernel path can compute them inside
the products' kernel (``pallas_kernels.matvec``); here they are computed in plain JAX.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import jax
import jax.numpy as jnp

from k3jax.functional.attn_res import DepthMix
from k3jax.functional.norms import rms_norm
from k3jax.typing import Array

_HI = jax.lax.Precision.HIGHEST
Norm = tuple  # (weight [D], eps): an RMS norm's parameters


@dataclasses.dataclass(frozen=True)
class Activated:
    """act(gate, up) [..., F] as an input of ``project``, computed when read (``value()``)."""

    act: Callable[[Array, Array], Array]
    gate: Array
    up: Array

    @property
    def shape(self) -> tuple[int, ...]:
        return self.gate.shape

    @property
    def dtype(self):
        return input_dtype(self, None)

    def value(self) -> Array:
        return self.act(self.gate, self.up)


Input = "Array | DepthMix | Activated"


def input_dtype(x: Input, read_as) -> jnp.dtype:
    """The dtype of project's x once rounded to ``read_as`` and activated (a norm keeps it)."""
    read = lambda a: jax.ShapeDtypeStruct(a.shape, read_as or a.dtype)
    return jax.eval_shape(x.act, read(x.gate), read(x.up)).dtype if isinstance(x, Activated) else read(x).dtype


def product_dtypes(x: Input, weights: Sequence[Array], dtypes: Sequence | None, read_as=None) -> list:
    """Each product's dtype: ``dtypes``, or x's dtype as prepared (``input_dtype``) for every weight."""
    return [input_dtype(x, read_as)] * len(weights) if dtypes is None else list(dtypes)


def check_project(x: Input, weights: Sequence[Array], read_as, add: Sequence[Array]) -> None:
    if isinstance(x, DepthMix) and read_as is not None:
        raise ValueError("project: read_as applies to an array or an Activated, not a DepthMix")
    if add and len(weights) != 1:
        raise ValueError(f"project: add needs exactly one weight, got {len(weights)}")


def add_rounded(y: Array, add: Sequence[Array]) -> Array:
    """y plus each of ``add`` in turn, each sum rounded to y's dtype."""
    for a in add:
        y = (y + a).astype(y.dtype)
    return y


def prepared(x: Input, norm: Norm | None, read_as=None) -> Array:
    """project's x as its products read it, in this order: a ``DepthMix`` mixed; x (an ``Activated``'s
    two inputs) rounded to ``read_as``; an ``Activated`` applied; RMS-normed by ``norm`` = (weight, eps)."""
    if isinstance(x, DepthMix):
        x = x.value()
    if read_as is not None:
        x = x.astype(read_as) if not isinstance(x, Activated) else Activated(
            x.act, *(a.astype(read_as) for a in (x.gate, x.up)))
    if isinstance(x, Activated):
        x = x.value()
    return x if norm is None else rms_norm(x, *norm)


def project(x: Input, weights: Sequence[Array], dtypes: Sequence | None = None, norm: Norm | None = None, *,
            read_as=None, add: Sequence[Array] = ()) -> list[Array]:
    """x [..., D] (prepared as ``prepared`` says) times each weight [N_i, D]^T, as ``einsum(x.astype(dt),
    w.astype(dt))`` with dt = dtypes[i] (default: x's dtype as prepared; float32 sums): what ``Linear``
    computes, or the router's float32 logits. ``add`` (with one weight only): arrays [..., N] added to
    the output in turn, each sum rounded to the output's dtype (a residual, a shared expert's output)."""
    check_project(x, weights, read_as, add)
    dtypes = product_dtypes(x, weights, dtypes, read_as)
    x = prepared(x, norm, read_as)
    outs = [jnp.einsum("...i,oi->...o", x.astype(dt), w.astype(dt), precision=_HI) for w, dt in zip(weights, dtypes)]
    return [add_rounded(outs[0], add)] if add else outs


__all__ = ["Activated", "Norm", "add_rounded", "check_project", "input_dtype", "prepared", "product_dtypes", "project"]
