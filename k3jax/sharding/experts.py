"""Expert parallelism: the routed experts' sum under ``shard_map``, the expert stacks split over the n devices
of the mesh axes ``expert`` x ``tensor`` (``rules.RULES``), in one of two forms.

- **Replicated tokens** (decode at small batch): every device of the expert group sees the group's tokens,
  runs its own E / n experts on the pairs routed to them (other pairs get expert id E / n, past its last,
  and add nothing), and one ``psum`` over the group adds the partial outputs.
- **Exchanged rows** (prefill, large batches): tokens are split over every mesh axis; each device sorts its
  (token, expert) pairs by the device holding the expert and sends each pair's latent row only there
  (``jax.lax.ragged_all_to_all`` on GPU and TPU; on the CPU, which lacks it, an all-gather of every
  device's rows from which each takes its own), runs its experts on what it received, and sends the
  results back to the same slots; each token then sums its k results in pair order. Dropless: the
  receive buffer holds every pair of every device, so no routing, however skewed, drops a token.

``KernelPolicy.expert_exchange_min_tokens`` chooses between them. Tokens are padded to a multiple of the
devices they are split over (padding pairs go nowhere). Where E does not divide over the group the stacks
stay whole and each device runs every expert on its own tokens.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from k3jax.implementation import current
from k3jax.sharding.rules import EXPERT, devices_over, mesh_axes, split_axes
from k3jax.typing import Array

LocalMoE = Callable[[Array, Array, Array, Array, Array, Array], Array]


def expert_sharding(mesh: Mesh, num_experts: int, axis: str = EXPERT) -> NamedSharding:
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


def _padded(x: Array, weights: Array, experts: Array, multiple: int, num_experts: int):
    """Tokens padded to a multiple of ``multiple``; padding pairs weigh 0 and go to expert E (nowhere)."""
    pad = -x.shape[0] % multiple
    if not pad:
        return x, weights, experts
    return (jnp.pad(x, ((0, pad), (0, 0))), jnp.pad(weights, ((0, pad), (0, 0))),
            jnp.pad(experts, ((0, pad), (0, 0)), constant_values=num_experts))


def moe_expert_parallel(x: Array, w1, w3, w2, weights: Array, experts: Array, local_moe: LocalMoE, mesh: Mesh,
                        exchange: bool | None = None) -> Array:
    """The routed experts' sum on ``mesh``: x [T, R], weights and experts [T, k]; stacks w1, w3, w2 [E, ...]
    (arrays or ``MXTensor``). ``local_moe(x, w1, w3, w2, weights, experts)`` runs a device's experts with
    ``moe_sorted``'s contract (pairs whose expert is past its stacks add nothing). ``exchange``: the
    exchanged-rows form (default: from ``T`` and the policy in force). Returns [T, R] in x's dtype."""
    T, E = x.shape[0], w1.shape[0]
    group = mesh_axes("experts", E, mesh)  # the axes the stacks are split over
    if exchange is None:
        exchange = T >= current().policy.expert_exchange_min_tokens
    tokens = split_axes(mesh) if exchange or not group else split_axes(mesh, exclude=group)
    xp, wp, ep = _padded(x, weights, experts, devices_over(tokens, mesh), E)
    rows, stacks = PartitionSpec(tokens or None), PartitionSpec(group or None)
    if not group:
        body = local_moe
    elif exchange:
        body = lambda *a: _exchanged(*a, local_moe=local_moe, axis=group, n=devices_over(group, mesh),
                                     ragged=_has_ragged(mesh))
    else:
        body = lambda *a: _replicated(*a, local_moe=local_moe, axis=group)
    # check_vma: a pallas_call's outputs (ShapeDtypeStruct) say nothing of how they vary over the mesh, which
    # the check refuses
    y = jax.shard_map(body, mesh=mesh, in_specs=(rows, stacks, stacks, stacks, rows, rows), out_specs=rows,
                      check_vma=False)(xp, w1, w3, w2, wp, ep)
    return y[:T]


def _replicated(x, w1, w3, w2, weights, experts, *, local_moe: LocalMoE, axis: tuple[str, ...]) -> Array:
    local = w1.shape[0]
    y = local_moe(x, w1, w3, w2, *local_pairs(weights, experts, jax.lax.axis_index(axis) * local, local))
    return jax.lax.psum(y.astype(jnp.float32), axis).astype(x.dtype)


def _exchanged(x, w1, w3, w2, weights, experts, *, local_moe: LocalMoE, axis: tuple[str, ...], n: int,
               ragged: bool) -> Array:
    """One device's part of the exchanged-rows form: x [t, R], pairs [t, k]; returns [t, R]."""
    t, k = experts.shape
    local, pairs = w1.shape[0], t * k
    flat = experts.reshape(-1)
    dest = flat // local  # n for padding pairs: sent nowhere
    order = jnp.argsort(dest, stable=True)
    sizes = jnp.sum(dest[:, None] == jnp.arange(n), axis=0, dtype=jnp.int32)  # [n] pairs I send each device
    every = jax.lax.all_gather(sizes, axis)  # [n source, n destination]
    me = jax.lax.axis_index(axis)
    send_at = jnp.cumsum(sizes) - sizes  # where my rows for each destination start in my sorted rows
    place_at = (jnp.cumsum(every, axis=0) - every)[me]  # where they land in each destination's buffer
    recv = every[:, me]  # what each source sends me
    recv_at = (jnp.cumsum(every, axis=0) - every)[:, me]  # where it lands in my buffer
    back_at = (jnp.cumsum(every, axis=1) - every)[:, me]  # where it started in its source's sorted rows
    send = _ragged_all_to_all if ragged else _gathered_all_to_all
    capacity = n * pairs

    def there(a, fill=0):
        buffer = jnp.full((capacity, *a.shape[1:]), fill, a.dtype)
        return send(a[order], buffer, send_at, sizes, place_at, recv, axis)

    rows = there(x[jnp.arange(pairs) // k])  # each pair's token row
    ids = there(flat - dest * local, fill=local)  # my experts numbered from 0; empty slots past them
    y = local_moe(rows, w1, w3, w2, there(weights.reshape(-1))[:, None], ids[:, None])
    back = send(y, jnp.zeros((pairs, y.shape[1]), y.dtype), recv_at, recv, back_at, sizes, axis)
    slot = jnp.zeros_like(order).at[order].set(jnp.arange(pairs, dtype=order.dtype), unique_indices=True)
    return jnp.sum(back[slot].astype(jnp.float32).reshape(t, k, -1), axis=1).astype(x.dtype)


def _has_ragged(mesh: Mesh) -> bool:
    """Whether the mesh's backend runs ``ragged_all_to_all`` (XLA's CPU backend does not)."""
    return mesh.devices.flat[0].platform in ("gpu", "cuda", "rocm", "tpu")


def _ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis):
    return jax.lax.ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                                     axis_name=axis)


def _gathered_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis):
    """``ragged_all_to_all``'s result from an all-gather: every device's rows and offsets, of which each takes
    the runs addressed to it."""
    rows = jax.lax.all_gather(operand, axis)  # [n, M, ...]
    starts, counts, lands = (jax.lax.all_gather(a, axis) for a in (input_offsets, send_sizes, output_offsets))
    me = jax.lax.axis_index(axis)
    starts, counts, lands = starts[:, me], counts[:, me], lands[:, me]  # [n sources]
    slot = jnp.arange(output.shape[0])
    inside = (slot[:, None] >= lands) & (slot[:, None] < lands + counts)  # [slots, sources]
    source = jnp.argmax(inside, axis=1)
    row = jnp.clip(starts[source] + slot - lands[source], 0, operand.shape[0] - 1)
    taken = rows[source, row]
    return jnp.where(inside.any(axis=1).reshape(-1, *(1,) * (output.ndim - 1)), taken, output)


__all__ = ["expert_sharding", "local_pairs", "moe_expert_parallel"]
