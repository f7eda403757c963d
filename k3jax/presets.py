"""Presets: the released configs (as their ``config.json`` dicts) and small test/benchmark models.

Every preset is a ``config.json``-shaped dict read through ``from_hf_config``, so the synthetic
checkpoints written for tests carry a config exactly like the released ones.
"""

from __future__ import annotations

import copy
from typing import Any

from k3jax.config import K3Config, from_hf_config

_MXFP4 = {
    "quant_method": "compressed-tensors",
    "format": "mxfp4-pack-quantized",
    "config_groups": {
        "group_0": {
            "format": "mxfp4-pack-quantized",
            "targets": ["Linear"],
            "weights": {"num_bits": 4, "type": "float", "group_size": 32, "scale_dtype": "uint8"},
        }
    },
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp.*", "re:.*gate$"],
}


def _k3_text(layers: int, full: list[int]) -> dict[str, Any]:
    return {
        "model_type": "kimi_linear",
        "vocab_size": 163840,
        "hidden_size": 7168,
        "num_hidden_layers": layers,
        "num_attention_heads": 96,
        "num_key_value_heads": 96,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "mla_use_nope": True,
        "mla_use_output_gate": True,
        "linear_attn_config": {
            "num_heads": 96,
            "head_dim": 128,
            "short_conv_kernel_size": 4,
            "full_attn_layers": full,
            "kda_layers": [i for i in range(1, layers + 1) if i not in full],
            "gate_lower_bound": -5.0,
            "use_full_rank_gate": True,
        },
        "num_experts": 896,
        "num_experts_per_token": 16,
        "num_shared_experts": 2,
        "moe_intermediate_size": 3072,
        "routed_expert_hidden_size": 3584,
        "latent_moe_use_norm": True,
        "moe_router_activation_func": "sigmoid",
        "topk_method": "noaux_tc",
        "num_expert_group": 1,
        "topk_group": 1,
        "moe_renormalize": True,
        "routed_scaling_factor": 1.0,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "intermediate_size": 33792,
        "hidden_act": "situ",
        "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0,
        "attn_res_block_size": 12,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "bos_token_id": 163584,
        "eos_token_id": 163585,
        "quantization_config": _MXFP4,
    }


KIMI_K3 = {
    "architectures": ["KimiK3ForConditionalGeneration"],
    "model_type": "kimi_k3",
    "text_config": _k3_text(93, list(range(4, 93, 4)) + [93]),
    "vision_config": {"model_type": "kimi_k3_vision"},
    "transformers_version": "5.1.0",
}

KIMI_LINEAR_48B = {
    "architectures": ["KimiLinearForCausalLM"],
    "model_type": "kimi_linear",
    "vocab_size": 163840,
    "hidden_size": 2304,
    "num_hidden_layers": 27,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "q_lora_rank": None,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "mla_use_nope": True,
    "linear_attn_config": {
        "num_heads": 32,
        "head_dim": 128,
        "short_conv_kernel_size": 4,
        "full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
        "kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26],
    },
    "num_experts": 256,
    "num_experts_per_token": 8,
    "num_shared_experts": 1,
    "moe_intermediate_size": 1024,
    "moe_router_activation_func": "sigmoid",
    "topk_method": "noaux_tc",
    "num_expert_group": 1,
    "topk_group": 1,
    "moe_renormalize": True,
    "routed_scaling_factor": 2.446,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "intermediate_size": 9216,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "bos_token_id": 163584,
    "eos_token_id": 163585,
    "dtype": "bfloat16",
    "transformers_version": "4.56.2",
}


def _small(base: dict[str, Any], **changes: Any) -> dict[str, Any]:
    out = copy.deepcopy(base)
    text = out.get("text_config", out)
    for key, value in changes.items():
        if isinstance(value, dict):
            text[key] = {**text.get(key, {}), **value}
        else:
            text[key] = value
    return out


# Every K3 feature on at toy widths: bounded full-rank gate, gated MLA with q_lora, AttnRes with a
# block of 4, latent MoE with norm, SiTU, MXFP4 experts (contracted dims are multiples of 32).
TINY = _small(
    KIMI_K3,
    vocab_size=320, hidden_size=48, num_hidden_layers=14, num_attention_heads=3, num_key_value_heads=3,
    q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
    linear_attn_config={"num_heads": 3, "head_dim": 8, "full_attn_layers": [4, 8, 12, 14],
                        "kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11, 13]},
    num_experts=6, num_experts_per_token=2, num_shared_experts=1, moe_intermediate_size=32,
    routed_expert_hidden_size=64, intermediate_size=72, routed_scaling_factor=2.5, attn_res_block_size=4,
    bos_token_id=256, eos_token_id=257,
)

TINY_LINEAR = _small(
    KIMI_LINEAR_48B,
    vocab_size=320, hidden_size=40, num_hidden_layers=7, num_attention_heads=2, num_key_value_heads=2,
    kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
    linear_attn_config={"num_heads": 2, "head_dim": 8, "full_attn_layers": [4, 7], "kda_layers": [1, 2, 3, 5, 6]},
    num_experts=5, num_experts_per_token=2, moe_intermediate_size=24, intermediate_size=56,
    bos_token_id=256, eos_token_id=257,
)

# tiny with counts that divide over 8 devices (4 KDA and 4 MLA heads, 8 routed experts) in one (KDA, KDA, KDA, MLA)
# group, two AttnRes blocks: the sharding tests split every rule's dim on meshes of 2, 4 and 8.
TINY_MESH = _small(
    TINY, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, num_experts=8, attn_res_block_size=2,
    linear_attn_config={"num_heads": 4, "head_dim": 8, "full_attn_layers": [4], "kda_layers": [1, 2, 3]},
)

# The shipped trained model (k3jax/data/nano): every K3 mechanism at 6M parameters, byte-level (ids 0-255
# bytes, 256 BOS, 257 EOS; the vocabulary padded to 320 as tiny's), KDA:MLA 3:1, AttnRes blocks of 2 layers
# (4 blocks), 8 latent routed experts (top 2) and a shared one. Sized to train on a 2-core CPU in an hour.
NANO = _small(
    KIMI_K3,
    vocab_size=320, hidden_size=192, num_hidden_layers=8, num_attention_heads=3, num_key_value_heads=3,
    q_lora_rank=96, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
    linear_attn_config={"num_heads": 3, "head_dim": 64, "full_attn_layers": [4, 8], "kda_layers": [1, 2, 3, 5, 6, 7]},
    num_experts=8, num_experts_per_token=2, num_shared_experts=1, moe_intermediate_size=192,
    routed_expert_hidden_size=96, intermediate_size=512, attn_res_block_size=2, bos_token_id=256, eos_token_id=257,
)

# nano's ablations (notebooks/training_and_ablation.ipynb): plain residuals instead of Block AttnRes, and
# Kimi Linear's unbounded softplus gate instead of K3's bounded one.
NANO_PLAIN_RESIDUAL = _small(NANO, attn_res_block_size=0)
NANO_SOFTPLUS_GATE = copy.deepcopy(NANO)
del NANO_SOFTPLUS_GATE["text_config"]["linear_attn_config"]["gate_lower_bound"]

# About 2.6B parameters with the real head dims (KDA 128, MLA 192/128), for GPU benchmarks.
MINI = _small(
    KIMI_K3,
    hidden_size=2048, num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=16, q_lora_rank=768,
    linear_attn_config={"num_heads": 16, "full_attn_layers": [4, 8, 12], "kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11]},
    num_experts=64, num_experts_per_token=8, num_shared_experts=1, moe_intermediate_size=768,
    routed_expert_hidden_size=1024, intermediate_size=5632, attn_res_block_size=4,
)

PRESETS: dict[str, dict[str, Any]] = {
    "kimi-k3": KIMI_K3,
    "kimi-linear-48b": KIMI_LINEAR_48B,
    "tiny": TINY,
    "tiny_linear": TINY_LINEAR,
    "tiny_mesh": TINY_MESH,
    "mini": MINI,
    "nano": NANO,
    "nano_plain_residual": NANO_PLAIN_RESIDUAL,
    "nano_softplus_gate": NANO_SOFTPLUS_GATE,
}


def preset_hf_config(name: str) -> dict[str, Any]:
    """The ``config.json`` dict of a preset (a fresh copy)."""
    if name not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return copy.deepcopy(PRESETS[name])


def preset(name: str) -> K3Config:
    """The ``K3Config`` of a preset: 'kimi-k3', 'kimi-linear-48b', 'tiny', 'tiny_linear', 'nano' or 'mini'."""
    return from_hf_config(preset_hf_config(name), name=name)


__all__ = ["KIMI_K3", "KIMI_LINEAR_48B", "TINY", "TINY_LINEAR", "MINI", "NANO", "NANO_PLAIN_RESIDUAL", "NANO_SOFTPLUS_GATE", "PRESETS", "preset", "preset_hf_config"]
