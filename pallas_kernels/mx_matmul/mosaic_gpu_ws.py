"""MXFP4 dense matmul for a few rows of x, warp-specialized (Mosaic GPU): one memory warpgroup streams
the tiles of ``consumers`` compute warpgroups through a ring of ``stages`` slots.

``y [M, N] = x [M, K] @ w [N, K]^T`` for M <= 64, computed transposed as in ``mosaic_gpu.py`` (the same
register decode into wgmma's A operand, the same permuted x tile as the B operand). What differs is who
waits for what:

- A program is a block of ``consumers + 1`` warpgroups; the grid is persistent (``programs`` blocks,
  by default one per SM) and program p takes the units p, p + programs, ... A unit is
  ``64 consumers`` weight rows over all of K.
- The memory warpgroup walks its units' steps (bk contracted elements each) and, per step, copies into a
  slot the codes of the unit's rows [64 C, bk/2], the x tile [Mp, bk] that all its consumers share and a
  16-column window of the rows' scale bytes (a TMA row is at least 16 bytes; a step needs bk/32 of them).
  It refills a slot once every consumer has arrived on the slot's ``empty`` barrier, so up to ``stages``
  steps are in flight whatever the consumers are doing.
- Compute warpgroup c waits on the slot's ``full`` barrier, decodes its 64 rows in registers, issues the
  wgmma, waits for it and arrives on ``empty``: no warpgroup barrier ties the consumers to each other or
  to the copies. At a unit's end it stores its accumulator and copies it out.

The memory warpgroup gives up registers (``setmaxnreg``) so that the compute warpgroups get more. In
interpret mode (CPU) the decode is ``_decode_emulated`` and the wgmma a jnp dot, as in ``mosaic_gpu.py``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from k3jax.mx import BLOCK
from k3jax.typing import Array
from pallas_kernels._mosaic_gpu import store_transposed
from pallas_kernels.mx_matmul.mosaic_gpu import (
    ROWS,
    _decode_emulated,
    _decode_registers,
    _warpgroup_barrier,
    _x_tile_transforms,
    rows_padded,
    weight_operands,
    x_operand,
)

_SCALE_WINDOW = 16  # scale columns a step copies: one TMA row of 16 bytes
_REGISTERS = 65536  # per SM
_MEMORY_REGISTERS = 40  # the memory warpgroup's registers per thread after setmaxnreg
_F32, _BF16 = jnp.float32, jnp.bfloat16


@dataclasses.dataclass(frozen=True)
class SpecializedBlocks:
    """consumers: compute warpgroups per program (64 weight rows each, 1..4: a TMA box has at most 256
    rows); stages: ring slots; bk: contracted elements per step (128 or 256); out_mn: the kernel writes
    [M, N] itself (``mosaic_gpu.MosaicBlocks.out_mn``); programs: persistent blocks (None: the GPU's SM
    count, or every unit its own program where no GPU is present); set_registers: the memory warpgroup gives
    registers to the compute warpgroups (``setmaxnreg``; with one compute warpgroup every thread has
    enough without it); x_resident: the whole x operand is copied into shared memory once per program instead
    of a tile per step through the ring."""

    consumers: int = 3
    stages: int = 6
    bk: int = 256
    out_mn: bool = False
    programs: int | None = None
    set_registers: bool = True
    x_resident: bool = False

    def __post_init__(self):
        if not 1 <= self.consumers <= 4 or self.stages < 1 or self.bk not in (128, 256):
            raise ValueError(f"consumers must be 1..4, stages >= 1 and bk 128 or 256, got {self}")
        if self.programs is not None and self.programs < 1:
            raise ValueError(f"programs must be None or >= 1, got {self.programs}")

    def gives_registers(self) -> bool:
        return self.set_registers and self.consumers > 1

    def compute_registers(self) -> int:
        """Registers per compute thread once the memory warpgroup has given its up: of the registers the block
        is launched with (at most 65536 / threads per thread, a multiple of 8), a multiple of 8."""
        threads = 128 * (self.consumers + 1)
        launched = _REGISTERS // threads // 8 * 8 * threads
        return (launched - 128 * _MEMORY_REGISTERS) // (threads - 128) // 8 * 8


def _sm_count() -> int | None:
    device = jax.devices()[0]
    return getattr(device, "core_count", None) if device.platform == "gpu" else None


def _kernel(codes_g, scales_g, x_g, out_g, codes_s, scales_s, x_s, out_s, full, empty, x_bar, *, n_steps: int,
            n_units: int, programs: int, m: int, blocks: SpecializedBlocks, interpret: bool):
    consumers, stages, bk = blocks.consumers, blocks.stages, blocks.bk
    program, wg = jax.lax.axis_index("programs"), jax.lax.axis_index("wg")
    unit_rows = consumers * ROWS
    my_units = (n_units - program + programs - 1) // programs

    def window(step):
        """First scale column of the step's copied window (16-aligned: a TMA copy of a window from another column
        is an illegal instruction on the H200) and the step's offset in it; the step's bk / 32 columns fit."""
        first = step * (bk // BLOCK)
        return pl.multiple_of(first // _SCALE_WINDOW * _SCALE_WINDOW, _SCALE_WINDOW), jax.lax.rem(first, _SCALE_WINDOW)

    x_resident = blocks.x_resident

    def x_tile(slot, step):
        """The step's x tile [Mp, bk] in shared memory."""
        return x_s.at[step if x_resident else slot]

    @pl.when(wg == consumers)
    def _memory():
        if blocks.gives_registers() and not interpret:
            plgpu.set_max_registers(_MEMORY_REGISTERS, action="decrease")
        if x_resident:
            for step in range(n_steps):
                plgpu.copy_gmem_to_smem(x_g.at[:, pl.ds(step * bk, bk)], x_s.at[step], x_bar.at[0])

        def fetch(i, _):
            slot, step = jax.lax.rem(i, stages), jax.lax.rem(i, n_steps)
            rows = pl.ds((program + i // n_steps * programs) * unit_rows, unit_rows)

            @pl.when(i >= stages)
            def _():
                plgpu.barrier_wait(empty.at[slot])

            plgpu.copy_gmem_to_smem(codes_g.at[rows, pl.ds(step * (bk // 2), bk // 2)], codes_s.at[slot], full.at[slot])
            if not x_resident:
                plgpu.copy_gmem_to_smem(x_g.at[:, pl.ds(step * bk, bk)], x_s.at[slot], full.at[slot])
            plgpu.copy_gmem_to_smem(scales_g.at[rows, pl.ds(window(step)[0], _SCALE_WINDOW)], scales_s.at[slot],
                                    full.at[slot])
            return ()

        jax.lax.fori_loop(0, my_units * n_steps, fetch, ())

    @pl.when(wg < consumers)
    def _compute():
        if blocks.gives_registers() and not interpret:
            plgpu.set_max_registers(blocks.compute_registers(), action="increase")
        mine = pl.ds(wg * ROWS, ROWS)
        if x_resident:
            plgpu.barrier_wait(x_bar.at[0])
        decode = None if interpret else _decode_registers(bk)
        barrier = None if interpret else _warpgroup_barrier()

        def tiles(i, step):
            slot = jax.lax.rem(i, stages)
            plgpu.barrier_wait(full.at[slot])
            scales = scales_s.at[slot, mine, pl.ds(window(step)[1], bk // BLOCK)]
            if interpret:
                return slot, _decode_emulated(codes_s[slot, mine], scales[...], bk)
            return slot, decode(codes_s.at[slot, mine], scales)

        def release(i, slot):
            """The slot's tiles are read: arrive on its empty barrier if the memory warpgroup refills it."""
            @pl.when(i + stages < my_units * n_steps)
            def _():
                plgpu.barrier_arrive(empty.at[slot])

        def unit(u, _):
            first_item = u * n_steps
            if interpret:
                def step_fn(step, acc):
                    slot, w = tiles(first_item + step, step)
                    acc = acc + jnp.dot(w, x_tile(slot, step)[...].T, preferred_element_type=_F32)
                    release(first_item + step, slot)
                    return acc

                acc = jax.lax.fori_loop(0, n_steps, step_fn, jnp.zeros((ROWS, x_s.shape[-2]), _F32))
            else:
                def accumulate(acc_ref):
                    def step_fn(step, _):
                        slot, w = tiles(first_item + step, step)
                        plgpu.wgmma(acc_ref, w, plgpu.transpose_ref(x_tile(slot, step), (1, 0)))
                        plgpu.wgmma_wait(0)
                        release(first_item + step, slot)
                        return ()

                    jax.lax.fori_loop(0, n_steps, step_fn, ())
                    return acc_ref[...]

                acc = pl.run_scoped(accumulate, plgpu.ACC((ROWS, x_s.shape[-2]), _F32))
            _store(acc, out_g, out_s.at[wg], (program + u * programs) * unit_rows + wg * ROWS, m, blocks.out_mn,
                   interpret, barrier)
            return ()

        jax.lax.fori_loop(0, my_units, unit, ())


def _store(acc, out_g, out_s, row0, m: int, out_mn: bool, interpret: bool, barrier) -> None:
    """A compute warpgroup's accumulator [64, Mp] to rows row0.. of out_g ([N, Mp], or with out_mn [M, N]
    transposed), through its shared tile; waits until the copy has read the tile, which the next unit reuses."""
    if out_mn:
        if interpret:
            out_s[...] = acc.T.astype(out_s.dtype)
        else:
            store_transposed()(acc.astype(out_s.dtype), out_s)
        src, dst = out_s.at[pl.ds(0, m)], out_g.at[:, pl.ds(row0, ROWS)]
    else:
        out_s[...] = acc.astype(out_s.dtype)
        src, dst = out_s, out_g.at[pl.ds(row0, ROWS)]
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(src, dst)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    if not interpret:
        barrier()


def mx_matmul_specialized(x: Array, codes: Array, scales: Array, *, blocks: SpecializedBlocks = SpecializedBlocks(),
                          out_dtype=_F32, interpret=False) -> Array:
    """x bf16 [M, K] (M <= 64), MXFP4 codes uint8 [N, K/2], scales uint8 [N, K/32] -> out_dtype [M, N]
    (float32 accumulation, rounded once), as ``mosaic_gpu.mx_matmul_mosaic``; N is padded to a whole
    number of units (64 ``consumers`` rows). ``interpret``: False on the GPU, or ``interpret_params()``."""
    m, n = x.shape[0], codes.shape[0]
    mp = rows_padded(m)
    if mp > 64:
        raise ValueError(f"mx_matmul_specialized takes at most 64 rows of x, got {m}")
    unit_rows = blocks.consumers * ROWS
    codes, scales, _, kp, _ = weight_operands(codes, scales, blocks.bk)
    np_ = -(-n // unit_rows) * unit_rows
    codes = jnp.pad(codes, ((0, np_ - codes.shape[0]), (0, 0)))
    scales = jnp.pad(scales, ((0, np_ - scales.shape[0]), (0, 0)))
    n_units = np_ // unit_rows
    programs = min(n_units, blocks.programs or _sm_count() or n_units)
    out_tile = (mp, ROWS) if blocks.out_mn else (ROWS, mp)
    stages, bk = blocks.stages, blocks.bk
    scratch = [
        plgpu.SMEM((stages, unit_rows, bk // 2), jnp.uint8),
        plgpu.SMEM((stages, unit_rows, _SCALE_WINDOW), jnp.uint8),
        plgpu.SMEM((kp // bk if blocks.x_resident else stages, mp, bk), _BF16, transforms=_x_tile_transforms()),
        plgpu.SMEM((blocks.consumers, *out_tile), out_dtype),
        plgpu.Barrier(num_arrivals=3 - blocks.x_resident, num_barriers=stages),
        plgpu.Barrier(num_arrivals=blocks.consumers, num_barriers=stages),
        plgpu.Barrier(num_arrivals=kp // bk, num_barriers=1),
    ]
    kernel = functools.partial(_kernel, n_steps=kp // bk, n_units=n_units, programs=programs, m=m,
                               blocks=blocks, interpret=bool(interpret))
    out = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((m, np_) if blocks.out_mn else (np_, mp), out_dtype),
        scratch_types=scratch, grid=(programs,), grid_names=("programs",),
        num_threads=blocks.consumers + 1, thread_name="wg",
        compiler_params=plgpu.CompilerParams(unsafe_no_auto_barriers=True), interpret=interpret or None,
    )(codes, scales, x_operand(x, mp, bk))
    return out[:, :n] if blocks.out_mn else out[:n, :m].T


__all__ = ["SpecializedBlocks", "mx_matmul_specialized"]
