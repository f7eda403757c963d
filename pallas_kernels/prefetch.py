"""Ask the GPU's L2 cache for weights ahead of the kernel that reads them (batch-1 decode).

At one token a decode step is a chain of small kernels, many of which wait on latency, not on
memory, while the matvecs that follow them stream their weights from DRAM. ``prefetch_l2(arrays,
after)`` is one Mosaic GPU kernel whose programs issue TMA L2 prefetches (``cp.async.bulk.prefetch``,
``plgpu.async_prefetch``) of boxes of ``arrays`` and return: it holds no shared memory, waits for
nothing and finishes in about a launch's time, while the copy engines fill L2 behind it. Its result
is a token (float32 [programs], never written, never read for its value): passed to the matvec that
reads the arrays as an ``after`` operand (``pallas_kernels.matvec``), it keeps the prefetch in the
step, ahead of that matvec; ``after`` here makes the prefetch wait for the arrays' first moment of
use (a sub-block's residual input). With the decode step's command buffer in concurrent order
(``k3jax.inference``) the prefetch then runs beside the chain of kernels in between.

Each array [N, D] is cut into boxes of at most BOX x BOX elements (TMA's largest box); box b goes to
program b mod programs, and a box that would cross an edge is moved back inside (so some edge
elements are asked for twice). A prefetch is a hint with no effect on any value, so in interpret
mode (CPU) the kernel is not run and the token is zeros.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from k3jax.implementation import pallas_interpret
from k3jax.typing import Array

PROGRAMS = 132  # the H200's SMs: one program each
BOX = 256  # TMA's largest box, elements per dimension


def box_grid(shape: tuple[int, int]) -> tuple[int, int, int]:
    """(rows, cols, boxes): the box of an array of this shape and how many cover it."""
    n, d = shape
    rows, cols = min(n, BOX), min(d, BOX)
    return rows, cols, pl.cdiv(n, rows) * pl.cdiv(d, cols)


def box_origin(box, shape: tuple[int, int]):
    """(row0, col0) of box ``box`` (row-major over the box grid, moved back inside at the edges)."""
    n, d = shape
    rows, cols, _ = box_grid(shape)
    per_row = pl.cdiv(d, cols)
    return jnp.minimum((box // per_row) * rows, n - rows), jnp.minimum((box % per_row) * cols, d - cols)


def _prefetch_kernel(*refs, n_after: int, programs: int):
    """Refs (all in GMEM): the ``after`` arrays (not read), the arrays [N_i, D_i], the token. Program p
    asks for boxes p, p + programs, ... of each array."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    arrays = refs[n_after:-1]
    program = jax.lax.axis_index("programs")
    for ref in arrays:
        rows, cols, total = box_grid(ref.shape)
        for j in range(pl.cdiv(total, programs)):
            box = program + j * programs

            @pl.when(box < total)
            def _(ref=ref, box=box, rows=rows, cols=cols):
                row0, col0 = box_origin(box, ref.shape)
                plgpu.async_prefetch(ref.at[pl.ds(row0, rows), pl.ds(col0, cols)])


@functools.partial(jax.jit, static_argnames=("programs",))
def _prefetch(arrays, after, *, programs: int):
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return plgpu.kernel(
        functools.partial(_prefetch_kernel, n_after=len(after), programs=programs),
        out_type=jax.ShapeDtypeStruct((programs,), jnp.float32),
        grid=(programs,), grid_names=("programs",),
        compiler_params=plgpu.CompilerParams(unsafe_no_auto_barriers=True),
    )(*after, *arrays)


def prefetch_l2(arrays: Sequence[Array], after: Sequence[Array] = (), *, programs: int = PROGRAMS,
                interpret: bool | None = None) -> Array:
    """Prefetch each of ``arrays`` (2-D, bf16 or float32, rows 16-byte aligned) into L2, after
    ``after``'s producers; returns the token, float32 [programs] (its value means nothing)."""
    arrays, after = tuple(arrays), tuple(after)
    if not arrays:
        raise ValueError("prefetch_l2 needs at least one array")
    for i, a in enumerate(arrays):
        if a.ndim != 2 or jnp.dtype(a.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
            raise ValueError(f"array {i} must be 2-D bf16 or float32, got {a.shape} {a.dtype}")
        if a.shape[1] * a.dtype.itemsize % 16:
            raise ValueError(f"array {i}'s rows must be a multiple of 16 bytes (TMA), got {a.shape} {a.dtype}")
    if programs < 1:
        raise ValueError(f"programs must be positive, got {programs}")
    if pallas_interpret() if interpret is None else interpret:
        return jnp.zeros((programs,), jnp.float32)
    return _prefetch(arrays, after, programs=programs)


__all__ = ["BOX", "PROGRAMS", "box_grid", "box_origin", "prefetch_l2"]
