"""Read weights into the GPU's L2 cache ahead of the kernel that needs them (batch-1 decode).

At one token a decode step is a chain of small kernels, many of which wait on latency, not on
memory, while the matvecs that follow them stream their weights from DRAM. ``prefetch_l2(arrays,
after)`` is one kernel that reads ``arrays`` (so they sit in L2) and returns a token: a float32
[programs] of sums of what it read, which nothing uses for its value. Passed to the next matvec as an
``after`` operand (``pallas_kernels.matvec``), the token makes that matvec wait for the prefetch;
``after`` here makes the prefetch wait for the arrays' producers. With the decode step's command
buffer in concurrent mode (``k3jax.inference``), XLA orders kernels by the buffers they share only,
so the prefetch runs beside the chain of kernels between its ``after`` and its consumer.

Each of ``programs`` programs walks the arrays' row tiles t = program, program + programs, ... (rows
past an array's end masked), a few rows per tile (about 16K elements), and sums them in float32.
Interpret mode on CPU runs the same body.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from k3jax.implementation import pallas_interpret
from k3jax.typing import Array

PROGRAMS = 264
TILE_ELEMENTS = 16384  # elements per program and loop step


def _tile_rows(width: int) -> int:
    """Rows per tile of an array of this width: a power of two near TILE_ELEMENTS / width."""
    return pl.next_power_of_2(max(TILE_ELEMENTS // width, 1))


def _prefetch_kernel(*refs, n_after: int, programs: int):
    """Refs: the ``after`` arrays (not read), the arrays [N_i, D_i], the token [programs]."""
    arrays, out_ref = refs[n_after:-1], refs[-1]
    program = pl.program_id(0)
    total = jnp.zeros((), jnp.float32)
    for ref in arrays:
        n, width = ref.shape
        rows = _tile_rows(width)

        def step(j, acc, ref=ref, n=n, rows=rows):
            row0 = (program + j * programs) * rows
            mask = (row0 + jax.lax.broadcasted_iota(jnp.int32, (rows, width), 0)) < n
            tile = pltriton.load(ref.at[pl.ds(row0, rows), :], mask=mask, other=0)
            return acc + jnp.sum(tile.astype(jnp.float32))

        total = jax.lax.fori_loop(0, pl.cdiv(pl.cdiv(n, rows), programs), step, total)
    out_ref[pl.ds(program, 1)] = total[None]


@functools.partial(jax.jit, static_argnames=("programs", "interpret"))
def _prefetch(arrays, after, *, programs: int, interpret: bool):
    return pl.pallas_call(
        functools.partial(_prefetch_kernel, n_after=len(after), programs=programs),
        out_shape=jax.ShapeDtypeStruct((programs,), jnp.float32),
        grid=(programs,),
        compiler_params=None if interpret else pltriton.CompilerParams(num_warps=4, num_stages=3),
        interpret=interpret,
        name="prefetch_l2",
    )(*after, *arrays)


def prefetch_l2(arrays: Sequence[Array], after: Sequence[Array] = (), *, programs: int = PROGRAMS,
                interpret: bool | None = None) -> Array:
    """Read each of ``arrays`` (2-D, bf16 or float32) once, after ``after``'s producers; returns the
    token, float32 [programs]: program p's sum of the rows of its tiles (its value only tests the reads)."""
    arrays, after = tuple(arrays), tuple(after)
    if not arrays:
        raise ValueError("prefetch_l2 needs at least one array")
    for i, a in enumerate(arrays):
        if a.ndim != 2 or jnp.dtype(a.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
            raise ValueError(f"array {i} must be 2-D bf16 or float32, got {a.shape} {a.dtype}")
    if programs < 1:
        raise ValueError(f"programs must be positive, got {programs}")
    interpret = pallas_interpret() if interpret is None else interpret
    return _prefetch(arrays, after, programs=programs, interpret=interpret)


__all__ = ["PROGRAMS", "prefetch_l2"]
