"""The MoE op's entries for the layer, with the signatures of ``k3jax.functional.moe``:

    select_experts(logits, correction_bias, k, renormalize, scaling_factor) -> (weights, experts)
    routed_experts(x, logits, correction_bias, w1, w3, w2, act, k, renormalize, scaling_factor,
                   dispatch="sorted", out_dtype=None)                         -> [T, R]

On the reference path (and for float stacks) they are the reference. On the Pallas path, for MXFP4
stacks, ``routed_experts`` picks one of (``KernelPolicy`` decides where several could run):

- split: two fused Triton kernels for a few tokens (``triton_split.py``), the experts picked inside
  the first at one token (``routed_moe_mx_split``), else by the selection kernel before them;
- tiled: the tiled Mosaic GPU MoE (``mosaic_gpu_tiled.py``), at prefill (also in interpret mode on a
  CPU) and at decode (on a GPU);
- sorted: the reference's sorted dispatch with the grouped MX matmul kernel (``pallas_kernels.mx_matmul``).

Under ``k3jax.sharding.on_mesh`` the experts are split over the mesh and each device runs the
tiled or sorted form on its own (``moe_expert_parallel``). ``select_experts`` has the reference's gradient
(``pallas_kernels._autodiff.with_reference_gradient``; the expert ids none); the MXFP4 forms of
``routed_experts`` (split, tiled, the grouped MX matmul) are not differentiable.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp

from k3jax.implementation import current
from k3jax.mx import MXTensor
from k3jax.sharding import current_mesh
from k3jax.typing import Array
from pallas_kernels import _platform
from pallas_kernels._autodiff import with_reference_gradient
from pallas_kernels._triton import offsets_wrap
from pallas_kernels.moe import reference
from pallas_kernels.moe.mosaic_gpu_tiled import tiled_moe_mx
from pallas_kernels.moe.triton_select import select_experts as select_experts_kernel
from pallas_kernels.moe.triton_split import fused_moe_mx_split, routed_moe_mx_split
from pallas_kernels.mx_matmul.mosaic_gpu_grouped import default_bm
from pallas_kernels.mx_matmul.ops import grouped_mx_matmul


def select_experts(logits: Array, correction_bias: Array, k: int, renormalize: bool, scaling_factor: float):
    """``k3jax.functional.moe.select_experts``; on the Pallas path off TPU one Triton kernel, with the
    reference's gradient."""
    if current().name == "reference" or _platform.on_tpu():
        return reference.select_experts(logits, correction_bias, k, renormalize, scaling_factor)
    return with_reference_gradient(select_experts_kernel, reference.select_experts)(
        logits, correction_bias, k, renormalize, scaling_factor)


def _tiled_bm(w: Array | MXTensor, x: Array, pairs: int) -> int | None:
    """Pairs per tile of the tiled Mosaic GPU MoE (``default_bm``), or None where it does not run: MXFP4
    stacks and bf16 x only; at prefill (``KernelPolicy.prefill_pairs_per_expert`` pairs an expert or more)
    on a GPU where the Mosaic GPU kernels run or in interpret mode on a CPU, at decode on such a GPU only
    (a decode step through the interpreter takes seconds)."""
    if not isinstance(w, MXTensor) or x.dtype != jnp.bfloat16:
        return None
    policy, runs = current().policy, _platform.mosaic_gpu_runs()
    bm = default_bm(pairs, w.shape[0])
    if pairs < policy.prefill_pairs_per_expert * w.shape[0]:
        return bm if policy.tiled_moe_at_decode and runs else None
    return bm if policy.tiled_moe_at_prefill and (runs or _platform.interpret()) else None


def _split_runs(w: Array | MXTensor, tokens: int, k: int, tiled: bool) -> bool:
    """Whether the split kernels take these pairs: MXFP4 stacks off TPU, few pairs over few hidden
    programs, up to ``split_moe_max_tokens_beside_tiled`` tokens where the tiled MoE would run, and no
    stack whose offsets wrap in Triton (``offsets_wrap``)."""
    policy = current().policy
    if not isinstance(w, MXTensor) or _platform.on_tpu() or offsets_wrap(w.codes):
        return False
    if tiled and tokens > policy.split_moe_max_tokens_beside_tiled:
        return False
    return tokens * k <= policy.split_moe_max_pairs and k * w.shape[1] // 32 <= policy.split_moe_max_hidden_programs


def _grouped_matmul(x: Array, w: Array | MXTensor, group_sizes: Array) -> Array:
    """The sorted dispatch's grouped products: the MX kernel for MXFP4 stacks, the reference's otherwise."""
    if isinstance(w, MXTensor):
        return grouped_mx_matmul(x, w, group_sizes)
    return reference.stored_grouped_matmul(x, w, group_sizes)


def _local_moe(act, bm: int | None, pallas: bool):
    """The routed experts over chosen pairs, ``moe_sorted``'s contract: tiled in tiles of ``bm`` pairs, or
    sorted (its grouped products by the MX kernel on the Pallas path, by the reference's otherwise)."""
    if bm is not None:
        return functools.partial(tiled_moe_mx, act=act, bm=bm, interpret=_platform.interpret())
    matmul = _grouped_matmul if pallas else reference.stored_grouped_matmul
    return functools.partial(reference.moe_sorted, act=act, matmul=matmul)


def routed_experts(x: Array, logits: Array, correction_bias: Array, w1, w3, w2, act, k: int, renormalize: bool,
                   scaling_factor: float, dispatch: str = "sorted", out_dtype=None) -> Array:
    """``k3jax.functional.moe.routed_experts`` (x [T, R], logits [T, E] float32), by the form the module
    docstring lists. Returns [T, R] in x's dtype; the split kernels return ``out_dtype`` where given (their
    float32 sums unrounded, for a caller that rounds them itself)."""
    choice, mesh = current(), current_mesh()
    if choice.name == "reference" and mesh is None:
        return reference.routed_experts(x, logits, correction_bias, w1, w3, w2, act, k, renormalize, scaling_factor,
                                        dispatch)
    tokens = x.shape[0]
    sorted_dispatch = mesh is not None or dispatch == "sorted"  # a mesh always sorts
    pallas = choice.name == "pallas"
    bm = _tiled_bm(w1, x, tokens * k) if pallas and sorted_dispatch else None
    if pallas and mesh is None and dispatch == "sorted" and _split_runs(w1, tokens, k, tiled=bm is not None):
        if tokens == 1 and choice.policy.route_in_moe_kernel:
            return routed_moe_mx_split(x, w1, w3, w2, logits, correction_bias, act, k=k, renormalize=renormalize,
                                       scaling_factor=scaling_factor, out_dtype=out_dtype)
        weights, experts = select_experts(logits, correction_bias, k, renormalize, scaling_factor)
        return fused_moe_mx_split(x, w1, w3, w2, weights, experts, act, out_dtype=out_dtype)
    weights, experts = select_experts(logits, correction_bias, k, renormalize, scaling_factor)
    local = _local_moe(act, bm, pallas)
    if mesh is not None:
        return reference.moe_expert_parallel(x, w1, w3, w2, weights, experts, local, mesh)
    if dispatch == "sorted":
        return local(x, w1, w3, w2, weights, experts)
    w1, w3, w2 = (w.decode(x.dtype) if isinstance(w, MXTensor) else w for w in (w1, w3, w2))
    return reference.moe_dense(x, w1, w3, w2, weights, experts, act)


__all__ = ["routed_experts", "select_experts"]
