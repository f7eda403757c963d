"""Small building blocks: a bias-free linear map in the PyTorch [out, in] layout, RMSNorm, embedding.

Weights keep the released checkpoint's layout ([out, in]) so the converter copies tensors as they
are and an export back is bit-identical.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence, Union

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.functional.attn_res import DepthMix
from k3jax.functional.norms import rms_norm
from k3jax.implementation import triton_kernels
from k3jax.typing import Array

_HI = jax.lax.Precision.HIGHEST


class Keys:
    """Parameter keys folded from one base key and a Python counter.

    Drawing from an ``nnx.Rngs`` stream updates a Variable per draw, which is slow to trace (minutes
    for the 2.8T-parameter abstract model); modules accept either and the model shares one ``Keys``.
    """

    def __init__(self, key: Array):
        self.key, self.count = key, 0

    @classmethod
    def of(cls, rngs: "nnx.Rngs | Keys") -> "Keys":
        return rngs if isinstance(rngs, Keys) else cls(rngs.params())

    def __call__(self) -> Array:
        self.count += 1
        return jax.random.fold_in(self.key, self.count)


Rngs = Union[nnx.Rngs, Keys]


def normal(rngs: Rngs, shape: tuple[int, ...], std: float, dtype=jnp.float32) -> Array:
    key = rngs() if isinstance(rngs, Keys) else rngs.params()
    return (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


class Linear(nnx.Module):
    """y = x W^T with W [out, in] (no bias)."""

    def __init__(self, d_in: int, d_out: int, *, rngs: Rngs, param_dtype=jnp.float32):
        self.weight = nnx.Param(normal(rngs, (d_out, d_in), d_in**-0.5, param_dtype))

    def __call__(self, x: Array) -> Array:
        return jnp.einsum("...i,oi->...o", x, self.weight[...].astype(x.dtype), precision=_HI)


# Rows of x up to which ``project`` takes the one-kernel matvecs: on the H200 the kernel matched XLA's
# einsums at one row and took twice their time at eight (benchmarks/RESULTS.md, issue 4).
MATVEC_KERNEL_ROWS = 1
# Widest ``Activated`` input that the matvec kernel computes in its prologue (each of its programs
# recomputes the activation over the whole row): on the H200 at mini's shapes (benchmarks/RESULTS.md,
# issue 4) the shared expert's 768-wide SiTU in the kernel took 10.5 us a call against 15.4 for XLA's
# act + einsum, the dense MLP's 5632-wide one 14.1-16.4 us against 11.0: wider inputs stay on XLA.
ACT_PROLOGUE_MAX_WIDTH = 1024
# Whether the Pallas path off TPU mixes a Block AttnRes ``DepthMix`` and norms it in one small kernel
# (``pallas_kernels.depth_mix``) at any number of rows (prefill chunks, batched decode), not only where the matvec
# kernel reads it (one row); False: XLA's fusions there (a switch for the benchmarks' variants). On the H200 `mini`'s
# B=64 step took 2.26 against 2.40 ms, B=8 1.57 against 1.65 (medians), an 8K prefill 55.3 against 55.4 and 52.3
# against 52.3 on a second lease (benchmarks/RESULTS.md, issue 4, twenty-ninth and thirtieth sessions).
MIX_KERNEL_ANY_ROWS = True
# Whether ``project``'s kernel path adds its ``add`` arrays in the matvec kernel (else XLA adds after
# it; a switch for ``benchmarks/decode_variants.py``).
ADD_IN_KERNEL = True


def _matvec_kernel_fits(rows: int, x_dtype, weights: Sequence[Array], dtypes: Sequence) -> bool:
    """The Pallas path, one row (a batch-1 decode step), off TPU, and operands the kernel reads
    exactly as the einsums would: each weight in the product's dtype (or the product in float32),
    and x too unless every product has one dtype (the kernel then rounds x to it)."""
    if not triton_kernels():
        return False
    exact = lambda dtype, dt: dtype == dt or dt == jnp.float32
    uniform = len({jnp.dtype(dt) for dt in dtypes}) == 1
    return 0 < rows <= MATVEC_KERNEL_ROWS and all(exact(w.dtype, dt) and (uniform or exact(x_dtype, dt))
                                                  for w, dt in zip(weights, dtypes))


@dataclasses.dataclass(frozen=True)
class Activated:
    """act(gate, up) [..., F], an input of ``project``: where project takes the matvec kernel, the
    kernel computes it in its prologue (no XLA kernel before it), else ``value()`` does."""

    act: Callable[[Array, Array], Array]
    gate: Array
    up: Array

    @property
    def shape(self) -> tuple[int, ...]:
        return self.gate.shape

    @property
    def dtype(self):
        return _input_dtype(self, None)

    def value(self) -> Array:
        return self.act(self.gate, self.up)


def materialize(x: "Array | DepthMix") -> Array:
    """x itself, or a ``DepthMix``'s value: for readers that need the array."""
    return x.value() if isinstance(x, DepthMix) else x


def _mixed(mix: DepthMix, norm: "RMSNorm | None", kernel: bool) -> tuple[Array, "RMSNorm | None"]:
    """A Block AttnRes mix's value and the norm still to apply: with ``kernel``, mixed and normed in
    one small kernel (``pallas_kernels.depth_mix``), else by XLA (the norm left to the caller)."""
    if not kernel:
        return mix.value(), norm
    from pallas_kernels.depth_mix import mix_norm

    rows = mix.reshape(-1, mix.shape[-1])
    out = mix_norm(rows.partial, rows.blocks, rows.n_blocks, rows.norm_weight, rows.proj_weight, rows.eps,
                   None if norm is None else (norm.weight[...], norm.eps))
    return out.reshape(mix.shape), None


def _input_dtype(x: "Array | DepthMix | Activated", read_as) -> jnp.dtype:
    """The dtype of project's x once rounded to read_as and activated (a norm keeps it)."""
    read = lambda a: jax.ShapeDtypeStruct(a.shape, read_as or a.dtype)
    return jax.eval_shape(x.act, read(x.gate), read(x.up)).dtype if isinstance(x, Activated) else read(x).dtype


def _prologue_kwargs(x: "Array | Activated", norm: "RMSNorm | None", read_as, dtypes: Sequence) -> tuple[Array, dict]:
    """x's rows [M, D] and the matvec kernel's prologue arguments (``pallas_kernels.matvec.matvecs``)
    that make project's input from them."""
    rows = lambda a: a.reshape(-1, a.shape[-1])
    kwargs = dict(read_as=read_as)
    if norm is not None:
        kwargs["norm"] = (norm.weight[...], norm.eps)
    if len({jnp.dtype(dt) for dt in dtypes}) == 1:
        kwargs["x_dtype"] = dtypes[0]
    if isinstance(x, Activated):
        kwargs["act"] = (x.act, rows(x.up))
        x = x.gate
    return rows(x), kwargs


def takes_matvec_kernel(x: "Array | DepthMix | Activated", weights: Sequence[Array], dtypes: Sequence | None = None,
                        read_as=None) -> bool:
    """Whether ``project`` with these arguments computes its maps in the matvec kernel."""
    x_dtype = _input_dtype(x, read_as)
    dtypes = [x_dtype] * len(weights) if dtypes is None else list(dtypes)
    return _matvec_kernel_fits(math.prod(x.shape[:-1]), x_dtype, weights, dtypes) and not (
        isinstance(x, Activated) and x.shape[-1] > ACT_PROLOGUE_MAX_WIDTH)


def project(x: "Array | DepthMix | Activated", weights: Sequence[Array], dtypes: Sequence | None = None,
            norm: "RMSNorm | None" = None, *, read_as=None, add: Sequence[Array] = (),
            conv: tuple[Sequence[Array], Array] | None = None) -> list[Array]:
    """x [..., D] times each weight [N_i, D]^T, as ``einsum(x.astype(dt), w.astype(dt))`` with dt =
    dtypes[i] (default x's dtype as prepared below; float32 sums): what ``Linear`` computes, or the
    router's float32 logits. x is prepared first, in this order: a Block AttnRes ``DepthMix`` is
    mixed (and normed with it by ``pallas_kernels.depth_mix`` on the Pallas path off TPU:
    ``MIX_KERNEL_ANY_ROWS``); x (an ``Activated``'s two inputs) rounded to ``read_as``; an ``Activated`` applied;
    RMS-normed by ``norm``. ``add`` (with one weight only): arrays [..., N] added to the output in
    turn, each sum rounded to the output's dtype (a residual, a shared expert's output).

    The maps that read one input (a layer's projections) go together so that, on the Pallas path
    for one row (batch-1 decode) off TPU, one kernel computes them all, x's preparation included
    (``pallas_kernels.matvec``; an ``Activated`` only up to ``ACT_PROLOGUE_MAX_WIDTH``), instead of
    one small kernel each; a mix before them is then computed with the norm in one more small
    kernel (``pallas_kernels.depth_mix``).

    ``conv`` = (taps, state), only where that kernel runs (``takes_matvec_kernel``): the first outputs
    go on through a decode step of short convs and SiLU inside it (``matvecs``' ``conv``: float32
    outputs), and the new conv state is returned after the outputs."""
    if isinstance(x, DepthMix) and read_as is not None:
        raise ValueError("project: read_as applies to an array or an Activated, not a DepthMix")
    if add and len(weights) != 1:
        raise ValueError(f"project: add needs exactly one weight, got {len(weights)}")
    kernel = takes_matvec_kernel(x, weights, dtypes, read_as)
    if conv is not None and not kernel:
        raise ValueError("project: conv needs the matvec kernel path (takes_matvec_kernel: one row, Pallas, "
                         "off TPU)")
    dtypes = [_input_dtype(x, read_as)] * len(weights) if dtypes is None else list(dtypes)
    if isinstance(x, DepthMix):
        x, norm = _mixed(x, norm, kernel or (MIX_KERNEL_ANY_ROWS and triton_kernels()))
    if kernel:
        from pallas_kernels.matvec import matvecs

        lead = x.shape[:-1]
        rows, kwargs = _prologue_kwargs(x, norm, read_as, dtypes)
        fused = ADD_IN_KERNEL and all(jnp.dtype(a.dtype) == jnp.dtype(dtypes[0]) for a in add)
        flat_adds = [[a.reshape(rows.shape[0], -1) for a in add]] if fused and add else None
        outs = list(matvecs(rows, list(weights), dtypes, add=flat_adds, conv=conv, **kwargs))
        state = [outs.pop()] if conv is not None else []
        outs = [y.reshape(*lead, y.shape[-1]) for y in outs]
        return [add_rounded(outs[0], add)] if add and not fused else outs + state
    if read_as is not None:
        x = x.astype(read_as) if not isinstance(x, Activated) else Activated(
            x.act, *(a.astype(read_as) for a in (x.gate, x.up)))
    if isinstance(x, Activated):
        x = x.value()
    if norm is not None:
        x = norm(x)
    outs = [jnp.einsum("...i,oi->...o", x.astype(dt), w.astype(dt), precision=_HI) for w, dt in zip(weights, dtypes)]
    return [add_rounded(outs[0], add)] if add else outs


def add_rounded(y: Array, add: Sequence[Array]) -> Array:
    """y plus each of ``add`` in turn, each sum rounded to y's dtype."""
    for a in add:
        y = (y + a).astype(y.dtype)
    return y


class RMSNorm(nnx.Module):
    """RMSNorm over the last axis with a learned scale (float32 inside)."""

    def __init__(self, dim: int, eps: float, *, param_dtype=jnp.float32):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))

    def __call__(self, x: Array) -> Array:
        return rms_norm(x, self.weight[...], self.eps)


class Embed(nnx.Module):
    """Token embedding table [V, D]."""

    def __init__(self, vocab: int, dim: int, *, rngs: Rngs, param_dtype=jnp.float32):
        self.weight = nnx.Param(normal(rngs, (vocab, dim), 1.0, param_dtype))

    def __call__(self, tokens: Array) -> Array:
        return jnp.take(self.weight[...], tokens, axis=0)


__all__ = ["Rngs", "Keys", "Linear", "RMSNorm", "Embed", "normal", "materialize", "project", "takes_matvec_kernel",
           "add_rounded", "Activated",
           "ACT_PROLOGUE_MAX_WIDTH", "ADD_IN_KERNEL", "MATVEC_KERNEL_ROWS", "MIX_KERNEL_ANY_ROWS"]
