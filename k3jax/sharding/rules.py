"""The sharding rules: every parameter's logical axes, and the mesh axes each logical axis is split over.

Two tables, read by placement (``k3jax.load(..., mesh=)``, ``place``), generation, training and
``k3jax memory --mesh`` alike; no module carries sharding code of its own.

``PARAM_AXES``: a parameter's canonical path (``layers.7.self_attn.q_proj.weight``) -> the logical
axis of each of its dims (None: not split). ``RULES``: logical axis -> the mesh axes it is split over:

    experts  routed-expert stacks [E, ...]                       -> expert x tensor
    heads    KDA and MLA heads (projections into and out of them) -> tensor
    mlp      dense-MLP and shared-expert widths                   -> tensor
    vocab    embedding and output-head rows                       -> tensor
    batch    activations' and caches' batch                       -> data x expert

The routed experts (93% of K3's bytes) spread over every device of a model copy, the rest of the
weights over ``tensor``; the attention runs data-parallel over ``expert`` (each expert-group device
attends for its share of the batch, its cache holding only those sequences) and the MoE exchanges
tokens between them. A dim is split over the rule's axes the mesh has (more than one device each)
where their product divides it (for ``heads``: the layer's head count, so a device holds whole heads);
where it does not, the last axis is dropped and the rest tried, down to none: the dim stays whole on
every device, as does every dim of a parameter whose logical axes are all None (norms, the router, the
MLA down projections, the latent maps). The MLA latent cache is never split by heads: every head reads
all of it (its up projections are absorbed into the query and output), so splitting by heads would mean
caching per-head keys and values, H x (192 + 128) values a token against 576.
"""

from __future__ import annotations

import math
import re
from typing import Mapping

from jax.sharding import Mesh, PartitionSpec

from k3jax.config import K3Config

DATA, EXPERT, TENSOR = "data", "expert", "tensor"
MESH_AXES = (DATA, EXPERT, TENSOR)

RULES: Mapping[str, tuple[str, ...]] = {"experts": (EXPERT, TENSOR), "heads": (TENSOR,), "mlp": (TENSOR,),
                                        "vocab": (TENSOR,), "batch": (DATA, EXPERT)}

_HEADS_IN = ("heads", None)  # [heads x head dim, input]
_HEADS_OUT = (None, "heads")  # [D, heads x head dim]
_WHOLE = ()  # every dim whole (the tuple is padded with None)

# (regex searched in the canonical path, logical axes of the leading dims); the first match wins
PARAM_AXES: tuple[tuple[str, tuple[str | None, ...]], ...] = (
    (r"^(embed_tokens|lm_head)\.weight$", ("vocab", None)),
    (r"\.experts\.w[123]$", ("experts", None, None)),
    (r"\.(mlp|shared_experts)\.(gate_proj|up_proj)\.weight$", ("mlp", None)),
    (r"\.(mlp|shared_experts)\.down_proj\.weight$", (None, "mlp")),
    # KDA: q, k, v, output gate, beta, the gate's up maps, the short convs, A_log, dt_bias; MLA: q (or q_b),
    # kv_b; both: o_proj
    (r"\.self_attn\.(q|k|v|g|b|q_b|kv_b)_proj\.weight$", _HEADS_IN),
    (r"\.self_attn\.(f_b|g_b)_proj\.weight$", _HEADS_IN),
    (r"\.self_attn\.[qkv]_conv1d\.weight$", ("heads", None, None)),
    (r"\.self_attn\.(A_log|dt_bias)$", ("heads",)),
    (r"\.self_attn\.o_proj\.weight$", _HEADS_OUT),
    (r"\.self_attn\.(f_a|g_a|q_a|kv_a)_proj(_with_mqa)?\.weight$", _WHOLE),
    (r"\.block_sparse_moe\.(gate\.weight|gate\.e_score_correction_bias)$", _WHOLE),
    (r"\.block_sparse_moe\.routed_expert_(down|up)_proj\.weight$", _WHOLE),
    (r"(norm|layernorm|_res\.proj)\.weight$", _WHOLE),
)


class ShardingError(ValueError):
    """A parameter the table does not cover, or a mesh the model cannot use."""


def logical_axes(path: str, ndim: int) -> tuple[str | None, ...]:
    """The logical axis of each of a parameter's ``ndim`` dims (None: whole); ``ShardingError`` for a path the
    table does not know."""
    for pattern, axes in PARAM_AXES:
        if re.search(pattern, path):
            return tuple(axes) + (None,) * (ndim - len(axes))
    raise ShardingError(f"{path}: no entry in k3jax.sharding.rules.PARAM_AXES says how to split it")


def _heads(cfg: K3Config, path: str) -> int:
    layer = re.match(r"layers\.(\d+)\.", path)
    if layer is None:
        raise ShardingError(f"{path}: a head-split parameter outside a layer")
    return cfg.kda.num_heads if cfg.layer_types[int(layer.group(1))] == "kda" else cfg.mla.num_heads


def split_axes(mesh: Mesh, exclude: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The mesh's axes (in ``MESH_AXES`` order) with more than one device, but those in ``exclude``."""
    return tuple(a for a in MESH_AXES if a in mesh.axis_names and mesh.shape[a] > 1 and a not in exclude)


def mesh_axes(logical: str | None, size: int, mesh: Mesh, units: int | None = None) -> tuple[str, ...]:
    """The mesh axes a dim of ``size`` with logical axis ``logical`` is split over: the rule's axes that the
    mesh has with more than one device, the last dropped while their product does not divide ``units``
    (heads; default ``size``). Empty: the dim stays whole."""
    axes = [a for a in RULES.get(logical, ()) if a in split_axes(mesh)] if logical else []
    count = units if units is not None else size
    while axes and count % math.prod(mesh.shape[a] for a in axes):
        axes.pop()
    return tuple(axes)


def mesh_axis(logical: str | None, size: int, mesh: Mesh, units: int | None = None) -> str | tuple[str, ...] | None:
    """``mesh_axes`` as a ``PartitionSpec`` entry: None, one axis name, or a tuple of them."""
    axes = mesh_axes(logical, size, mesh, units)
    return None if not axes else axes[0] if len(axes) == 1 else axes


def devices_over(entry: str | tuple[str, ...] | None, mesh: Mesh) -> int:
    """How many devices a ``PartitionSpec`` entry splits a dim over."""
    axes = () if entry is None else (entry,) if isinstance(entry, str) else entry
    return math.prod(mesh.shape[a] for a in axes)


def param_spec(cfg: K3Config, path: str, shape: tuple[int, ...], mesh: Mesh) -> PartitionSpec:
    """Where a parameter's dims live on ``mesh``, from the two tables. ``path``: canonical dotted path (an
    ``MXTensor``'s ``.codes``/``.scales`` take their parameter's rule: the blocks run along the last dim)."""
    path = re.sub(r"\.(codes|scales)$", "", path)
    axes = logical_axes(path, len(shape))
    return PartitionSpec(*(mesh_axis(a, n, mesh, _heads(cfg, path) if a == "heads" else None)
                           for a, n in zip(axes, shape)))


# an inference cache's arrays (``KDAState``, ``MLACache`` fields) -> the logical axes of their trailing dims (leading
# dims: a scanned group's stacked layers). The conv inputs hold q, k and v channels side by side, not whole heads.
CACHE_AXES: Mapping[str, tuple[str | None, ...]] = {
    "recurrent": ("batch", "heads", None, None),  # KDA state [B, H, K, V]
    "conv": ("batch", None, None),  # KDA short-conv inputs [B, W-1, 3*H*K]
    "c_kv": ("batch", None, None),  # MLA latents [B, S, R]: every head reads all of them
    "k_pe": ("batch", None, None),  # [B, S, P]
}


def cache_spec(field: str, shape: tuple[int, ...], mesh: Mesh) -> PartitionSpec:
    """Where a cache array (``CACHE_AXES`` field ``field``) lives: the batch as ``RULES`` says (data x expert), KDA
    heads over ``tensor``, each where it divides."""
    axes = CACHE_AXES[field]
    lead = len(shape) - len(axes)
    return PartitionSpec(*(None,) * lead, *(mesh_axis(a, n, mesh) for a, n in zip(axes, shape[lead:])))


def batch_spec(batch: int, mesh: Mesh, ndim: int) -> PartitionSpec:
    """Activations or caches [B, ...]: the batch split as ``RULES`` says (data x expert, where it divides)."""
    return PartitionSpec(mesh_axis("batch", batch, mesh), *(None,) * (ndim - 1))


def spec_bytes(shape: tuple[int, ...], itemsize: float, spec: PartitionSpec, mesh: Mesh) -> float:
    """Bytes one device holds of an array of ``shape`` placed by ``spec``."""
    n = 1.0
    for size, entry in zip(shape, tuple(spec) + (None,) * len(shape)):
        n *= size / devices_over(entry, mesh)
    return n * itemsize


def describe(spec: PartitionSpec) -> str:
    """'[expert*tensor, -, -]'-style text of a spec."""
    return "[" + ", ".join("-" if not a else a if isinstance(a, str) else "*".join(a) for a in spec) + "]"


__all__ = ["CACHE_AXES", "DATA", "EXPERT", "MESH_AXES", "PARAM_AXES", "RULES", "ShardingError", "TENSOR", "batch_spec",
           "cache_spec", "describe", "devices_over", "logical_axes", "mesh_axes", "mesh_axis", "param_spec",
           "spec_bytes", "split_axes"]

