"""The training objective: next-token cross-entropy of a ``K3Model`` over masked targets, in the parameter
dtype or a lower compute dtype, and the router's bias-only load balancing (spec section 5).

Parameters travel as the pure dict of ``nnx.to_pure_dict`` (float32 master weights); ``forward_params``
casts them for the forward where a compute dtype is asked for, except those the model keeps in float32
whatever its ``param_dtype`` (conv weights, ``A_log``, the router's correction bias): the dtypes of a
model built with ``param_dtype=compute_dtype``.
"""

from __future__ import annotations

import math
import re
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.config import K3Config
from k3jax.model import K3Model
from k3jax.typing import Array

Params = dict[str, Any]  # nnx.to_pure_dict of the model's state: float32 master weights
_BIAS = re.compile(r"\['layers'\]\[(\d+)\]\['block_sparse_moe'\]\['gate'\]\['e_score_correction_bias'\]$")


class LossParts(NamedTuple):
    """Sums over one batch: the negative log-likelihood (nats), the targets counted, the expert load
    per layer [L, E] (zeros without routed experts)."""

    nll: Array
    count: Array
    load: Array


def compute_dtypes(cfg: K3Config, dtype: Any) -> Params:
    """Each parameter's forward dtype when the model computes in ``dtype`` (a pure dict of dtypes)."""
    abstract = nnx.eval_shape(lambda: K3Model(cfg, rngs=nnx.Rngs(0), param_dtype=dtype, packed_experts=False))
    return jax.tree.map(lambda a: a.dtype, nnx.to_pure_dict(nnx.state(abstract)))


def forward_params(params: Params, dtypes: Params | None) -> Params:
    """``params`` cast to ``dtypes`` (None: as they are)."""
    return params if dtypes is None else jax.tree.map(lambda p, d: p.astype(d), params, dtypes)


def cross_entropy(logits: Array, targets: Array, mask: Array) -> tuple[Array, Array]:
    """(summed nats, target count): logits [B, T, V] float32, targets [B, T] int, mask [B, T] (0 = padding)."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return jnp.sum(nll * mask), jnp.sum(mask)


def loss_parts(graphdef: nnx.GraphDef, params: Params, tokens: Array, mask: Array, dtypes: Params | None = None,
               scan_layers: bool = True) -> LossParts:
    """Summed next-token nats of tokens [B, T + 1] (inputs tokens[:, :-1], targets tokens[:, 1:], weighted by
    mask [B, T]) and the expert load of the forward."""
    model = nnx.merge(graphdef, forward_params(params, dtypes))
    logits, _, stats = model.inspect(tokens[:, :-1], scan_layers=scan_layers)
    nll, count = cross_entropy(logits, tokens[:, 1:], mask)
    return LossParts(nll, count, stats.expert_load)


def balance_router_bias(params: Params, load: Array, rate: float) -> Params:
    """The bias-only load balancing (spec section 5; DeepSeek-V3's rule): each MoE layer's correction
    bias moves by ``rate`` toward under-loaded experts, bias_e += rate * sign(mean load - load_e).
    ``load`` [L, E] from ``LossParts``. The bias only picks experts, so no gradient reaches it."""
    if rate == 0:
        return params

    def update(path, leaf):
        found = _BIAS.search(jax.tree_util.keystr(path))
        if not found:
            return leaf
        layer_load = load[int(found.group(1))]
        return leaf + rate * jnp.sign(jnp.mean(layer_load) - layer_load)

    return jax.tree_util.tree_map_with_path(update, params)


def bits_per_byte(nats: float, count: float) -> float:
    """Nats over ``count`` byte targets as bits per byte (a byte-level model: one token is one byte)."""
    return nats / max(count, 1.0) / math.log(2.0)


__all__ = ["LossParts", "Params", "balance_router_bias", "bits_per_byte", "compute_dtypes", "cross_entropy",
           "forward_params", "loss_parts"]
