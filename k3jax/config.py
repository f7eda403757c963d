"""Model configuration: a tree of frozen dataclasses, read from a released ``config.json``.

``from_hf_config`` reads either member of the ``kimi_linear`` family (Kimi-K3 with its nested
``text_config``, Kimi-Linear-48B-A3B flat). Keys that do not change the model (versions, dtypes,
``auto_map``, token ids, ...) are ignored; a setting the code does not support raises
``ConfigError`` naming the key.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

LayerType = Literal["kda", "mla"]
Activation = Literal["situ", "silu"]


class ConfigError(ValueError):
    """A config.json setting that the code does not support or that contradicts another."""


@dataclass(frozen=True)
class KDAConfig:
    """Kimi Delta Attention: H heads of head dim K (= V)."""

    num_heads: int
    head_dim: int
    conv_size: int = 4
    gate_lower_bound: float | None = None  # K3: -5.0 (bounded gate); None: softplus gate
    full_rank_gate: bool = False  # K3: output gate g_proj [D, H*V]; else g_a/g_b low rank


@dataclass(frozen=True)
class MLAConfig:
    """Gated multi-head latent attention without rotary embeddings."""

    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    output_gate: bool = False

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class MoEConfig:
    """Routed experts (sigmoid router, noaux_tc) plus shared experts; latent experts for K3."""

    num_experts: int
    experts_per_token: int
    num_shared_experts: int
    intermediate_size: int
    latent_size: int | None = None  # K3: 3584 (Stable LatentMoE); None: experts at full width
    latent_norm: bool = False
    routed_scaling_factor: float = 1.0
    renormalize: bool = True


@dataclass(frozen=True)
class K3Config:
    """The whole decoder. Only ``model.py`` reads all of it; modules get the parts they need."""

    vocab_size: int
    hidden_size: int
    layer_types: tuple[LayerType, ...]
    kda: KDAConfig
    mla: MLAConfig
    moe: MoEConfig
    first_k_dense_replace: int = 1
    dense_intermediate_size: int = 0
    hidden_act: Activation = "silu"
    situ_beta: float = 4.0
    situ_linear_beta: float = 25.0
    rms_norm_eps: float = 1e-5
    attn_res_block_size: int | None = None  # K3: 12; None: plain residual (Kimi Linear)
    mx_experts: bool = False  # routed experts stored in MXFP4 in the released checkpoint
    name: str = "custom"
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        _check(self)

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace

    @property
    def scan_period(self) -> int:
        """Layers per repeated group: the attention pattern's period (K3: KDA, KDA, KDA, MLA)."""
        types = self.layer_types
        return types.index("mla") + 1 if "mla" in types and "kda" in types else 1

    def replace(self, **changes: Any) -> "K3Config":
        return dataclasses.replace(self, **changes)


def _check(cfg: K3Config) -> None:
    if not cfg.layer_types:
        raise ConfigError("num_hidden_layers: the model needs at least one layer")
    for i, t in enumerate(cfg.layer_types):
        if t not in ("kda", "mla"):
            raise ConfigError(f"layer_types[{i}]: unknown layer type {t!r}; expected 'kda' or 'mla'")
    if cfg.hidden_act not in ("situ", "silu"):
        raise ConfigError(f"hidden_act: unsupported activation {cfg.hidden_act!r}; expected 'situ' or 'silu'")
    if cfg.first_k_dense_replace > 0 and cfg.dense_intermediate_size <= 0:
        raise ConfigError("intermediate_size: dense layers need a positive intermediate_size")
    moe = cfg.moe
    if not 0 < moe.experts_per_token <= moe.num_experts:
        raise ConfigError(
            f"num_experts_per_token: {moe.experts_per_token} must be in 1..num_experts ({moe.num_experts})"
        )
    if moe.latent_norm and moe.latent_size is None:
        raise ConfigError("latent_moe_use_norm: true needs routed_expert_hidden_size (the latent width)")
    for key, value in (
        ("linear_attn_config.head_dim", cfg.kda.head_dim),
        ("kv_lora_rank", cfg.mla.kv_lora_rank),
        ("qk_nope_head_dim", cfg.mla.qk_nope_head_dim),
        ("v_head_dim", cfg.mla.v_head_dim),
        ("moe_intermediate_size", moe.intermediate_size),
    ):
        if value <= 0:
            raise ConfigError(f"{key}: must be positive, got {value}")
    if cfg.attn_res_block_size is not None and cfg.attn_res_block_size <= 0:
        raise ConfigError(f"attn_res_block_size: must be positive, got {cfg.attn_res_block_size}")


def _pop_layer_types(c: Mapping[str, Any], num_layers: int) -> tuple[LayerType, ...]:
    """Layer schedule from ``linear_attn_config`` (1-indexed lists) or HF's ``layer_types``."""
    lac = c.get("linear_attn_config") or {}
    full = lac.get("full_attn_layers")
    kda = lac.get("kda_layers")
    types: list[LayerType] | None = None
    if full is not None:
        bad = [i for i in full if not 1 <= i <= num_layers]
        if bad:
            raise ConfigError(f"linear_attn_config.full_attn_layers: {bad} outside 1..{num_layers} (1-indexed)")
        types = ["mla" if i + 1 in set(full) else "kda" for i in range(num_layers)]
        if kda is not None and sorted(kda) != [i + 1 for i, t in enumerate(types) if t == "kda"]:
            raise ConfigError(
                "linear_attn_config.kda_layers contradicts full_attn_layers: every layer must be in exactly one"
            )
    hf = c.get("layer_types")
    if hf is not None:
        names = {"linear_attention": "kda", "kda": "kda", "full_attention": "mla", "mla": "mla"}
        unknown = sorted({t for t in hf if t not in names})
        if unknown:
            raise ConfigError(f"layer_types: unknown layer type(s) {unknown}")
        hf_types = [names[t] for t in hf]
        if len(hf_types) != num_layers:
            raise ConfigError(f"layer_types: {len(hf_types)} entries but num_hidden_layers is {num_layers}")
        if types is not None and hf_types != types:
            raise ConfigError("layer_types contradicts linear_attn_config.full_attn_layers")
        types = hf_types
    if types is None:
        raise ConfigError("linear_attn_config.full_attn_layers: missing; cannot tell KDA from MLA layers")
    return tuple(types)


def from_hf_config(config: Mapping[str, Any], name: str = "checkpoint") -> K3Config:
    """Build a config from a released ``config.json`` dict (Kimi-K3 nested or Kimi-Linear flat)."""
    c = dict(config.get("text_config") or config)
    model_type = c.get("model_type", "kimi_linear")
    if model_type not in ("kimi_linear", "kimi_k3", "kimi_k3_text"):
        raise ConfigError(f"model_type: {model_type!r} is not a kimi_linear-family model")

    def need(key: str) -> Any:
        if c.get(key) is None:
            raise ConfigError(f"{key}: missing from config")
        return c[key]

    num_layers = int(need("num_hidden_layers"))
    hidden = int(need("hidden_size"))
    lac = c.get("linear_attn_config") or {}
    for key, want in (("topk_method", "noaux_tc"), ("moe_router_activation_func", "sigmoid")):
        if c.get(key, want) != want:
            raise ConfigError(f"{key}: {c[key]!r} is not supported; expected {want!r}")
    for key in ("num_expert_group", "topk_group", "moe_layer_freq"):
        if int(c.get(key) or 1) != 1:
            raise ConfigError(f"{key}: {c[key]} is not supported; expected 1")
    if c.get("mla_use_nope") is False:
        raise ConfigError("mla_use_nope: false (rotary MLA) is not supported by kimi_linear models")
    if int(lac.get("short_conv_kernel_size", 4)) < 1:
        raise ConfigError("linear_attn_config.short_conv_kernel_size: must be positive")

    mla = MLAConfig(
        num_heads=int(need("num_attention_heads")),
        q_lora_rank=c.get("q_lora_rank"),
        kv_lora_rank=int(need("kv_lora_rank")),
        qk_nope_head_dim=int(need("qk_nope_head_dim")),
        qk_rope_head_dim=int(need("qk_rope_head_dim")),
        v_head_dim=int(need("v_head_dim")),
        output_gate=bool(c.get("mla_use_output_gate", False)),
    )
    kda_heads = int(lac.get("num_heads", mla.num_heads))
    if kda_heads <= 0:
        raise ConfigError(f"linear_attn_config.num_heads: must be positive, got {kda_heads}")
    if lac.get("head_dim") is None and hidden % kda_heads:
        raise ConfigError(
            f"linear_attn_config.head_dim: missing, and hidden_size {hidden} does not divide into {kda_heads} heads"
        )
    kda_dim = int(lac.get("head_dim") or hidden // kda_heads)
    kda = KDAConfig(
        num_heads=kda_heads,
        head_dim=kda_dim,
        conv_size=int(lac.get("short_conv_kernel_size", 4)),
        gate_lower_bound=lac.get("gate_lower_bound"),
        full_rank_gate=bool(lac.get("use_full_rank_gate", False)),
    )
    moe = MoEConfig(
        num_experts=int(need("num_experts")),
        experts_per_token=int(need("num_experts_per_token")),
        num_shared_experts=int(c.get("num_shared_experts") or 0),
        intermediate_size=int(need("moe_intermediate_size")),
        latent_size=c.get("routed_expert_hidden_size"),
        latent_norm=bool(c.get("latent_moe_use_norm", False)),
        routed_scaling_factor=float(c.get("routed_scaling_factor", 1.0)),
        renormalize=bool(c.get("moe_renormalize", True)),
    )
    q = c.get("quantization_config") or config.get("quantization_config")
    mx = False
    if q:
        fmt = q.get("format") or ""
        groups = q.get("config_groups") or {}
        formats = {fmt} | {g.get("format") for g in groups.values() if isinstance(g, dict)}
        if not any(f and "mxfp4" in f for f in formats):
            raise ConfigError(f"quantization_config.format: {fmt!r} unsupported; only mxfp4-pack-quantized")
        mx = True
    return K3Config(
        vocab_size=int(need("vocab_size")),
        hidden_size=hidden,
        layer_types=_pop_layer_types(c, num_layers),
        kda=kda,
        mla=mla,
        moe=moe,
        first_k_dense_replace=int(c.get("first_k_dense_replace", 0)),
        dense_intermediate_size=int(c.get("intermediate_size") or 0),
        hidden_act=c.get("hidden_act", "silu"),
        situ_beta=float(c.get("activation_situ_beta", 4.0)),
        situ_linear_beta=float(c.get("activation_situ_linear_beta", 25.0)),
        rms_norm_eps=float(c.get("rms_norm_eps", 1e-5)),
        attn_res_block_size=c.get("attn_res_block_size"),
        mx_experts=mx,
        name=name,
        extra={k: v for k, v in c.items() if k in ("bos_token_id", "eos_token_id", "pad_token_id")},
    )


__all__ = ["ConfigError", "KDAConfig", "MLAConfig", "MoEConfig", "K3Config", "from_hf_config"]
