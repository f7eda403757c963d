"""bf16 matrix-vector products for up to 8 rows of x by Mosaic GPU, with programmatic dependent launch.

``matvec_rows8(x8, w)`` returns ``x8[:, :K] @ w^T`` as bf16 [8, N] for x8 bf16 [8, Kx >= K] and w bf16
[N, K] (PyTorch [out, in] layout): up to 8 activation rows (a decode batch; unused rows may hold anything,
since output row r reads only x8's row r), so a chain of them passes its [8, N] output on as the next x8.

Each program (one warpgroup) owns 64 weight rows and walks K in steps of ``bk``: TMA brings each step's
[64, bk] weight tile into one of ``stages`` shared-memory slots, and one wgmma (A: the weight tile from
shared memory, B: x8's step tile transposed, N = 8) accumulates float32 [64, 8]. The output tile is
stored transposed ([8, 64]) and copied out by TMA.

Programmatic dependent launch (``pdl``, JAX 0.11+ on Hopper): the kernel issues its first ``stages``
weight copies, then ``griddepcontrol.wait`` (which holds it until the kernel before it has finished and
its writes are visible), and only then copies x8. The weights do not depend on the kernel before, so
their first tiles stream while that kernel still runs; and the kernel signals
``griddepcontrol.launch_dependents`` at its start, so the kernel after it may be launched (and begin its
own weight copies) before this one ends. JAX launches a Mosaic GPU kernel that uses these instructions
with the programmatic-serialization attribute; without it (JAX 0.10) the wait returns at once and the
launch order is the usual one. A candidate of issue 4 (fewer kernel boundaries in a decode step):
``benchmarks/matvec_chain.py`` times it against the Triton matvec; not wired into the model.

On a CPU it runs in Mosaic GPU's interpret mode: the same copies and slots, the product as a jnp dot
(the interpreter takes no transposed wgmma operand), no grid-dependency instructions.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from k3jax.typing import Array

ROWS = 64  # weight rows per program: one wgmma M tile
X_ROWS = 8  # rows of x8: wgmma's smallest N
_SWIZZLE_BYTES = 128
_F32, _BF16 = jnp.float32, jnp.bfloat16


def _tile_transforms() -> tuple:
    """Shared-memory layout of the weight and x tiles: 8 x 64 tiles, 128-byte swizzle (wgmma's operands)."""
    return plgpu.TilingTransform((8, _SWIZZLE_BYTES // 2)), plgpu.SwizzleTransform(_SWIZZLE_BYTES)


def _store_transposed():
    """Inline Mosaic GPU function (ctx, acc [64, 8] in the WGMMA layout, out_ref [8, 64] in shared memory):
    out_ref[col, row] = acc[row, col], each thread storing its own registers' elements."""
    import jax.experimental.mosaic.gpu as mgpu
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, llvm, memref

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType()))
    def store(ctx, acc, out_ref):
        del ctx
        i32, index = ir.IntegerType.get_signless(32), ir.IndexType.get()
        for reg, (row, col) in zip(acc.registers.flat, acc.layout.thread_idxs(acc.shape)):
            for e in range(ir.VectorType(reg.type).shape[0]):
                value = llvm.extractelement(reg, arith.constant(i32, e))
                memref.store(value, out_ref, [arith.addi(col, arith.constant(index, e)), row])

    return store


def _kernel(x_g, w_g, out_g, w_s, x_s, out_s, w_bars, x_bar, *, n_steps: int, bk: int, stages: int, pdl: bool,
            interpret: bool):
    row0 = jax.lax.axis_index("rows") * ROWS
    rows = pl.ds(row0, ROWS)
    grid_dependency = pdl and not interpret
    if grid_dependency:
        plgpu.griddepcontrol_launch_dependents()

    def fetch(step, slot):
        plgpu.copy_gmem_to_smem(w_g.at[rows, pl.ds(step * bk, bk)], w_s.at[slot], w_bars.at[slot])

    for step in range(min(stages, n_steps)):
        fetch(step, step)
    if grid_dependency:
        plgpu.griddepcontrol_wait()  # x8 is the kernel before's output: read it only from here on
    for step in range(n_steps):
        plgpu.copy_gmem_to_smem(x_g.at[:, pl.ds(step * bk, bk)], x_s.at[step], x_bar.at[0])
    plgpu.barrier_wait(x_bar.at[0])

    def refill(step, slot):
        @pl.when(step + stages < n_steps)
        def _():
            fetch(step + stages, slot)

    if interpret:
        def step_fn(step, acc):
            slot = jax.lax.rem(step, stages)
            plgpu.barrier_wait(w_bars.at[slot])
            acc = acc + jnp.dot(w_s[slot], x_s[step].T, preferred_element_type=_F32)
            refill(step, slot)
            return acc

        acc = jax.lax.fori_loop(0, n_steps, step_fn, jnp.zeros((ROWS, X_ROWS), _F32))
        out_s[...] = acc.T.astype(out_s.dtype)
    else:
        def accumulate(acc_ref):
            def step_fn(step, _):
                slot = jax.lax.rem(step, stages)
                plgpu.barrier_wait(w_bars.at[slot])
                plgpu.wgmma(acc_ref, w_s.at[slot], plgpu.transpose_ref(x_s.at[step], (1, 0)))
                plgpu.wgmma_wait(0)  # the slot is refilled next
                refill(step, slot)
                return ()

            jax.lax.fori_loop(0, n_steps, step_fn, ())
            return acc_ref[...]

        acc = pl.run_scoped(accumulate, plgpu.ACC((ROWS, X_ROWS), _F32))
        _store_transposed()(acc.astype(out_s.dtype), out_s)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out_s, out_g.at[:, rows])
    plgpu.wait_smem_to_gmem(0)


def matvec_rows8(x8: Array, w: Array, *, bk: int = 256, stages: int = 4, pdl: bool = True,
                 interpret=False) -> Array:
    """x8 bf16 [8, Kx], w bf16 [N, K] with K <= Kx -> bf16 [8, N] = x8[:, :K] @ w^T (float32 accumulation,
    rounded once). N must be a multiple of 64 and K of bk (64, 128 or 256). ``interpret``: False on the
    GPU, or Mosaic GPU's interpret parameters on a CPU (``pallas_kernels._mosaic_gpu.interpret_params``)."""
    n, k = w.shape
    if x8.ndim != 2 or x8.shape[0] != X_ROWS or x8.shape[1] < k:
        raise ValueError(f"x8: expected [{X_ROWS}, Kx >= {k}] (w is [N, K] = {w.shape}), got {x8.shape}")
    if x8.dtype != _BF16 or w.dtype != _BF16:
        raise ValueError(f"x8 and w must be bfloat16, got {x8.dtype} and {w.dtype}")
    if bk not in (64, 128, 256) or stages < 1:
        raise ValueError(f"bk must be 64, 128 or 256 and stages >= 1, got bk={bk}, stages={stages}")
    if n % ROWS or k % bk:
        raise ValueError(f"w [N, K] = {w.shape}: N must be a multiple of {ROWS} and K of bk = {bk}")
    n_steps = k // bk
    scratch = [
        plgpu.SMEM((stages, ROWS, bk), _BF16, transforms=_tile_transforms()),
        plgpu.SMEM((n_steps, X_ROWS, bk), _BF16, transforms=_tile_transforms()),
        plgpu.SMEM((X_ROWS, ROWS), _BF16),
        plgpu.Barrier(num_arrivals=1, num_barriers=stages),
        plgpu.Barrier(num_arrivals=n_steps, num_barriers=1),
    ]
    kernel = functools.partial(_kernel, n_steps=n_steps, bk=bk, stages=stages, pdl=pdl, interpret=bool(interpret))
    return plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct((X_ROWS, n), _BF16), scratch_types=scratch, grid=(n // ROWS,),
        grid_names=("rows",), interpret=interpret or None,
    )(x8, w)


__all__ = ["ROWS", "X_ROWS", "matvec_rows8"]
