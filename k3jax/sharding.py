"""Expert parallelism: the MoE dispatch under ``shard_map`` with routed experts split over a mesh axis.

    mesh = jax.make_mesh((4,), ("expert",), axis_types=(jax.sharding.AxisType.Auto,))
    with k3jax.sharding.expert_parallel(mesh):
        logits = forward(params, tokens)      # params: experts placed with ``expert_sharding``

(Auto axes: with make_mesh's default Explicit axes the reference path runs, but Pallas' interpreter (CPU)
of the matvec kernels meets a sharding-type error in JAX 0.10.2: a kernel's output buffer carries the
mesh and the values its body writes into it do not; a compiled kernel is not interpreted.)

Each device holds E / n experts (arrays or MXFP4 ``MXTensor`` stacks) and sees every token; it runs its
local MoE (the sorted dispatch, or on the Pallas path the tiled Mosaic GPU MoE where it runs) on the token
copies routed to its own experts (the rest get expert id E / n, past the last, and add nothing), and one
``psum`` over the axis combines the partial outputs. Like the implementation switch, the mesh is read at
trace time.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from k3jax.implementation import scoped
from k3jax.typing import Array

EXPERT_AXIS = "expert"
LocalMoE = Callable[[Array, Array, Array, Array, Array, Array], Array]
_MESH: contextvars.ContextVar[Mesh | None] = contextvars.ContextVar("k3jax_expert_mesh", default=None)


def expert_parallel(mesh: Mesh, axis: str = EXPERT_AXIS) -> contextlib.AbstractContextManager:
    """Run MoE layers traced inside this block with experts split over ``mesh`` axis ``axis``."""
    if axis not in mesh.axis_names:
        raise ValueError(f"mesh: no axis named {axis!r} (axes {mesh.axis_names})")
    return scoped(_MESH, mesh)


def expert_mesh() -> Mesh | None:
    return _MESH.get()


def expert_sharding(mesh: Mesh, num_experts: int, axis: str = EXPERT_AXIS) -> NamedSharding:
    """Where a routed-expert stack [E, ...] lives: split along E over ``axis``."""
    if num_experts % mesh.shape[axis]:
        raise ValueError(f"num_experts {num_experts} does not divide over mesh axis {axis!r} of size {mesh.shape[axis]}")
    return NamedSharding(mesh, PartitionSpec(axis))


def local_pairs(weights: Array, experts: Array, first, count: int) -> tuple[Array, Array]:
    """(weights, experts) [T, k] as a device holding experts [first, first + count) sees them: its own
    experts numbered from 0, every other pair expert ``count`` (past its stacks, so it adds nothing) with
    weight 0."""
    mine = (experts >= first) & (experts < first + count)
    return jnp.where(mine, weights, 0.0), jnp.where(mine, experts - first, count)


def moe_expert_parallel(
    x: Array, w1, w3, w2, weights: Array, experts: Array, local_moe: LocalMoE, mesh: Mesh, axis: str = EXPERT_AXIS,
) -> Array:
    """The routed experts' sum with the expert stacks w1, w3, w2 [E, ...] split over ``axis``; x [T, R],
    weights and experts [T, k] replicated. ``local_moe(x, w1, w3, w2, weights, experts)`` runs on each
    device's E / n experts, ``moe_sorted``'s contract: pairs whose expert is outside its stacks add nothing.
    Returns [T, R], replicated."""
    E, n = w1.shape[0], mesh.shape[axis]
    if E % n:
        raise ValueError(f"num_experts {E} does not divide over mesh axis {axis!r} of size {n}")
    local = E // n

    def shard(x, w1, w3, w2, weights, experts):
        y = local_moe(x, w1, w3, w2, *local_pairs(weights, experts, jax.lax.axis_index(axis) * local, local))
        return jax.lax.psum(y.astype(jnp.float32), axis).astype(x.dtype)

    split, whole = PartitionSpec(axis), PartitionSpec()
    # check_vma: a pallas_call's outputs (ShapeDtypeStruct) say nothing of how they vary over the mesh, which
    # the check refuses; the psum makes the output the same on every device
    return jax.shard_map(shard, mesh=mesh, in_specs=(whole, split, split, split, whole, whole), out_specs=whole,
                         check_vma=False)(x, w1, w3, w2, weights, experts)


__all__ = ["EXPERT_AXIS", "expert_parallel", "expert_mesh", "expert_sharding", "local_pairs", "moe_expert_parallel"]
