"""Model configuration: a tree of frozen dataclasses, read from a released or HF-saved ``config.json``.

``from_hf_config`` reads either member of the ``kimi_linear`` family (Kimi-K3 with its nested
``text_config``, Kimi-Linear-48B-A3B flat). Every key it reads is typed (``k3jax.json_schema``):
a wrong type or value raises ``ConfigError`` naming the file, the key and what was expected.

The reference is HF transformers' ``KimiLinearConfig`` (and ``DeepseekV3Config`` it builds on):
- defaults where a key is absent: ``first_k_dense_replace`` 1, ``num_shared_experts`` 1,
  ``routed_scaling_factor`` 2.446, ``moe_renormalize`` true, ``intermediate_size`` 9216 (the dense
  layers' width; ``dense_ffn_hidden`` overrides it), ``linear_attn_config`` heads 32, head dim 128,
  short conv 4, ``hidden_act`` silu, ``rms_norm_eps`` 1e-5, ``attn_res_block_size`` 0 (= none),
  ``q_lora_rank`` null, ``mla_use_output_gate`` false;
- HF-saved spellings read as the released ones (two that disagree raise): ``n_routed_experts`` /
  ``num_local_experts``, ``num_experts_per_tok``, ``n_shared_experts``, ``norm_topk_prob``,
  ``n_group``, ``linear_num_heads`` / ``linear_num_key_heads`` / ``linear_num_value_heads``,
  ``linear_head_dim`` / ``linear_key_head_dim`` / ``linear_value_head_dim``,
  ``linear_conv_kernel_dim``, ``layer_types`` and ``mlp_layer_types`` ('dense'/'sparse' a layer;
  dense layers must come first);
- required: the widths (``vocab_size``, ``hidden_size``, heads, MLA ranks and head dims, experts,
  ``moe_intermediate_size``), the layer schedule (``full_attn_layers`` or ``layer_types``: the
  references' fallback patterns disagree), and SiTU's two betas when ``hidden_act`` is situ;
- refused unless at the value the model implements: ``topk_method`` noaux_tc,
  ``moe_router_activation_func`` sigmoid, ``num_expert_group`` / ``topk_group`` /
  ``moe_layer_freq`` 1, ``mla_use_nope`` true, ``tie_word_embeddings`` and ``attention_bias`` false,
  ``num_key_value_heads`` = ``num_attention_heads``, a ``quantization_config`` other than MXFP4;
- ignored, since they do not change the logits: versions, ``dtype`` / ``torch_dtype`` (the tensors'
  own dtypes are used), ``architectures``, ``auto_map``, token ids (kept in ``extra``), cache,
  initializer and dropout settings, positions and rope settings (no positional encoding), MTP layers.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Mapping

from k3jax.json_schema import Fields

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


def _agreed(read: Callable[[Fields, str], Any], *places: tuple[Fields, str]) -> Any:
    """The value of the first present key among ``places`` (a key and its HF-saved aliases); None
    if none is present. Two present keys that disagree raise ``ConfigError`` naming both."""
    found = [(f, k, read(f, k)) for f, k in places if k in f]
    for f, k, v in found[1:]:
        if v != found[0][2]:
            f0, k0, v0 = found[0]
            raise ConfigError(f"{f.source}: {f0.key(k0)} is {v0!r} but {f.key(k)} is {v!r}; expected one value")
    return found[0][2] if found else None


def _positive(f: Fields, k: str) -> int:
    return f.int(k, minimum=1)


def _layer_types(c: Fields, lac: Fields, num_layers: int) -> tuple[LayerType, ...]:
    """Layer schedule from ``linear_attn_config`` (1-indexed lists) or HF's ``layer_types``."""
    full = lac.int_list("full_attn_layers", None)
    kda = lac.int_list("kda_layers", None)
    types: list[LayerType] | None = None
    if full is not None:
        bad = [i for i in full if not 1 <= i <= num_layers]
        if bad:
            raise ConfigError(f"{c.source}: {lac.key('full_attn_layers')}: {bad} outside 1..{num_layers} (1-indexed)")
        types = ["mla" if i + 1 in set(full) else "kda" for i in range(num_layers)]
        if kda is not None and sorted(kda) != [i + 1 for i, t in enumerate(types) if t == "kda"]:
            raise ConfigError(f"{c.source}: {lac.key('kda_layers')} contradicts full_attn_layers: every layer must "
                              f"be in exactly one")
    hf = c.str_list("layer_types", None)
    if hf is not None:
        names = {"linear_attention": "kda", "kda_attention": "kda", "kda": "kda", "full_attention": "mla", "mla": "mla"}
        unknown = sorted({t for t in hf if t not in names})
        if unknown:
            raise ConfigError(f"{c.source}: {c.key('layer_types')}: unknown layer type(s) {unknown}; expected "
                              f"'linear_attention' or 'full_attention'")
        hf_types = [names[t] for t in hf]
        if len(hf_types) != num_layers:
            raise ConfigError(f"{c.source}: {c.key('layer_types')}: {len(hf_types)} entries but num_hidden_layers "
                              f"is {num_layers}")
        if types is not None and hf_types != types:
            raise ConfigError(f"{c.source}: {c.key('layer_types')} contradicts {lac.key('full_attn_layers')}")
        types = hf_types
    if types is None:
        raise lac.fail("full_attn_layers", "the 1-indexed MLA layers (or a top-level layer_types list); "
                       "the references' fallback patterns disagree, so none is assumed")
    return tuple(types)


def _first_k_dense(c: Fields, num_layers: int) -> int:
    """Dense (non-MoE) layers at the start: HF's ``mlp_layer_types`` ('dense' / 'sparse' per layer)
    if present, else ``first_k_dense_replace`` (HF transformers' default 1)."""
    k = c.int("first_k_dense_replace", None, minimum=0)
    kinds = c.str_list("mlp_layer_types", None)
    if kinds is None:
        return 1 if k is None else k
    if len(kinds) != num_layers or not set(kinds) <= {"dense", "sparse"}:
        raise c.fail("mlp_layer_types", f"{num_layers} entries (num_hidden_layers), each 'dense' or 'sparse'", kinds)
    dense = kinds.count("dense")
    if kinds != ["dense"] * dense + ["sparse"] * (num_layers - dense):
        raise ConfigError(f"{c.source}: {c.key('mlp_layer_types')}: a dense layer after a sparse one (layer "
                          f"{kinds.index('sparse')} is sparse, layer {kinds.index('dense', kinds.index('sparse'))} "
                          f"dense); only dense layers first are supported")
    if k is not None and k != dense:
        raise ConfigError(f"{c.source}: {c.key('first_k_dense_replace')} is {k} but mlp_layer_types starts with "
                          f"{dense} dense layer(s); expected one value")
    return dense


def _refuse(c: Fields, key: str, value: Any, supported: Any, why: str) -> None:
    """Raise ``ConfigError`` naming ``key`` unless ``value`` is the one the model implements."""
    if value != supported:
        raise c.fail(key, f"{json.dumps(supported)} ({why})", value)


def _situ_beta(c: Fields, act: str, key: str, unused: float) -> float:
    """A SiTU beta: required with ``hidden_act: situ`` (HF's config defaults it to 1.0 for another
    formula; the released K3 config gives 4.0 and 25.0), read but unused with SiLU."""
    if act == "situ" and key not in c:
        raise c.fail(key, "a number with hidden_act 'situ' (no default is shared by the references)")
    return c.float(key, unused)


def _mx_quantized(q: Fields) -> bool:
    """True for a compressed-tensors MXFP4 ``quantization_config``; other quantizations raise."""
    fmt = q.str("format", "")
    groups = q.fields("config_groups", {})
    formats = {fmt} | {groups.fields(g).str("format", "") for g in groups}
    if not any("mxfp4" in f for f in formats):
        raise q.fail("format", "'mxfp4-pack-quantized' (the only quantization supported)", fmt)
    return True


def from_hf_config(config: Any, name: str = "checkpoint", *, source: str = "config.json") -> K3Config:
    """Build a config from a released or HF-saved ``config.json`` dict (Kimi-K3 nested, Kimi-Linear
    flat). ``source`` names the file in errors. Every key is typed; see the module docstring for the
    defaults (HF transformers' ``KimiLinearConfig``), aliases and refusals."""
    top = Fields(config, source, ConfigError)
    c = top.fields("text_config") if "text_config" in top else top
    c.str("model_type", "kimi_linear", choices=("kimi_linear", "kimi_k3", "kimi_k3_text"))
    num_layers = c.int("num_hidden_layers", minimum=1)
    hidden = c.int("hidden_size", minimum=1)
    heads = c.int("num_attention_heads", minimum=1)
    lac = c.fields("linear_attn_config", {})
    _refuse(c, "topk_method", c.str("topk_method", "noaux_tc"), "noaux_tc", "the only router supported")
    _refuse(c, "moe_router_activation_func", c.str("moe_router_activation_func", "sigmoid"), "sigmoid",
            "the only router supported")
    groups = _agreed(Fields.int, (c, "num_expert_group"), (c, "n_group"))
    _refuse(c, "num_expert_group", 1 if groups is None else groups, 1, "grouped routing is not supported")
    _refuse(c, "topk_group", c.int("topk_group", 1), 1, "grouped routing is not supported")
    _refuse(c, "moe_layer_freq", c.int("moe_layer_freq", 1), 1, "every layer after the dense ones is MoE")
    _refuse(c, "mla_use_nope", c.bool("mla_use_nope", True), True, "kimi_linear MLA has no rotary embedding")
    _refuse(c, "tie_word_embeddings", c.bool("tie_word_embeddings", False), False, "lm_head is its own tensor")
    _refuse(c, "attention_bias", c.bool("attention_bias", False), False, "projections have no bias")
    _refuse(c, "num_key_value_heads", c.int("num_key_value_heads", heads), heads, "MLA has one latent per token")

    mla = MLAConfig(
        num_heads=heads,
        q_lora_rank=c.int("q_lora_rank", None, minimum=1),
        kv_lora_rank=c.int("kv_lora_rank", minimum=1),
        qk_nope_head_dim=c.int("qk_nope_head_dim", minimum=1),
        qk_rope_head_dim=c.int("qk_rope_head_dim", minimum=0),
        v_head_dim=c.int("v_head_dim", minimum=1),
        output_gate=c.bool("mla_use_output_gate", False),
    )
    lower_bound = lac.float("gate_lower_bound", None)
    if lower_bound is not None and lower_bound >= 0:
        raise lac.fail("gate_lower_bound", "a negative number (the floor of the log decay)", lower_bound)
    kda = KDAConfig(
        num_heads=_agreed(_positive, (lac, "num_heads"), (c, "linear_num_heads"), (c, "linear_num_key_heads"),
                          (c, "linear_num_value_heads")) or 32,
        head_dim=_agreed(_positive, (lac, "head_dim"), (c, "linear_head_dim"), (c, "linear_key_head_dim"),
                         (c, "linear_value_head_dim")) or 128,
        conv_size=_agreed(_positive, (lac, "short_conv_kernel_size"), (c, "linear_conv_kernel_dim")) or 4,
        gate_lower_bound=lower_bound,
        full_rank_gate=lac.bool("use_full_rank_gate", False),
    )
    shared = _agreed(lambda f, k: f.int(k, minimum=0), (c, "num_shared_experts"), (c, "n_shared_experts"))
    renormalize = _agreed(Fields.bool, (c, "moe_renormalize"), (c, "norm_topk_prob"))
    moe = MoEConfig(
        num_experts=_agreed(_positive, (c, "num_experts"), (c, "n_routed_experts"), (c, "num_local_experts"))
        or c.int("num_experts"),
        experts_per_token=_agreed(_positive, (c, "num_experts_per_token"), (c, "num_experts_per_tok"))
        or c.int("num_experts_per_token"),
        num_shared_experts=1 if shared is None else shared,
        intermediate_size=c.int("moe_intermediate_size", minimum=1),
        latent_size=c.int("routed_expert_hidden_size", None, minimum=1),
        latent_norm=c.bool("latent_moe_use_norm", False),
        routed_scaling_factor=c.float("routed_scaling_factor", 2.446),
        renormalize=True if renormalize is None else renormalize,
    )
    act = c.str("hidden_act", "silu", choices=("situ", "silu"))
    q = c.fields("quantization_config") if "quantization_config" in c else top.fields("quantization_config", None)
    eps = c.float("rms_norm_eps", 1e-5)
    if eps <= 0:
        raise c.fail("rms_norm_eps", "a positive number", eps)
    return K3Config(
        vocab_size=c.int("vocab_size", minimum=1),
        hidden_size=hidden,
        layer_types=_layer_types(c, lac, num_layers),
        kda=kda,
        mla=mla,
        moe=moe,
        first_k_dense_replace=_first_k_dense(c, num_layers),
        dense_intermediate_size=c.int("dense_ffn_hidden", None, minimum=1)
        or c.int("intermediate_size", 9216, minimum=1),
        hidden_act=act,
        situ_beta=_situ_beta(c, act, "activation_situ_beta", 4.0),
        situ_linear_beta=_situ_beta(c, act, "activation_situ_linear_beta", 25.0),
        rms_norm_eps=eps,
        attn_res_block_size=c.int("attn_res_block_size", 0, minimum=0) or None,
        mx_experts=q is not None and _mx_quantized(q),
        name=name,
        extra={k: c.data[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in c},
    )


__all__ = ["ConfigError", "KDAConfig", "MLAConfig", "MoEConfig", "K3Config", "from_hf_config"]
