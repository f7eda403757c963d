"""Ask DRAM for the chosen experts' weights all at once: TMA L2 prefetches (decode MoE, Mosaic GPU).

At decode sizes the fused MoE (``pallas_kernels.mx_matmul.moe``) waits on DRAM: each of its programs
has one small tile in flight at a time and five tiles in turn, so the 10 MB of `mini`'s 8 experts
arrive at about 0.7 TB/s (benchmarks/RESULTS.md, eleventh session). ``prefetch_experts_l2(arrays,
experts)`` is one Mosaic GPU kernel that copies the expert indices to shared memory and then issues
TMA L2 prefetches (``plgpu.async_prefetch``, ``cp.async.bulk.prefetch.tensor``) of every selected
expert's rows of each stack, and returns: it waits for no weight byte, so the requests go out
together, and the MoE kernel that follows (taking the kernel's token as an unread operand) finds
its tiles in L2 or on their way.

Each stack [E, N, D] (a row a multiple of 16 bytes: a TMA source) is cut per expert into boxes of at
most BOX x BOX elements, spread over the programs; a box that would cross an edge is moved back
inside. The token (float32 [programs]) is never written and means nothing. A prefetch is a hint
with no effect on any value, so in interpret mode (CPU) no kernel runs and the token is zeros.
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
TMA_ALIGN = 16  # bytes: a TMA source's rows are multiples of this
EXPERT_COPY_ALIGN = 128  # bytes: Mosaic GPU copies the expert list in multiples of a warpgroup's 128 threads


def box_grid(shape: tuple[int, int]) -> tuple[int, int, int]:
    """(rows, cols, boxes): the box of a [N, D] slice and how many cover it."""
    n, d = shape
    rows, cols = min(n, BOX), min(d, BOX)
    return rows, cols, pl.cdiv(n, rows) * pl.cdiv(d, cols)


def box_origin(box, shape: tuple[int, int]):
    """(row0, col0) of box ``box`` (row-major over the box grid, moved back inside at the edges)."""
    n, d = shape
    rows, cols, _ = box_grid(shape)
    per_row = pl.cdiv(d, cols)
    return jnp.minimum((box // per_row) * rows, n - rows), jnp.minimum((box % per_row) * cols, d - cols)


def prefetchable(a: Array) -> bool:
    """Whether a stack [E, N, D] can be a TMA source: rows a multiple of 16 bytes."""
    return a.ndim == 3 and a.shape[2] * a.dtype.itemsize % TMA_ALIGN == 0


def _kernel(experts_g, *refs, n_pairs: int, programs: int):
    """Refs: experts int32 [P'] (GMEM), the stacks [E, N_i, D_i] (GMEM), the token (GMEM, not written),
    then the experts' shared-memory copy and its barrier. For pair p the boxes of each stack go to
    programs p * boxes, p * boxes + 1, ... (mod programs), so the pairs spread over the SMs."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    *stacks, _, experts_s, barrier = refs
    plgpu.copy_gmem_to_smem(experts_g, experts_s, barrier.at[0])
    plgpu.barrier_wait(barrier.at[0])
    program = jax.lax.axis_index("programs")
    for ref in stacks:
        shape = ref.shape[1:]
        rows, cols, per_expert = box_grid(shape)
        for p in range(n_pairs):
            expert = experts_s[p]
            box0 = (program + programs - p * per_expert % programs) % programs
            for j in range(pl.cdiv(per_expert, programs)):
                box = box0 + j * programs

                @pl.when(box < per_expert)
                def _(ref=ref, box=box, rows=rows, cols=cols, expert=expert, shape=shape):
                    row0, col0 = box_origin(box, shape)
                    plgpu.async_prefetch(ref.at[expert, pl.ds(row0, rows), pl.ds(col0, cols)])


@functools.partial(jax.jit, static_argnames=("programs",))
def _prefetch(stacks, experts, *, programs: int):
    from jax.experimental.pallas import mosaic_gpu as plgpu

    n_pairs = experts.shape[0]
    padded = jnp.pad(experts, (0, -n_pairs % (EXPERT_COPY_ALIGN // 4)), mode="edge")
    return plgpu.kernel(
        functools.partial(_kernel, n_pairs=n_pairs, programs=programs),
        out_type=jax.ShapeDtypeStruct((programs,), jnp.float32),
        scratch_types=[plgpu.SMEM(padded.shape, jnp.int32), plgpu.Barrier(num_arrivals=1, num_barriers=1)],
        grid=(programs,), grid_names=("programs",),
        compiler_params=plgpu.CompilerParams(unsafe_no_auto_barriers=True),
    )(padded, *stacks)


def prefetch_experts_l2(stacks: Sequence[Array], experts: Array, *, programs: int = PROGRAMS,
                        interpret: bool | None = None) -> Array:
    """Prefetch into L2 the rows ``stack[e]`` of each stack [E, N, D] (a row a multiple of 16 bytes)
    for every expert e in ``experts`` (int32, any shape; repeats allowed); returns the token, float32
    [programs], to pass to the reader as an operand it does not read."""
    stacks = tuple(stacks)
    if not stacks:
        raise ValueError("prefetch_experts_l2 needs at least one stack")
    for i, a in enumerate(stacks):
        if not prefetchable(a):
            raise ValueError(f"stack {i} must be [E, N, D] with rows a multiple of {TMA_ALIGN} bytes (a TMA "
                             f"source), got {a.shape} {a.dtype}")
    if experts.size == 0 or not jnp.issubdtype(experts.dtype, jnp.integer):
        raise ValueError(f"experts must be a non-empty integer array, got {experts.shape} {experts.dtype}")
    if programs < 1:
        raise ValueError(f"programs must be positive, got {programs}")
    if pallas_interpret() if interpret is None else interpret:
        return jnp.zeros((programs,), jnp.float32)
    return _prefetch(stacks, experts.reshape(-1).astype(jnp.int32), programs=programs)


__all__ = ["BOX", "PROGRAMS", "box_grid", "box_origin", "prefetch_experts_l2", "prefetchable"]
