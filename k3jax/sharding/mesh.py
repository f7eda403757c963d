"""The mesh (axes data, expert, tensor), the with-block that runs a model on it, and parameters placed by
the rules table.

    mesh = make_mesh("expert=4,tensor=2")           # the other axes 1; their product = the device count
    model = place(model, mesh)                     # each parameter split as k3jax.sharding.rules says
    with on_mesh(mesh):
        logits = jax.jit(forward)(params, tokens)  # XLA partitions the rest; the MoE exchanges rows itself

Tensor and data parallelism come from the placement: XLA's partitioner follows the parameters' and
tokens' shardings (a column-split projection then a row-split one: one reduction per block). The MoE
layers, which route tokens data-dependently, run under ``shard_map`` (``k3jax.sharding.experts``) and read
the mesh of the enclosing ``on_mesh`` at trace time, like the implementation switch.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Any, Mapping

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from k3jax.arguments import integer
from k3jax.implementation import scoped
from k3jax.sharding.rules import MESH_AXES, ShardingError, batch_spec, cache_spec, mesh_axis, param_spec

_MESH: contextvars.ContextVar[Mesh | None] = contextvars.ContextVar("k3jax_mesh", default=None)


def parse_mesh(text: str) -> dict[str, int]:
    """'expert=4,tensor=2' -> {'data': 1, 'expert': 4, 'tensor': 2}; ValueError naming the part that is off."""
    sizes = dict.fromkeys(MESH_AXES, 1)
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = part.partition("=")
        if name not in sizes or not value.isdigit() or int(value) < 1:
            raise ValueError(f"mesh: {part!r}; expected axis=size with axis one of {', '.join(MESH_AXES)} and "
                             f"size a positive integer, e.g. 'expert=4,tensor=2'")
        sizes[name] = int(value)
    return sizes


def mesh_shape(sizes: str | Mapping[str, int]) -> tuple[int, ...]:
    """The sizes of the axes (data, expert, tensor) from 'expert=4,tensor=2' or a mapping (absent axes 1);
    ValueError or TypeError naming what is off."""
    sizes = parse_mesh(sizes) if isinstance(sizes, str) else {**dict.fromkeys(MESH_AXES, 1), **sizes}
    unknown = set(sizes) - set(MESH_AXES)
    if unknown:
        raise ValueError(f"mesh: unknown axes {sorted(unknown)}; the axes are {', '.join(MESH_AXES)}")
    return tuple(integer(f"mesh: {a}", sizes[a], minimum=1) for a in MESH_AXES)


def make_mesh(sizes: str | Mapping[str, int], devices=None) -> Mesh:
    """A mesh with axes (data, expert, tensor) over ``devices`` (default: all, over every process); ``sizes``
    a mapping or 'expert=4,tensor=2' (absent axes 1). Their product must be the device count."""
    shape = mesh_shape(sizes)
    devices = list(jax.devices() if devices is None else devices)
    if math.prod(shape) != len(devices):
        raise ValueError(f"mesh: {dict(zip(MESH_AXES, shape))} needs {math.prod(shape)} devices; "
                         f"{len(devices)} are available")
    return jax.make_mesh(shape, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3, devices=devices)


def on_mesh(mesh: Mesh) -> contextlib.AbstractContextManager:
    """Trace the model inside this block for ``mesh``: its MoE layers exchange tokens over ``expert``."""
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh: expected a jax.sharding.Mesh, got {type(mesh).__name__}")
    return scoped(_MESH, mesh)


def current_mesh() -> Mesh | None:
    return _MESH.get()


def _canonical(path: tuple) -> str:
    """A state leaf's key path as the canonical dotted name, without nnx's ``value`` step (an MXTensor's
    ``codes``/``scales`` keep theirs)."""
    names = (str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)
    return ".".join(n for n in names if n not in ("value", "raw_value"))


def param_shardings(model: Any, mesh: Mesh) -> Any:
    """The ``NamedSharding`` of every parameter of a ``K3Model`` (or of its ``nnx.State``, with the model's
    config given by ``model.cfg``), as a pytree shaped like ``nnx.split(model)[1]``."""
    state = nnx.state(model)
    cfg = model.cfg

    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: NamedSharding(mesh, param_spec(cfg, _canonical(path), tuple(leaf.shape), mesh)), state)


def constrain_cache(cache: Any, mesh: Mesh) -> Any:
    """An inference cache (inside a jitted function) held where ``rules.CACHE_AXES`` says."""
    def one(path, leaf):
        field = getattr(path[-1], "name", None)
        return jax.lax.with_sharding_constraint(leaf, NamedSharding(mesh, cache_spec(field, leaf.shape, mesh)))

    return jax.tree_util.tree_map_with_path(one, cache)


def hold(x: jax.Array, *logical: str | None) -> jax.Array:
    """Inside a traced model under ``on_mesh``: an activation held where its dims' logical axes (``rules.RULES``;
    None: whole) put it; as is without a mesh. The model holds its layers' inputs and outputs [B, T, D] split by
    batch only, and the MoE its shared experts' hidden [B, T, F] by batch and ``mlp``, so that XLA's partitioner
    keeps the attention data-parallel and reduces the tensor split's partial sums, rather than gathering weights
    to follow the MoE's token split."""
    mesh = current_mesh()
    if mesh is None:
        return x
    spec = PartitionSpec(*(mesh_axis(a, n, mesh) for a, n in zip(logical, x.shape)))
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def hold_batch(tree: Any) -> Any:
    """``hold`` for every array [..., B, T, D] in ``tree`` (a layer's carry: activations, AttnRes blocks): split
    by batch, whole otherwise."""
    return jax.tree.map(lambda x: hold(x, *(None,) * (x.ndim - 3), "batch", None, None) if x.ndim >= 3 else x, tree)


def place(model: Any, mesh: Mesh) -> Any:
    """``model`` with every parameter moved to its sharding on ``mesh`` (``param_shardings``)."""
    graph, state = nnx.split(model)
    state = jax.device_put(state, param_shardings(model, mesh))
    return nnx.merge(graph, state)


def place_batch(x: jax.Array, mesh: Mesh) -> jax.Array:
    """Tokens or activations [B, ...] with the batch split as the rules say (over data x expert where it divides)."""
    return jax.device_put(x, NamedSharding(mesh, batch_spec(x.shape[0], mesh, x.ndim)))


def place_local_batch(rows: Any, mesh: Mesh, batch: int) -> jax.Array:
    """Several processes (``jax.distributed``): a global batch [``batch``, ...] placed as ``place_batch`` does,
    from each process's ``rows``: the whole batch (the same on every process), or only the rows its own
    devices hold, in order (``jax.make_array_from_process_local_data``)."""
    spec = batch_spec(batch, mesh, rows.ndim)
    return jax.make_array_from_process_local_data(NamedSharding(mesh, spec), rows, (batch, *rows.shape[1:]))


__all__ = ["ShardingError", "constrain_cache", "current_mesh", "hold", "hold_batch", "make_mesh", "mesh_shape",
           "on_mesh", "param_shardings", "parse_mesh", "place", "place_batch", "place_local_batch"]
