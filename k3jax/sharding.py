"""Expert parallelism: the MoE dispatch under ``shard_map`` with routed experts split over a mesh axis.

    mesh = jax.make_mesh((4,), ("expert",))
    with k3jax.sharding.expert_parallel(mesh):
        logits = forward(params, tokens)      # params: experts placed with ``expert_sharding``

Each device holds E / n experts (arrays or MXFP4 ``MXTensor`` stacks) and sees every token; it runs
the sorted dispatch for the token copies routed to its own experts (the rest sort to the end, past
the last group, and come out zero), and one ``psum`` over the axis combines the partial outputs.
Like the implementation switch, the mesh is read at trace time.
"""

from __future__ import annotations

import contextlib
import contextvars
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from k3jax.functional.moe import Activation, moe_sorted
from k3jax.implementation import scoped
from k3jax.typing import Array

EXPERT_AXIS = "expert"
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


def moe_expert_parallel(
    x: Array, w1, w3, w2, weights: Array, experts: Array, act: Activation, matmul, mesh: Mesh,
    axis: str = EXPERT_AXIS,
) -> Array:
    """``moe_sorted`` with the expert stacks w1, w3, w2 [E, ...] split over ``axis``; x [T, R],
    weights and experts [T, k] replicated. Returns [T, R], replicated."""
    E, n = w1.shape[0], mesh.shape[axis]
    if E % n:
        raise ValueError(f"num_experts {E} does not divide over mesh axis {axis!r} of size {n}")
    local = E // n

    def shard(x, w1, w3, w2, weights, experts):
        first = jax.lax.axis_index(axis) * local
        mine = (experts >= first) & (experts < first + local)
        local_experts = jnp.where(mine, experts - first, local)  # `local`: not here, sorts last
        y = moe_sorted(x, w1, w3, w2, jnp.where(mine, weights, 0.0), local_experts, act, matmul=matmul)
        return jax.lax.psum(y.astype(jnp.float32), axis).astype(x.dtype)

    split, whole = PartitionSpec(axis), PartitionSpec()
    return jax.shard_map(shard, mesh=mesh, in_specs=(whole, split, split, split, whole, whole),
                         out_specs=whole)(x, w1, w3, w2, weights, experts)


__all__ = ["EXPERT_AXIS", "expert_parallel", "expert_mesh", "expert_sharding", "moe_expert_parallel"]
