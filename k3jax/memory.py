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
from k3jax.sharding.mesh import parse_mesh
from k3jax.sharding.rules import DATA, EXPERT, MESH_AXES, TENSOR, mesh_axis, param_spec, spec_bytes

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
    sizes = parse_mesh(sizes) if isinstance(sizes, str) else {**dict.fromkeys(MESH_AXES, 1), **sizes}
    unknown = set(sizes) - set(MESH_AXES)
    if unknown:
        raise ValueError(f"mesh: unknown axes {sorted(unknown)}; the axes are {', '.join(MESH_AXES)}")
    shape = tuple(integer(f"mesh: {a}", sizes[a], minimum=1) for a in MESH_AXES)
    return AbstractMesh(shape, MESH_AXES)  # (axis_sizes, axis_names): the same in JAX 0.10 and 0.11


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
    """Bytes one device sends for each token its data group (one copy of the model, expert x tensor devices)
    processes: per layer of each kind, then per token for the embedding and output head."""

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


def communication(cfg: K3Config, mesh: AbstractMesh) -> Communication:
    """What the placement makes each device send, per token of its data group (data parallelism sends nothing
    at inference). A ring all-reduce of n devices sends 2(n-1)/n of the buffer from each, an all-gather
    (n-1)/n of the gathered result. t, e: the tensor and expert axes' sizes; D model width, V vocabulary,
    R the routed experts' width (K3's latent), k experts per token. A block whose dim the rules leave whole
    sends nothing.

    - attention (KDA, MLA), dense MLP, shared experts: heads / width split over tensor, so one all-reduce
      of the [D] bf16 output: 2(t-1)/t * 2D.
    - routed experts, exchanged rows: tokens split over expert x tensor (m = e*t devices, 1/m each); each
      (token, expert) pair's R-wide bf16 row goes to its expert's device and comes back, (e-1)/e of them
      leaving the device: 2 * k * 2R * (e-1)/e / m (the pairs' routing weight and expert id, 8 bytes, left
      out); then the result rows gathered back to every device of the group: (m-1)/m * 2R.
    - routed experts, replicated tokens: tokens split over tensor (1/t each); a psum over expert of the
      float32 partial sums, 2(e-1)/e * 4R / t, then the rows gathered over tensor: (t-1)/t * 2R. Where E
      does not divide over expert both forms only split the tokens and gather them: (m-1)/m * 2R.
    - embedding (vocab over tensor): a masked lookup, then an all-reduce of the [D] row: 2(t-1)/t * 2D.
    - output head (vocab over tensor): at most the float32 logits gathered for sampling, (t-1)/t * 4V (a
      greedy argmax or the training loss reduce per token instead).
    """
    t, e = mesh.shape[TENSOR], mesh.shape[EXPERT]
    D, a = cfg.hidden_size, ACTIVATION_BYTES

    def reduce_if(logical: str, size: int, units: int | None = None) -> float:
        return _all_reduce(t, a * D) if mesh_axis(logical, size, mesh, units) else 0.0

    kda, mla, moe = cfg.kda, cfg.mla, cfg.moe
    R, m, shared = moe.latent_size or D, e * t, moe.num_shared_experts * moe.intermediate_size
    row = a * R
    if mesh_axis("experts", moe.num_experts, mesh):
        exchanged = 2 * moe.experts_per_token * row * (e - 1) / e / m + _all_gather(m, row)
        replicated = _all_reduce(e, 4 * R) / t + _all_gather(t, row)
    else:
        exchanged = replicated = _all_gather(m, row)
    vocab = mesh_axis("vocab", cfg.vocab_size, mesh) is not None
    return Communication(
        kda_attention=reduce_if("heads", kda.num_heads * kda.head_dim, kda.num_heads),
        mla_attention=reduce_if("heads", mla.num_heads * mla.v_head_dim, mla.num_heads),
        dense_mlp=reduce_if("mlp", cfg.dense_intermediate_size),
        shared_experts=reduce_if("mlp", shared) if shared else 0.0,
        moe_exchanged=exchanged, moe_replicated=replicated,
        embedding=_all_reduce(t, a * D) if vocab else 0.0, head=_all_gather(t, 4 * cfg.vocab_size) if vocab else 0.0)


class DeviceEstimate(NamedTuple):
    """What one device of ``mesh`` holds, in bytes, and what it sends per token."""

    mesh: Mapping[str, int]
    weights: DeviceWeights
    kda_state: float  # its sequences' KDA states, float32 (batch over data, heads over tensor)
    mla_cache: float  # its sequences' MLA latents (batch over data; whole over tensor and expert)
    sequences: int  # the sequences it holds caches for
    kda_heads: int  # the KDA heads whose state it holds
    context: int
    batch: int
    comm: Communication

    @property
    def total(self) -> float:
        return self.weights.total + self.kda_state + self.mla_cache


def per_device(cfg: K3Config, mesh: str | Mapping[str, int], context: int, batch: int = 1,
               cache_bytes: int = 2) -> DeviceEstimate:
    """One device's share on a mesh of these sizes ('expert=8,tensor=2' or a mapping; no devices needed) for
    ``batch`` sequences of ``context`` tokens. The caches: KDA state [B, H, K, V] float32 and conv inputs with
    heads over tensor, MLA latents [B, S, 576] whole over tensor (every head reads them); both with B over
    data where data divides the batch, and whole over expert."""
    context, batch, cache_bytes = _sizes(context, batch, cache_bytes)
    mesh = abstract_mesh(mesh)
    kda_split = mesh.shape[TENSOR] if mesh_axis("heads", cfg.kda.num_heads, mesh) else 1
    sequences = batch // mesh.shape[DATA] if mesh_axis("batch", batch, mesh) else batch
    n_kda, n_mla = cfg.layer_types.count("kda"), cfg.layer_types.count("mla")
    kda_state = sequences * n_kda * 4 * _kda_values(cfg) / kda_split
    mla_cache = sequences * context * n_mla * cache_bytes * (cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim)
    return DeviceEstimate(dict(mesh.shape), device_weights(cfg, mesh), kda_state, mla_cache, sequences,
                          cfg.kda.num_heads // kda_split, context, batch, communication(cfg, mesh))


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
    rows = [("KDA attention: all-reduce over tensor", c.kda_attention, n_kda),
            ("MLA attention: all-reduce over tensor", c.mla_attention, n_mla),
            ("dense MLP: all-reduce over tensor", c.dense_mlp, cfg.num_layers - n_moe),
            ("shared experts: all-reduce over tensor", c.shared_experts, n_moe),
            ("routed experts, exchanged rows (prefill)", c.moe_exchanged, n_moe),
            ("routed experts, replicated tokens (decode)", c.moe_replicated, n_moe),
            ("embedding: all-reduce over tensor", c.embedding, 1),
            ("output head: logits gathered (at most)", c.head, 1)]
    common = sum(v * n for _, v, n in rows[:4]) + c.embedding
    devices = math.prod(d.mesh.values())
    seqs = f"{d.sequences} sequence{'s' * (d.sequences > 1)}"
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
        "  communication, bytes one device sends per token of its data group (bf16 activations):",
        f"    {'':44}{'per layer':>12}{'layers':>8}{'all layers':>14}",
        *(f"    {name:44}{v:>12,.0f}{n:>8}{v * n:>14,.0f}" for name, v, n in rows),
        f"    {'total, prefill (exchanged rows, no logits)':44}{'':20}{common + n_moe * c.moe_exchanged:>14,.0f}",
        f"    {'total, decode (replicated tokens, logits)':44}{'':20}"
        f"{common + n_moe * c.moe_replicated + c.head:>14,.0f}",
    ]
    return "\n".join(lines)


__all__ = ["Communication", "DeviceEstimate", "DeviceWeights", "MemoryEstimate", "abstract_mesh", "communication",
           "device_weights", "estimate", "per_device", "report"]
