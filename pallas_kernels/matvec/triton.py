"""Several matrix-vector products of one input in one kernel (decode-step projections).

``matvecs(x, weights)`` returns ``x @ W_i^T`` for each weight W_i [N_i, D] (PyTorch [out, in] layout)
and x [M, D] with few rows (decode: M <= ``MAX_ROWS``). XLA runs each small product as its own
kernel, at 1-1.5 TB/s for 0.5-4 MB of weights plus a launch each; here one ``pallas_call`` covers
them all. Its 1-D grid runs over the row blocks of all the weights in turn: the ranges of program
ids that belong to each weight are fixed at trace time (``_Part``), and one ``pl.when`` branch per
weight loads that weight's [bn, bk] tiles, steps over D in chunks of bk, and stores its [M, bn]
block of that weight's output. No weight is copied or concatenated: the kernel gets each whole
array and slices it itself.

Arithmetic: every product is float32(x) * float32(W), summed in float32 (per output, a float32
[bn] accumulator per row of x that adds one chunk's row sums a step), rounded once to the output
dtype: ``jnp.einsum`` at precision HIGHEST on float32 operands, up to summation order. The products
run on the CUDA cores, not the matrix units: at M <= 16 the kernel is bound by reading the weights.
``MatvecBlocks.dot`` (unmeasured) puts them on the matrix units instead: x's rows padded to 16 (masked
loads, no copy) times a [bn >= 16, bk] weight tile, bf16 operands where x and W are both bf16 (their
products are exact in float32), else float32 operands at precision HIGHEST; float32 accumulation.

Input prologue (``Prologue``): the kernel can make its x from what the XLA ops before it would
have read, so that no small XLA kernel (and its launch) sits between the producer and the matvec:
a float32 x rounded to bf16 (the routed experts' sums before the latent norm), a gated activation
of two inputs (a shared expert's act(gate, up)), an RMS norm over the row, and a last rounding (to
the products' dtype). Every program recomputes it from x (small: M x D, from L2): a norm's statistics
come from the tile where it holds the whole row, else from one pass over x before the product loop.
(KDA's gated per-head output norm was a prologue too, for o_proj; on the H200 that step measured
2-3% slower than XLA's norm and einsum, so it went: benchmarks/HISTORY.md, 2026-12-01.)

Output epilogue (``add``): arrays added to an output after its rounding, each sum rounded again (the
residual adds after a layer's last projection, and a MoE's shared-expert output), so that no XLA add
kernel follows the matvec.

Short-conv epilogue (``conv``): the first outputs can go on through one decode step of KDA's causal
short convolutions and SiLU, with the conv state updated where it lies (``pallas_kernels.kda.triton_short_conv``'s
arithmetic): a program owns its output rows' channels, so it reads their state and taps, and writes
their state, alone. The conv kernel (and its launch) between the projections and their reader goes.

Ragged shapes: a weight of fewer rows than bn gets a block of next_power_of_2(N_i) rows (Triton
blocks are powers of two); a last block that runs past N_i loads with a row mask (zeros) and stores
with the same mask; D need not be a multiple of bk (column mask on the last chunk). x and the
weights may be bf16 or float32, independently.

Tiles (``MatvecBlocks``, ``DEFAULT_BLOCKS``): bn weight rows per program, bk columns per step,
Triton's num_warps and num_stages. Defaults from two H200 sweeps at mini's shapes (benchmarks/HISTORY.md,
2026-11-30 and 2026-12-01; the sweep's script has since been removed): at M = 1, bn 4, bk 2048, 4 warps took
6.59 us for the KDA group (9.0 MB; XLA's einsums 7.94 us; bn 8 bk 1024 7.62 us) and 7.03 us for the
MoE group (11.0 MB; XLA 10.20 us; bn 8 bk 1024 7.70 us). At M = 8 the kernel is 1.5-3x slower than
XLA, and so is the dot form on the MoE group (its float32 router): the layers take it at M = 1
(``KernelPolicy.matvec_max_rows``). On GPU the kernel lowers through Pallas' Triton backend (chosen by
passing Triton compiler params); on CPU it runs in interpret mode (``pallas_kernels._platform.interpret``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import _platform
from k3jax.typing import Array
from pallas_kernels._triton import triton_params
from pallas_kernels.kda.triton_short_conv import conv_silu_values

MAX_ROWS = 16
DOT_ROWS = 16  # x's rows as the matrix units' operand (MAX_ROWS padded; Triton's dot needs >= 16)
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


@dataclasses.dataclass(frozen=True)
class MatvecBlocks:
    """bn: weight rows per program (a power of two); bk: columns of D per loop step (a power of
    two); num_warps, num_stages: Triton launch and software-pipelining depth (ignored in interpret
    mode); dot: products on the matrix units (x's rows padded to DOT_ROWS, bn >= 16) instead of one
    row reduction per row of x (unmeasured)."""

    bn: int = 8
    bk: int = 1024
    num_warps: int = 4
    num_stages: int = 3
    dot: bool = False

    def __post_init__(self):
        for name in ("bn", "bk"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"MatvecBlocks.{name} = {value}: must be a power of two")
        if self.dot and min(self.bn, self.bk) < DOT_ROWS:
            raise ValueError(f"MatvecBlocks.dot needs bn and bk >= {DOT_ROWS}, got {self.bn} and {self.bk}")


DEFAULT_BLOCKS = MatvecBlocks(bn=4, bk=2048, num_warps=4, num_stages=3)


class _Part(NamedTuple):
    """The programs [first, first + blocks) compute one weight's output, bn rows each."""

    first: int
    blocks: int
    bn: int


def _parts(rows: Sequence[int], bn: int, min_bn: int) -> tuple[_Part, ...]:
    """Program ranges for weights of the given row counts, in order: blocks of bn rows, or of the
    next power of two above a smaller weight's rows (at least min_bn)."""
    parts, first = [], 0
    for n in rows:
        block = max(min(bn, pl.next_power_of_2(n)), min_bn)
        parts.append(_Part(first, pl.cdiv(n, block), block))
        first += parts[-1].blocks
    return tuple(parts)


def _tile_mask(row_mask: Array | None, col_mask: Array | None, shape: tuple[int, int]) -> Array | None:
    """[rows, cols] mask of the valid rows and columns, or None where all are valid."""
    if row_mask is None and col_mask is None:
        return None
    mask = jnp.ones(shape, bool)
    if row_mask is not None:
        mask &= row_mask[:, None]
    if col_mask is not None:
        mask &= col_mask[None, :]
    return mask


def _load(ref, mask: Array | None) -> Array:
    """ref's block, zeros where mask (if any) is False."""
    return pltriton.load(ref, mask=mask, other=None if mask is None else 0)


def _valid(start, size: int, bound: int) -> Array | None:
    """[size] mask of start + i < bound, or None where bound is a multiple of size."""
    return start + jax.lax.broadcasted_iota(jnp.int32, (size,), 0) < bound if bound % size else None


@dataclasses.dataclass(frozen=True)
class Prologue:
    """What the kernel makes of x before the products (static; each step optional), in this order:

    1. x (and act's second input) rounded to ``read_as``;
    2. x = act(x, second input) (``act``: a jnp function of two [rows, bk] tiles);
    3. with ``eps``: RMS norm over the row with a weight [D], in float32, rounded to x's dtype
       (``k3jax.functional.norms.rms_norm``);
    4. rounded to ``dtype``.

    The norm's statistics come from the tile where bk covers the row, else from one pass over x
    before the product loop."""

    read_as: jnp.dtype | None = None
    act: Callable | None = None
    eps: float | None = None
    dtype: jnp.dtype | None = None


class _XRefs(NamedTuple):
    """x [M, D] and what the prologue reads beside it: act's second input [M, D], the norm weight
    [1, D] (None where unused)."""

    x: object
    second: object
    norm: object


def _x_tiles(refs: _XRefs, prologue: Prologue, rows: int, bk: int, firsts) -> "callable":
    """x_at(row0, col0) -> the prologue's x [rows, bk] at those rows and columns (zeros past x's
    ends), for row0 in ``firsts``."""
    m_rows, depth = refs.x.shape
    f32, p = jnp.float32, prologue

    def load(ref, row0, col0):
        mask = _tile_mask(_valid(row0, rows, m_rows) if rows > 1 else None, _valid(col0, bk, depth), (rows, bk))
        return _load(ref.at[pl.ds(row0, rows), pl.ds(col0, bk)], mask)

    def read(ref, row0, col0):
        tile = load(ref, row0, col0)
        return tile if p.read_as is None else tile.astype(p.read_as)

    def source(row0, col0):
        x = read(refs.x, row0, col0)
        return x if p.act is None else p.act(x, read(refs.second, row0, col0))

    finish = (lambda x: x) if p.dtype is None else (lambda x: x.astype(p.dtype))
    if p.eps is None:
        return lambda row0, col0: finish(source(row0, col0))

    if depth > bk:
        def inverse_rms(row0):
            def squares(s, total):
                x = source(row0, pl.multiple_of(s * bk, bk)).astype(f32)
                return total + jnp.sum(x * x, axis=1, keepdims=True)

            total = jax.lax.fori_loop(0, pl.cdiv(depth, bk), squares, jnp.zeros((rows, 1), f32))
            return jax.lax.rsqrt(total / depth + p.eps)

        inverse = {row0: inverse_rms(row0) for row0 in firsts}
        inverse_at = lambda row0, x: inverse[row0]
    else:  # the tile holds the whole row (zeros past its end)
        inverse_at = lambda row0, x: jax.lax.rsqrt(jnp.sum(x * x, axis=1, keepdims=True) / depth + p.eps)

    def x_at(row0, col0):
        x = source(row0, col0)
        x32 = x.astype(f32)
        weight = _load(refs.norm.at[:, pl.ds(col0, bk)], _tile_mask(None, _valid(col0, bk, depth), (1, bk)))
        return finish((x32 * inverse_at(row0, x32) * weight.astype(f32)).astype(x.dtype))

    return x_at


class _ConvRefs(NamedTuple):
    """One output's short conv: its taps [N, W] float32, the state [M, W-1, C] float32 (read and written
    through this one ref), the output's first channel in it, and the dtype the product is rounded to
    before it enters the conv."""

    taps: object
    state: object
    channel0: int
    round_to: jnp.dtype


def _conv_silu(conv: _ConvRefs, m: int, row0, bn: int, row_mask: Array | None) -> Callable[[Array], Array]:
    """The short-conv epilogue of x's row m over the output rows [row0, row0 + bn): its state and taps
    are loaded now (before the products, which they do not wait for); the returned function takes the
    row's float32 sums [1, bn], rounds them to ``round_to``, stores the state moved up one token and
    returns silu(conv) in float32, as ``conv_silu_step``."""
    rows = conv.state.shape[1]
    state_mask, taps_mask = (None, None) if row_mask is None else (row_mask[None, None, :], row_mask[:, None])
    at = lambda r: conv.state.at[pl.ds(m, 1), pl.ds(r, 1), pl.ds(conv.channel0 + row0, bn)]
    past = [_load(at(r), state_mask).reshape(1, bn) for r in range(rows)]
    taps = [_load(conv.taps.at[pl.ds(row0, bn), pl.ds(j, 1)], taps_mask).reshape(1, bn) for j in range(rows + 1)]

    def apply(sums: Array) -> Array:
        y, new_rows = conv_silu_values(past, sums.astype(conv.round_to).astype(jnp.float32), taps)
        for r, value in enumerate(new_rows):
            pltriton.store(at(r), value.reshape(1, 1, bn), mask=state_mask)
        return y

    return apply


def _block_product(x_refs: _XRefs, w_ref, add_refs, o_ref, row0, *, bn: int, bk: int, dot: bool,
                   prologue: Prologue, conv: _ConvRefs | None = None) -> None:
    """o[:, row0:row0 + bn] = x @ w[row0:row0 + bn]^T in float32, rows past w's end masked (x as the
    prologue makes it), rounded to o's dtype, then each addend's block added in turn (in float32,
    rounded to o's dtype after each: ``(y + a).astype(y.dtype)``).

    Rows form: a float32 [bn] sum per row of x, each step adding the row sums of w * x_m. Dot form:
    a [DOT_ROWS, bn] float32 accumulator from x (rows past M loaded as zeros) . w^T on the matrix
    units, bf16 operands where both are bf16, else float32 at precision HIGHEST (exact products).
    With ``conv`` (rows form only), each row's sums go through ``_conv_silu`` instead of the rounding
    and addends."""
    m_rows, depth = x_refs.x.shape
    row_mask = _valid(row0, bn, w_ref.shape[0])
    convs = None if conv is None else [_conv_silu(conv, m, row0, bn, row_mask) for m in range(m_rows)]
    x_at = _x_tiles(x_refs, prologue, DOT_ROWS if dot else 1, bk, [0] if dot else range(m_rows))

    def step(s, acc):
        col0 = pl.multiple_of(s * bk, bk)
        col_mask = _valid(col0, bk, depth)
        w = _load(w_ref.at[pl.ds(row0, bn), pl.ds(col0, bk)], _tile_mask(row_mask, col_mask, (bn, bk)))
        if dot:
            x = x_at(0, col0)
            if not x.dtype == w.dtype == jnp.bfloat16:
                x, w = x.astype(jnp.float32), w.astype(jnp.float32)
            return acc + pltriton.dot(x, w, trans_b=True, precision=jax.lax.Precision.HIGHEST)
        w = w.astype(jnp.float32)
        return tuple(acc[m] + jnp.sum(w * x_at(m, col0).astype(jnp.float32), axis=1) for m in range(m_rows))

    init = jnp.zeros((DOT_ROWS, bn), jnp.float32) if dot else (jnp.zeros((bn,), jnp.float32),) * m_rows
    acc = jax.lax.fori_loop(0, pl.cdiv(depth, bk), step, init)

    def epilogue(y, rows, mask):
        y = y.astype(o_ref.dtype)
        for a_ref in add_refs:
            a = _load(a_ref.at[rows, pl.ds(row0, bn)], mask)
            y = (y.astype(jnp.float32) + a.astype(jnp.float32)).astype(o_ref.dtype)
        return y

    if dot:
        rows, mask = pl.ds(0, DOT_ROWS), _tile_mask(_valid(0, DOT_ROWS, m_rows), row_mask, (DOT_ROWS, bn))
        pltriton.store(o_ref.at[rows, pl.ds(row0, bn)], epilogue(acc, rows, mask), mask=mask)
        return
    out_mask = None if row_mask is None else row_mask[None, :]
    for m in range(m_rows):
        rows = pl.ds(m, 1)
        y = epilogue(acc[m][None, :], rows, out_mask) if convs is None else convs[m](acc[m][None, :])
        pltriton.store(o_ref.at[rows, pl.ds(row0, bn)], y, mask=out_mask)


def _matvecs_kernel(*refs, parts: tuple[_Part, ...], n_adds: tuple[int, ...], bk: int, dot: bool,
                    prologue: Prologue, conv_rounding: tuple[jnp.dtype, ...] = ()):
    """Refs: x [M, D]; act's second input [M, D] (with act), the norm weight [1, D] (with a norm);
    the weights [N_i, D]; each weight's addends [M, N_i] (n_adds[i] of them), weight by weight; with
    short convs (``conv_rounding``: the dtype of each convolved output's product, the first outputs),
    their taps [N_i, W] and the state input [M, W-1, C]; then the outputs [M, N_i] (whole arrays) and, with
    short convs, the state output (the state input's buffer, aliased: read and written through it)."""
    uses = (True, prologue.act is not None, prologue.eps is not None)
    refs = list(refs)
    x_refs = _XRefs(*(refs.pop(0) if used else None for used in uses))
    w_refs = [refs.pop(0) for _ in parts]
    add_refs = [[refs.pop(0) for _ in range(n)] for n in n_adds]
    taps_refs, state = [refs.pop(0) for _ in conv_rounding], None
    if conv_rounding:
        refs.pop(0)  # the state input: read through its aliased output
        state = refs.pop()
    channel0 = [sum(w.shape[0] for w in w_refs[:i]) for i in range(len(conv_rounding))]
    convs = [_ConvRefs(t, state, c, r) for t, c, r in zip(taps_refs, channel0, conv_rounding)]
    convs += [None] * (len(parts) - len(convs))
    program = pl.program_id(0)
    for w_ref, adds, o_ref, part, conv in zip(w_refs, add_refs, refs, parts, convs):
        @pl.when((program >= part.first) & (program < part.first + part.blocks))
        def _(w_ref=w_ref, adds=adds, o_ref=o_ref, part=part, conv=conv):
            row0 = pl.multiple_of((program - part.first) * part.bn, part.bn)
            _block_product(x_refs, w_ref, adds, o_ref, row0, bn=part.bn, bk=bk, dot=dot, prologue=prologue, conv=conv)


@functools.partial(jax.jit, static_argnames=("out_dtypes", "prologue", "blocks", "interpret"))
def _matvecs(x, second, norm_weight, weights, adds, taps, state, *, out_dtypes, prologue: Prologue,
             blocks: MatvecBlocks, interpret: bool):
    m_rows, depth = x.shape
    min_bn = DOT_ROWS if blocks.dot else 1
    parts = _parts([w.shape[0] for w in weights], blocks.bn, min_bn)
    bk = max(min(blocks.bk, pl.next_power_of_2(depth)), min_bn)
    params = triton_params(blocks.num_warps, blocks.num_stages, interpret)
    inputs = [a for a in (second, None if norm_weight is None else norm_weight.reshape(1, -1)) if a is not None]
    operands = [x, *inputs, *weights, *(a for weight_adds in adds for a in weight_adds)]
    out_shape = [jax.ShapeDtypeStruct((m_rows, w.shape[0]), jnp.float32 if i < len(taps) else d)
                 for i, (w, d) in enumerate(zip(weights, out_dtypes))]
    aliases = {}
    if taps:
        operands += [*taps, state]
        aliases = {len(operands) - 1: len(out_shape)}
        out_shape.append(jax.ShapeDtypeStruct(state.shape, state.dtype))
    return pl.pallas_call(
        functools.partial(_matvecs_kernel, parts=parts, n_adds=tuple(len(a) for a in adds), bk=bk, dot=blocks.dot,
                          prologue=prologue, conv_rounding=out_dtypes[:len(taps)]),
        out_shape=tuple(out_shape),
        grid=(parts[-1].first + parts[-1].blocks,),
        input_output_aliases=aliases,
        compiler_params=params,
        interpret=interpret,
        name="matvecs",
    )(*operands)


def _prologue_dtype(x: Array, second: Array | None, prologue: Prologue):
    """The dtype of the prologue's x (norms keep their input's)."""
    if prologue.dtype is not None:
        return prologue.dtype
    read = lambda a: jax.ShapeDtypeStruct(a.shape, prologue.read_as or a.dtype)
    return (read(x) if prologue.act is None else jax.eval_shape(prologue.act, read(x), read(second))).dtype


def _check_dtype(name: str, dtype) -> None:
    if dtype is not None and jnp.dtype(dtype) not in DTYPES:
        raise ValueError(f"{name} must be bfloat16 or float32, got {dtype}")


def matvecs(x: Array, weights: Sequence[Array], out_dtypes: Sequence | None = None, *,
            read_as=None, act: tuple[Callable, Array] | None = None, norm: tuple[Array, float] | None = None,
            x_dtype=None, add: Sequence[Sequence[Array]] | None = None,
            conv: tuple[Sequence[Array], Array] | None = None, blocks: MatvecBlocks | None = None,
            interpret: bool | None = None) -> tuple[Array, ...]:
    """x [M, D] (M <= MAX_ROWS), weights [N_i, D] -> (x' @ W_i^T [M, N_i] in out_dtypes[i], ...),
    x' what the prologue (``Prologue``, in this order) makes of x inside the kernel:

    - ``read_as``: x (and act's second input) rounded to this dtype first;
    - ``act`` = (fn, y [M, D]): x' = fn(x, y), a gated activation (``k3jax.functional.moe``);
    - ``norm`` = (weight [D], eps): RMS-normed over the row as ``k3jax.functional.norms.rms_norm``;
    - ``x_dtype``: x' rounded to this dtype last (the products' x operand).

    bf16 or float32 operands; float32 products and sums, one rounding to the output dtype (default
    x'.dtype). ``add``: per weight, arrays [M, N_i] in its output dtype added to its output in turn,
    each sum rounded to that dtype (as ``y + a`` would be), so that no XLA add follows the kernel.
    ``conv`` = (taps, state): the first n = len(taps) outputs (no addends) go on through one step of
    short causal convs and SiLU, as ``pallas_kernels.kda.triton_short_conv.conv_silu_step`` with their rounded
    values as its inputs: taps[i] [N_i, W] float32, state [M, W-1, N_0 + ... + N_{n-1}] float32; those
    outputs are float32, and the state moved up one token comes last (written over the state's
    buffer). One kernel for all the weights. ``blocks`` default: ``DEFAULT_BLOCKS``, read at each call."""
    weights = tuple(weights)
    if x.ndim != 2 or not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"x must be [M, D] with 1 <= M <= {MAX_ROWS}, got shape {x.shape}")
    if not weights:
        raise ValueError("matvecs needs at least one weight")
    for i, w in enumerate(weights):
        if w.ndim != 2 or w.shape[1] != x.shape[1] or w.shape[0] < 1:
            raise ValueError(f"weight {i} must be [N, D] with D = {x.shape[1]} (x's), got shape {w.shape}")
    fn, second = (None, None) if act is None else act
    if second is not None and second.shape != x.shape:
        raise ValueError(f"act's second input must have x's shape {x.shape}, got {second.shape}")
    for operand in (x, *weights, *(() if second is None else (second,))):
        _check_dtype("operands", operand.dtype)
    _check_dtype("read_as", read_as)
    _check_dtype("x_dtype", x_dtype)
    norm_weight, eps = (None, None) if norm is None else (norm[0], float(norm[1]))
    if norm_weight is not None and (norm_weight.shape != (x.shape[1],) or jnp.dtype(norm_weight.dtype) not in DTYPES):
        raise ValueError(f"norm weight must be [D] = [{x.shape[1]}] bf16 or float32, got {norm_weight.shape} "
                         f"{norm_weight.dtype}")
    prologue = Prologue(read_as=None if read_as is None else jnp.dtype(read_as), act=fn, eps=eps,
                        dtype=None if x_dtype is None else jnp.dtype(x_dtype))
    out_dtypes = (_prologue_dtype(x, second, prologue),) * len(weights) if out_dtypes is None else tuple(out_dtypes)
    if len(out_dtypes) != len(weights):
        raise ValueError(f"{len(out_dtypes)} out_dtypes for {len(weights)} weights")
    add = tuple(() for _ in weights) if add is None else tuple(tuple(a) for a in add)
    if len(add) != len(weights):
        raise ValueError(f"add must hold one sequence of addends per weight ({len(weights)}), got {len(add)}")
    for i, (adds, w, dt) in enumerate(zip(add, weights, out_dtypes)):
        for a in adds:
            if a.shape != (x.shape[0], w.shape[0]) or jnp.dtype(a.dtype) != jnp.dtype(dt):
                raise ValueError(f"addends of output {i} must be [M, N] = {[x.shape[0], w.shape[0]]} in its dtype "
                                 f"{jnp.dtype(dt)}, got {a.shape} {a.dtype}")
    taps, state = ((), None) if conv is None else (tuple(conv[0]), conv[1])
    blocks = blocks or DEFAULT_BLOCKS
    if conv is not None:
        _check_conv(taps, state, weights, add, x.shape[0], blocks)
    interpret = _platform.interpret() if interpret is None else interpret
    return _matvecs(x, second, norm_weight, weights, add, taps, state,
                    out_dtypes=tuple(jnp.dtype(d) for d in out_dtypes), prologue=prologue, blocks=blocks,
                    interpret=interpret)


def _check_conv(taps: tuple[Array, ...], state: Array, weights: tuple[Array, ...], add: tuple, m_rows: int,
                blocks: MatvecBlocks) -> None:
    if not 0 < len(taps) <= len(weights):
        raise ValueError(f"conv needs taps for 1 to {len(weights)} outputs (the first ones), got {len(taps)}")
    if blocks.dot:
        raise ValueError("conv needs the rows form of the products (MatvecBlocks.dot False)")
    width = taps[0].shape[-1] if taps[0].ndim == 2 else 0
    for i, (w, t) in enumerate(zip(weights, taps)):
        if t.shape != (w.shape[0], width) or t.dtype != jnp.float32 or width < 2:
            raise ValueError(f"conv taps {i} must be float32 [N, W] = [{w.shape[0]}, W >= 2] with taps 0's W, "
                             f"got {t.dtype} {t.shape}")
        if add[i]:
            raise ValueError(f"output {i} has both a conv and addends")
    channels = sum(w.shape[0] for w in weights[:len(taps)])
    if state.shape != (m_rows, width - 1, channels) or state.dtype != jnp.float32:
        raise ValueError(f"conv state must be float32 [M, W-1, channels] = [{m_rows}, {width - 1}, {channels}], "
                         f"got {state.dtype} {state.shape}")


__all__ = ["DEFAULT_BLOCKS", "MAX_ROWS", "MatvecBlocks", "Prologue", "matvecs"]
