"""What the routed-expert kernels share: checks of their operands and the free views of MXFP4 expert stacks
they index. Imports no kernel of its own folder."""

from __future__ import annotations

from k3jax.mx import BLOCK, MXTensor
from k3jax.typing import Array
from pallas_kernels._triton import check_offsets
from pallas_kernels.mx_matmul.triton import SCALE_BLOCK_BYTES


def stack_views(w: MXTensor, rows_in_pairs: bool) -> tuple[Array, Array]:
    """Free views of a stack's codes [E, N, K/2] and scales [E, N, K/32]: [E, N, K/32, 16] and
    [E, N, K/32, 1], or with rows_in_pairs [E, N/2, 2, K/32, 16] and [E, N/2, 2, K/32, 1]."""
    E, N, half = w.codes.shape
    lead = (E, N // 2, 2) if rows_in_pairs else (E, N)
    return (w.codes.reshape(*lead, half // SCALE_BLOCK_BYTES, SCALE_BLOCK_BYTES),
            w.scales.reshape(*lead, w.scales.shape[-1], 1))


def check_moe_operands(x: Array, w1: MXTensor, w3: MXTensor, w2: MXTensor, weights: Array, experts: Array) -> None:
    """The fused MoE kernels' operands: MXFP4 stacks w1, w3 [E, F, R] and w2 [E, R, F], x [T, R],
    weights and experts [T, k]; F and R whole scale blocks."""
    for name, w, shape in (("w1", w1, None), ("w3", w3, w1.shape), ("w2", w2, None)):
        if not isinstance(w, MXTensor) or w.format != "mxfp4" or w.ndim != 3:
            raise ValueError(f"{name} must be an MXFP4 MXTensor [E, N, K], got {w!r:.200}")
        if shape is not None and w.shape != shape:
            raise ValueError(f"{name} shape {w.shape} differs from w1's {shape}")
    E, F, R = w1.shape
    if x.ndim != 2 or x.shape[1] != R or w2.shape != (E, R, F):
        raise ValueError(f"x [T, R] = {x.shape}, w1 [E, F, R] = {w1.shape}, w2 [E, R, F] = {w2.shape} disagree")
    if weights.shape != experts.shape or weights.shape[0] != x.shape[0]:
        raise ValueError(f"weights {weights.shape} and experts {experts.shape} must both be [T, k], T = {x.shape[0]}")
    if F % BLOCK or R % BLOCK:
        raise ValueError(f"F = {F} and R = {R} must be multiples of {BLOCK}")


def check_stack_offsets(w1: MXTensor, w3: MXTensor, w2: MXTensor, interpret: bool) -> None:
    """The fused MoE kernels index the whole stacks in Triton: a ValueError where those offsets wrap
    (``offsets_wrap``; the interpreter computes them right)."""
    if not interpret:
        stacks = {f"{name}.{part}": getattr(w, part) for name, w in (("w1", w1), ("w3", w3), ("w2", w2))
                  for part in ("codes", "scales")}
        check_offsets("the tiled MoE and the sorted dispatch take such stacks", **stacks)


__all__ = ["check_moe_operands", "check_stack_offsets", "stack_views"]
