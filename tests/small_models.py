"""One model per small preset, built and jitted once per test run (the ``small_model`` fixture and tests that
build a preset themselves share it)."""

from dataclasses import dataclass

import jax
import numpy as np
from flax import nnx

from k3jax.model import K3Model
from k3jax.presets import preset


@dataclass
class Built:
    model: K3Model
    params: object
    forward: object  # jitted (params, tokens) -> logits

    @property
    def cfg(self):
        return self.model.cfg


_BUILT: dict[tuple, Built] = {}


def randomize_zero_params(model: K3Model, seed: int = 7) -> None:
    """Give zero-initialized parameters (AttnRes queries, router correction bias) random values, so
    tests exercise them: a zero query would make every mix a plain average."""
    graph, params = nnx.split(model)
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    leaves = [
        0.5 * jax.random.normal(k, x.shape, x.dtype) if x.dtype.kind == "f" and not np.asarray(x).any() else x
        for k, x in zip(keys, leaves)
    ]
    nnx.update(model, jax.tree.unflatten(treedef, leaves))


def build(name: str, *, packed_experts: bool | None = None, **changes) -> Built:
    """The preset ``name`` with ``changes`` to its ``K3Config`` (fewer ``layer_types``, say), seed-0 weights (routed
    experts packed by ``packed_experts``, default the config's), the zero-initialized ones drawn
    (``randomize_zero_params``): built once per run for each set of arguments."""
    key = (name, packed_experts, tuple(sorted(changes.items())))
    if key not in _BUILT:
        model = K3Model(preset(name).replace(**changes), rngs=nnx.Rngs(0), packed_experts=packed_experts)
        randomize_zero_params(model)
        graph, params = nnx.split(model)
        forward = jax.jit(lambda p, t: nnx.merge(graph, p)(t))
        _BUILT[key] = Built(model, params, forward)
    return _BUILT[key]
