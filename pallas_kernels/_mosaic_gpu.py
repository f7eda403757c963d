"""What the Mosaic GPU kernels (KDA, MX matmul, the tiled MoE) share: interpret-mode parameters across JAX
versions, the swizzled layout of shared-memory tiles, and a wgmma accumulator's transposed store."""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu


def interpret_params():
    """Mosaic GPU's interpret mode parameters (CPU): ``plgpu.InterpretGPUParams`` in JAX 0.11; JAX
    0.10 has the class only under ``jax._src``."""
    if hasattr(plgpu, "InterpretGPUParams"):
        return plgpu.InterpretGPUParams()
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams()


def interpret_argument(interpret: bool):
    """The Mosaic GPU kernels' ``interpret`` argument: ``interpret_params()`` in interpret mode, else False."""
    return interpret_params() if interpret else False


def swizzled(minor: int, dtype=jnp.bfloat16) -> tuple:
    """Tiling and swizzle of a shared-memory tile whose rows hold ``minor`` elements of ``dtype``:
    8-row tiles of at most 128 bytes a row, swizzled by the tile's row width (wgmma operands, and
    conflict-free stores and loads of wgmma-layout registers)."""
    row_bytes = min(minor * jnp.dtype(dtype).itemsize, 128)
    return plgpu.TilingTransform((8, row_bytes // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(row_bytes)


def accumulator_elements(acc):
    """The elements a thread holds of a wgmma accumulator (a ``plgpu.Layout.WGMMA`` argument of inline Mosaic GPU
    code), as (value, row, column) MLIR values, inside an ``inline_mgpu`` body."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, llvm

    i32, index = ir.IntegerType.get_signless(32), ir.IndexType.get()
    for reg, (row, col) in zip(acc.registers.flat, acc.layout.thread_idxs(acc.shape)):
        for e in range(ir.VectorType(reg.type).shape[0]):
            yield llvm.extractelement(reg, arith.constant(i32, e)), row, arith.addi(col, arith.constant(index, e))


def store_transposed():
    """Inline Mosaic GPU function (ctx, acc [64, Mp] in the WGMMA layout, out_ref [Mp, 64] in shared
    memory): out_ref[col, row] = acc[row, col], each thread storing its own registers' elements, then a
    warpgroup barrier (the store is complete for every thread before a copy out)."""
    import jax.experimental.mosaic.gpu as mgpu
    from jax._src.lib.mlir.dialects import memref

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType()))
    def store(ctx, acc, out_ref):
        del ctx
        for value, row, col in accumulator_elements(acc):
            memref.store(value, out_ref, [col, row])
        mgpu.utils.warpgroup_barrier()

    return store
