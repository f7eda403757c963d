"""Parameter counts of a config, from the abstract model (``nnx.eval_shape``: no memory used)."""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
from flax import nnx

from k3jax.config import K3Config
from k3jax.model import K3Model


class ParamCount(NamedTuple):
    """total: every parameter. active: read per token = all but the routed experts not chosen and the
    embedding table (one row of it is read), counting the output head."""

    total: int
    active: int
    routed_experts: int
    embedding: int


def _name(path) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def count_params(cfg: K3Config) -> ParamCount:
    abstract = nnx.eval_shape(lambda: K3Model(cfg, rngs=nnx.Rngs(0)))
    total = routed = embedding = 0
    for path, var in jax.tree_util.tree_flatten_with_path(
        nnx.state(abstract, nnx.Param), is_leaf=lambda x: isinstance(x, nnx.Variable)
    )[0]:
        size = math.prod(var.shape)
        total += size
        name = _name(path)
        if "experts" in name:
            routed += size
        if name[0] == "embed_tokens":
            embedding += size
    chosen = routed * cfg.moe.experts_per_token // cfg.moe.num_experts
    return ParamCount(total, total - routed + chosen - embedding, routed, embedding)


__all__ = ["ParamCount", "count_params"]
