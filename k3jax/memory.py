"""What inference needs in memory: weights (as stored), the KDA states (fixed per sequence) and the
MLA latent cache (growing with context); on a mesh, what one device holds of each and what it sends per token.

Two sources for the weights. ``estimate`` (one device, no mesh) counts parameters (``count_params``): every
one at 2 bytes (bf16) but the routed experts, at MXFP4's 4.25 bits where the config stores them so.
``per_device`` walks the model's abstract parameters (``nnx.eval_shape``, nothing allocated) in the dtypes
the model keeps them (bf16; MXFP4 experts as uint8 codes and scales, exactly the 4.25 bits; the KDA
convolutions, ``A_log``, ``dt_bias`` and the router's correction bias float32) and applies the sharding rules
(``k3jax.sharding.rules``) to each: what ``k3jax.sharding.place`` puts on a device, to the byte. The walked sum
on a one-device mesh exceeds ``estimate``'s by 2 bytes per float32 parameter (22 MB of K3's 1.56 TB).
"""

from __future__ import annotations

import functools
import math
import re
from typing import Mapping, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AbstractMesh

from k3jax.arguments import integer
from k3jax.config import K3Config
from k3jax.model import K3Model
from k3jax.param_count import count_params
from k3jax.sharding.mesh import mesh_shape
from k3jax.sharding.rules import (DATA, MESH_AXES, RULES, cache_spec, devices_over, mesh_axes, mesh_axis, param_spec,
                                  spec_bytes, split_axes)

MXFP4_BYTES = 0.5 + 1 / 32  # a 4-bit code per element plus one E8M0 byte per 32-element block
ACTIVATION_BYTES = 2  # bf16 activations between devices


class MemoryEstimate(NamedTuple):
    weights: float  # bytes, routed experts in MXFP4 (if the config says so), the rest bf16
    kda_state_per_seq: float  # float32 [H, K, V] state + 3 short-conv inputs per channel, all KDA layers
    mla_cache_per_token: float  # c_kv + k_pe per token, all MLA layers, in cache_bytes per value
    context: int
    batch: int

    @property
    def per_sequence(self) -> float:
        return self.kda_state_per_seq + self.mla_cache_per_token * self.context

    @property
    def total(self) -> float:
        return self.weights + self.batch * self.per_sequence


def _sizes(context, batch, cache_bytes) -> tuple[int, int, int]:
    return (integer("context", context, minimum=1), integer("batch", batch, minimum=1),
            integer("cache_bytes", cache_bytes, minimum=1))


def estimate(cfg: K3Config, context: int, batch: int = 1, cache_bytes: int = 2) -> MemoryEstimate:
    """Bytes for ``batch`` sequences of ``context`` tokens, MLA latents stored in ``cache_bytes`` per value; each of
    the three a positive integer (TypeError or ValueError naming it otherwise)."""
    context, batch, cache_bytes = _sizes(context, batch, cache_bytes)
    counts = count_params(cfg)
    expert_bytes = MXFP4_BYTES if cfg.mx_experts else 2
    weights = (counts.total - counts.routed_experts) * 2 + counts.routed_experts * expert_bytes
    n_kda, n_mla = cfg.layer_types.count("kda"), cfg.layer_types.count("mla")
    kda_state = n_kda * 4 * _kda_values(cfg)
    mla_token = n_mla * cache_bytes * (cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim)
    return MemoryEstimate(weights, kda_state, mla_token, context, batch)


def _kda_values(cfg: K3Config) -> int:
    """Per sequence and KDA layer: the state [H, K, V] and the q, k, v convs' last conv_size - 1 inputs [H*K]."""
    k = cfg.kda
    return k.num_heads * k.head_dim * k.head_dim + 3 * (k.conv_size - 1) * k.num_heads * k.head_dim


def abstract_mesh(sizes: str | Mapping[str, int]) -> AbstractMesh:
    """Mesh axes (data, expert, tensor) of these sizes, with no devices: what the rules table reads.
    ``sizes``: 'expert=8,tensor=2' or a mapping (absent axes 1); ValueError naming what is off."""
    return AbstractMesh(mesh_shape(sizes), MESH_AXES)  # (axis_sizes, axis_names): the same in JAX 0.10 and 0.11


@functools.lru_cache(maxsize=8)
def _leaves(cfg: K3Config) -> tuple[tuple[str, tuple[int, ...], int], ...]:
    """(canonical path, shape, itemsize) of every array the model holds, an ``MXTensor`` as its ``.codes`` and
    ``.scales``; from the abstract model (K3: 3,012 arrays, about 2 s on a CPU, once per config)."""
    model = nnx.eval_shape(lambda: K3Model(cfg, rngs=nnx.Rngs(0), param_dtype=jnp.bfloat16))
    out = []
    for path, var in nnx.to_flat_state(nnx.state(model)):
        name = ".".join(map(str, path))
        for sub, leaf in jax.tree_util.tree_leaves_with_path(var.get_value()):
            suffix = jax.tree_util.keystr(sub, simple=True, separator=".")
            out.append((f"{name}.{suffix}" if suffix else name, tuple(leaf.shape), jnp.dtype(leaf.dtype).itemsize))
    return tuple(out)


class DeviceWeights(NamedTuple):
    """Bytes of parameters one device holds: all, the routed-expert stacks' share, and what is whole on every
    device (no rule splits it on this mesh)."""

    total: float
    routed_experts: float
    whole: float


def device_weights(cfg: K3Config, mesh: AbstractMesh) -> DeviceWeights:
    """Each parameter's bytes on one device, placed by ``k3jax.sharding.rules`` (``param_spec``, ``spec_bytes``)."""
    total = routed = whole = 0.0
    for path, shape, itemsize in _leaves(cfg):
        spec = param_spec(cfg, path, shape, mesh)
        held = spec_bytes(shape, itemsize, spec, mesh)
        total += held
        routed += held if re.search(r"\.experts\.w[123]\b", path) else 0.0
        whole += held if not any(spec) else 0.0
    return DeviceWeights(total, routed, whole)


class Communication(NamedTuple):
    """Bytes one device sends for each token its data group (one copy of the model: the expert x tensor devices
    of one ``data`` index) processes: per layer of each kind, then per token for the embedding and output head."""

    kda_attention: float  # per KDA layer
    mla_attention: float  # per MLA layer
    dense_mlp: float  # per dense-MLP layer
    shared_experts: float  # per MoE layer
    moe_exchanged: float  # per MoE layer, routed experts, exchanged rows (prefill)
    moe_replicated: float  # per MoE layer, routed experts, replicated tokens (decode)
    embedding: float  # once per token
    head: float  # once per token whose logits are read


def _all_reduce(n: int, nbytes: float) -> float:
    return 2 * (n - 1) / n * nbytes


def _all_gather(n: int, nbytes: float) -> float:
    return (n - 1) / n * nbytes


def communication(cfg: K3Config, mesh: AbstractMesh, batch: int) -> Communication:
    """What the placement makes each device send for ``batch`` sequences, per token its data group processes
    (data parallelism itself sends nothing at inference). Modelled, not measured: the bytes the collectives
    move with experts chosen evenly and no padding, not link times, and where XLA picks the collective (the
    reshards) the least it can move. A ring all-reduce over n devices sends 2(n-1)/n of the buffer from each,
    an all-gather (n-1)/n of the gathered result. d, e, t: the data, expert and tensor sizes, m = e*t; D model
    width, V vocabulary, R the routed experts' width (K3's latent), k experts a token; rows and the tensor
    blocks' partial sums cross in bf16, the MoE's partial sums and the logits in float32. A block whose dim the
    rules leave whole sends nothing.

    Where the tokens are. The attention, dense MLP, shared experts, embedding and head run on the activations'
    layout, the batch split over A = ``mesh_axes("batch", B)`` (data x expert where d*e divides B, else data
    where d does, else whole). Tokens split over axes X leave a device the share s_X = c / |X| of its data
    group's tokens (|X| devices over X; c = d where A holds data, each copy then processing its 1/d of the
    tokens, else 1, every copy processing them all): s_A = 1/e where the batch splits over data x expert.
    The MoE (``k3jax.sharding.experts``) has layouts of its own: tokens over every axis with more than one
    device (exchanged rows, and any form where the stacks stay whole), or over the axes outside its group
    G = ``mesh_axes("experts", E)`` (replicated tokens), n = |G|. Moving from tokens over P to over Q, a device
    receives what of its new share it did not hold, s_Q - s_(P u Q) (splits agreeing on their common axes),
    and on average sends as much: an all-gather over P's extra axes where P's split refines Q's, nothing where
    Q's refines P's (each device keeps a part of what it holds).

    - attention (KDA, MLA), dense MLP, shared experts: heads / width split over tensor, one all-reduce of the
      device's [D] bf16 rows: 2(t-1)/t * 2D * s_A.
    - embedding (vocab over tensor): a masked lookup, then the same all-reduce: 2(t-1)/t * 2D * s_A.
    - output head (vocab over tensor): at most the float32 logits gathered for sampling, (t-1)/t * 4V * s_A
      (a greedy argmax or the training loss reduce per token instead).
    - routed experts, exchanged rows: tokens over every axis (s = 1/m where A holds data), taken from the
      attention's layout without sending; each (token, expert) pair's R-wide row goes to its expert's device
      and comes back, (n-1)/n of them leaving: 2 * k * 2R * (n-1)/n * s (the pairs' weight and expert id, 8
      bytes, left out); the results regathered to the attention's layout: (s_A - s) * 2R, over tensor.
    - routed experts, replicated tokens: tokens over the axes outside G (data, where G is expert x tensor; s = 1
      where A holds data), gathered from the attention's layout: (s - s_A) * 2R, over expert (the pairs, 8k
      bytes a token, left out); the psum of the float32 partial sums over G: 2(n-1)/n * 4R * s; each device
      then keeps its own rows of the sum, sending nothing.
    - stacks whole (E divides over none of expert, expert x tensor): both forms split the tokens over every
      axis, run every expert there and regather: (s_A - s) * 2R.

    With the batch split over data x expert and E over expert x tensor (n = m), per token of a data group:
    attention, MLP, embedding 2(t-1)/t * 2D / e; exchanged 2k * 2R (m-1)/m^2 + (t-1)/m * 2R; replicated
    (e-1)/e * 2R + 2(m-1)/m * 4R; head (t-1)/t * 4V / e.
    """
    batch = integer("batch", batch, minimum=1)
    D, V, a = cfg.hidden_size, cfg.vocab_size, ACTIVATION_BYTES
    kda, mla, moe = cfg.kda, cfg.mla, cfg.moe
    R, k, shared = moe.latent_size or D, moe.experts_per_token, moe.num_shared_experts * moe.intermediate_size
    attention = mesh_axes("batch", batch, mesh)
    copies = mesh.shape[DATA] if DATA in attention else 1

    def share(axes) -> float:  # of its data group's tokens, a device's when they are split over ``axes``
        return copies / devices_over(tuple(axes), mesh)

    def moved(src, dst) -> float:  # what a device receives (and sends) going from tokens over src to over dst
        return share(dst) - share(set(src) | set(dst))

    def reduce_over(logical: str, size: int, units: int | None = None) -> float:
        return _all_reduce(devices_over(mesh_axis(logical, size, mesh, units), mesh), a * D) * share(attention)

    row, every = a * R, split_axes(mesh)
    group = mesh_axes("experts", moe.num_experts, mesh)
    n = devices_over(group, mesh)
    regather = (moved(attention, every) + moved(every, attention)) * row
    if group:
        rest = tuple(x for x in every if x not in group)
        exchanged = 2 * k * row * (n - 1) / n * share(every) + regather
        replicated = (moved(attention, rest) + moved(rest, attention)) * row + _all_reduce(n, 4 * R) * share(rest)
    else:
        exchanged = replicated = regather
    vocab = devices_over(mesh_axis("vocab", V, mesh), mesh)
    return Communication(
        kda_attention=reduce_over("heads", kda.num_heads * kda.head_dim, kda.num_heads),
        mla_attention=reduce_over("heads", mla.num_heads * mla.v_head_dim, mla.num_heads),
        dense_mlp=reduce_over("mlp", cfg.dense_intermediate_size),
        shared_experts=reduce_over("mlp", shared) if shared else 0.0,
        moe_exchanged=exchanged, moe_replicated=replicated,
        embedding=_all_reduce(vocab, a * D) * share(attention),
        head=_all_gather(vocab, 4 * V) * share(attention))


class DeviceEstimate(NamedTuple):
    """What one device of ``mesh`` holds, in bytes, and what it sends per token."""

    mesh: Mapping[str, int]
    weights: DeviceWeights
    kda_state: float  # its sequences' KDA states and conv inputs, float32 (``rules.cache_spec``)
    mla_cache: float  # its sequences' MLA latents (``rules.cache_spec``: by batch only)
    sequences: int  # the sequences it holds caches for (and attends for)
    kda_heads: int  # the KDA heads whose state it holds
    batch_axes: tuple[str, ...]  # the mesh axes the batch is split over (activations and caches)
    context: int
    batch: int
    comm: Communication

    @property
    def total(self) -> float:
        return self.weights.total + self.kda_state + self.mla_cache


def per_device(cfg: K3Config, mesh: str | Mapping[str, int], context: int, batch: int = 1,
               cache_bytes: int = 2) -> DeviceEstimate:
    """One device's share on a mesh of these sizes ('expert=8,tensor=2' or a mapping; no devices needed) for
    ``batch`` sequences of ``context`` tokens, every cache array placed by ``rules.cache_spec``: the batch
    over data x expert (where it divides; else data; else whole), the KDA state [B, H, K, V] float32 with its
    heads over tensor, the conv inputs [B, W-1, 3*H*K] float32 and the MLA latents [B, S, R + P] (in
    ``cache_bytes`` a value) by batch only (every head reads all the latents)."""
    context, batch, cache_bytes = _sizes(context, batch, cache_bytes)
    mesh = abstract_mesh(mesh)
    kda, mla = cfg.kda, cfg.mla
    n_kda, n_mla = cfg.layer_types.count("kda"), cfg.layer_types.count("mla")

    def held(field: str, shape: tuple[int, ...], itemsize: int) -> float:
        return spec_bytes(shape, itemsize, cache_spec(field, shape, mesh), mesh)

    state = (batch, kda.num_heads, kda.head_dim, kda.head_dim)
    kda_state = n_kda * (held("recurrent", state, 4) +
                         held("conv", (batch, kda.conv_size - 1, 3 * kda.num_heads * kda.head_dim), 4))
    mla_cache = n_mla * (held("c_kv", (batch, context, mla.kv_lora_rank), cache_bytes) +
                         held("k_pe", (batch, context, mla.qk_rope_head_dim), cache_bytes))
    spec = cache_spec("recurrent", state, mesh)
    return DeviceEstimate(dict(mesh.shape), device_weights(cfg, mesh), kda_state, mla_cache,
                          batch // devices_over(spec[0], mesh), kda.num_heads // devices_over(spec[1], mesh),
                          mesh_axes("batch", batch, mesh), context, batch, communication(cfg, mesh, batch))


def _gib(n: float) -> str:
    return f"{n / 2**30:,.2f} GiB"


def report(cfg: K3Config, context: int, batch: int = 1, cache_bytes: int = 2,
           mesh: str | Mapping[str, int] | None = None) -> str:
    """``estimate``'s numbers as a table in GiB, one line each; on a ``mesh`` (sizes), ``per_device``'s."""
    if mesh is not None:
        return _device_report(cfg, per_device(cfg, mesh, context, batch, cache_bytes))
    m = estimate(cfg, context, batch, cache_bytes)
    return "\n".join([
        f"{cfg.name}: context {context:,} tokens, batch {batch}",
        f"  weights                  {_gib(m.weights)}  (routed experts {'MXFP4' if cfg.mx_experts else 'bf16'}, rest bf16)",
        f"  KDA state per sequence   {_gib(m.kda_state_per_seq)}  (fixed: float32 state + conv inputs)",
        f"  MLA cache per sequence   {_gib(m.mla_cache_per_token * context)}  "
        f"({m.mla_cache_per_token:,.0f} bytes per token, grows with context)",
        f"  caches per sequence      {_gib(m.per_sequence)}",
        f"  caches for the batch     {_gib(batch * m.per_sequence)}",
        f"  total                    {_gib(m.total)}",
        "  (Block AttnRes keeps nothing across tokens: it mixes over depth, per token.)",
    ])


def _device_report(cfg: K3Config, d: DeviceEstimate) -> str:
    sizes = ", ".join(f"{a}={n}" for a, n in d.mesh.items())
    w, c = d.weights, d.comm
    n_kda, n_mla = cfg.layer_types.count("kda"), cfg.layer_types.count("mla")
    n_moe = sum(map(cfg.is_moe_layer, range(cfg.num_layers)))
    over = {name: "*".join(RULES[name]) for name in ("heads", "mlp", "vocab")}
    rows = [(f"KDA attention: all-reduce over {over['heads']}", c.kda_attention, n_kda),
            (f"MLA attention: all-reduce over {over['heads']}", c.mla_attention, n_mla),
            (f"dense MLP: all-reduce over {over['mlp']}", c.dense_mlp, cfg.num_layers - n_moe),
            (f"shared experts: all-reduce over {over['mlp']}", c.shared_experts, n_moe),
            ("routed experts, exchanged rows (prefill)", c.moe_exchanged, n_moe),
            ("routed experts, replicated tokens (decode)", c.moe_replicated, n_moe),
            (f"embedding: all-reduce over {over['vocab']}", c.embedding, 1),
            ("output head: logits gathered (at most)", c.head, 1)]
    common = sum(v * n for _, v, n in rows[:4]) + c.embedding
    devices = math.prod(d.mesh.values())
    seqs = f"{d.sequences} sequence{'s' * (d.sequences > 1)}"
    batch_over = "*".join(d.batch_axes) or "nothing (every device holds every sequence)"
    lines = [
        f"{cfg.name} on a mesh of {devices} device{'s' * (devices > 1)} ({sizes}): context {d.context:,} tokens, "
        f"batch {d.batch}; per device:",
        f"  weights                  {_gib(w.total)}  (routed experts {_gib(w.routed_experts)}; whole on every device "
        f"{_gib(w.whole)})",
        f"  KDA state                {_gib(d.kda_state)}  ({seqs} x {d.kda_heads} of "
        f"{cfg.kda.num_heads} heads, float32)",
        f"  MLA cache                {_gib(d.mla_cache)}  ({seqs} x {d.context:,} tokens; every "
        f"head reads it all)",
        f"  total                    {_gib(d.total)}",
        f"  batch split over {batch_over}",
        "  communication, bytes one device sends per token of its data group (bf16 activations; modelled):",
        f"    {'':44}{'per layer':>12}{'layers':>8}{'all layers':>14}",
        *(f"    {name:44}{v:>12,.0f}{n:>8}{v * n:>14,.0f}" for name, v, n in rows),
        f"    {'total, prefill (exchanged rows, no logits)':44}{'':20}{common + n_moe * c.moe_exchanged:>14,.0f}",
        f"    {'total, decode (replicated tokens, logits)':44}{'':20}"
        f"{common + n_moe * c.moe_replicated + c.head:>14,.0f}",
    ]
    return "\n".join(lines)


__all__ = ["Communication", "DeviceEstimate", "DeviceWeights", "MemoryEstimate", "abstract_mesh", "communication",
           "device_weights", "estimate", "per_device", "report"]
