"""The matvec op's entry for the layers: a layer's maps of one input, with the signature of
``k3jax.functional.linear.project`` plus KDA's short-conv epilogue.

    project(x, weights, dtypes=None, norm=None, *, read_as=None, add=(), conv=None) -> [y_1, ..., y_n(, state)]

On the Pallas path off TPU, for up to ``KernelPolicy.matvec_max_rows`` rows (a batch-1 decode step)
and operands the kernel reads exactly as the einsums would, one kernel (``triton.py``) computes every
map, its input's preparation inside (a gated activation up to
``KernelPolicy.activation_in_matvec_max_width``, the norm, the rounding), the addends in its epilogue
(``add_in_matvec``) and, with ``conv``, KDA's short convs and SiLU after the first outputs
(``conv_in_matvec``); a Block AttnRes mix before it is mixed and normed by the AttnRes kernel. Elsewhere
the reference's einsums run, the mix by ``pallas_kernels.attn_res`` and the convs by
``pallas_kernels.kda``. The kernel's gradient is the reference's (``project`` and ``short_convs`` of
``k3jax.functional``, by ``pallas_kernels._autodiff.with_reference_gradient``).
"""

from __future__ import annotations

import math
from typing import Sequence

import jax.numpy as jnp

from k3jax.functional.attn_res import DepthMix
from k3jax.functional.linear import Activated, Input, Norm, add_rounded, check_project, input_dtype, product_dtypes
from k3jax.implementation import current
from k3jax.typing import Array
from pallas_kernels import _platform
from pallas_kernels._autodiff import with_reference_gradient
from pallas_kernels.attn_res.ops import mix_norm, mix_norm_kernel
from pallas_kernels.kda.ops import short_convs
from pallas_kernels.matvec import reference
from pallas_kernels.matvec.triton import matvecs

ShortConvs = tuple  # (taps: one float32 [F_i, W] per conv'd output, state [B, W - 1, sum F_i], lengths [B] or None)


def _takes_kernel(x: Input, weights: Sequence[Array], dtypes: list, read_as) -> bool:
    """The Pallas path off TPU, few rows (``matvec_max_rows``), an activation no wider than
    ``activation_in_matvec_max_width``, and operands the kernel reads exactly as the einsums would: each
    weight in the product's dtype (or the product in float32), and x too unless every product has one
    dtype (the kernel then rounds x to it)."""
    choice = current()
    if choice.name != "pallas" or _platform.on_tpu():
        return False
    policy, x_dtype = choice.policy, input_dtype(x, read_as)
    exact = lambda dtype, dt: dtype == dt or dt == jnp.float32
    uniform = len({jnp.dtype(dt) for dt in dtypes}) == 1
    rows = math.prod(x.shape[:-1])
    fits = 0 < rows <= policy.matvec_max_rows and all(exact(w.dtype, dt) and (uniform or exact(x_dtype, dt))
                                                      for w, dt in zip(weights, dtypes))
    return fits and not (isinstance(x, Activated) and x.shape[-1] > policy.activation_in_matvec_max_width)


def _kernel(x: "Array | Activated", weights, dtypes, norm: Norm | None, read_as, add, conv) -> list[Array]:
    """The products by the matvec kernel: x's rows [M, D] and its prologue's arguments (``matvecs``)."""
    lead = x.shape[:-1]
    rows = lambda a: a.reshape(-1, a.shape[-1])
    kwargs = dict(read_as=read_as, norm=norm)
    if len({jnp.dtype(dt) for dt in dtypes}) == 1:
        kwargs["x_dtype"] = dtypes[0]
    if isinstance(x, Activated):
        kwargs["act"] = (x.act, rows(x.up))
        x = x.gate
    x = rows(x)
    fused = current().policy.add_in_matvec and all(jnp.dtype(a.dtype) == jnp.dtype(dtypes[0]) for a in add)
    flat_adds = [[a.reshape(x.shape[0], -1) for a in add]] if fused and add else None
    outs = list(matvecs(x, list(weights), dtypes, add=flat_adds, conv=conv, **kwargs))
    state = [outs.pop()] if conv is not None else []
    outs = [y.reshape(*lead, y.shape[-1]) for y in outs]
    return [add_rounded(outs[0], add)] if add and not fused else outs + state


def _reference(x: "Array | Activated", weights, dtypes, norm: Norm | None, read_as, add, conv) -> list[Array]:
    """What ``_kernel`` computes, by the reference: the products, then the short convs of the first outputs."""
    outs = reference.project(x, weights, dtypes, norm, read_as=read_as, add=add)
    if conv is None:
        return outs
    taps, state = conv
    *convolved, state = reference.short_convs(outs[:len(taps)], taps, state)
    return [*convolved, *outs[len(taps):], state]


def _products(x: "Array | Activated", weights, dtypes, norm: Norm | None, read_as, add, conv) -> list[Array]:
    """``_kernel``, with the reference's gradient (``_reference``)."""
    act, inputs = (x.act, (x.gate, x.up)) if isinstance(x, Activated) else (None, (x,))

    def called(fn):
        def call(act, inputs, *args):
            return fn(inputs[0] if act is None else Activated(act, *inputs), *args)
        return call

    return with_reference_gradient(called(_kernel), called(_reference))(
        act, inputs, list(weights), dtypes, norm, read_as, list(add), conv)


def project(x: Input, weights: Sequence[Array], dtypes: Sequence | None = None, norm: Norm | None = None, *,
            read_as=None, add: Sequence[Array] = (), conv: ShortConvs | None = None) -> list[Array]:
    """``k3jax.functional.linear.project`` (x [..., D] times each weight [N_i, D]^T), by the kernel or
    the reference (module docstring). ``conv`` = (taps, state, lengths): the first len(taps) outputs go
    on through KDA's short convs and SiLU (``k3jax.functional.conv.short_convs``: float32 outputs) and
    the new conv state is returned after the outputs."""
    check_project(x, weights, read_as, add)
    dtypes = product_dtypes(x, weights, dtypes, read_as)
    kernel = _takes_kernel(x, weights, dtypes, read_as)
    if isinstance(x, DepthMix):
        x, norm = (mix_norm_kernel(x, norm) if kernel else mix_norm(x, norm)), None
    if conv is None:
        if kernel:
            return _products(x, weights, dtypes, norm, read_as, add, None)
        return reference.project(x, weights, dtypes, norm, read_as=read_as, add=add)
    taps, state, lengths = conv
    if kernel and lengths is None and x.shape[-2] == 1 and current().policy.conv_in_matvec:
        return _products(x, weights, dtypes, norm, read_as, add, (taps, state))
    outs = project(x, weights, dtypes, norm, read_as=read_as, add=add)
    n = len(taps)
    *convolved, state = short_convs(outs[:n], taps, state, lengths)
    return [*convolved, *outs[n:], state]


__all__ = ["ShortConvs", "project"]
