"""Config: both released config.json shapes, presets, and clear errors for unsupported settings."""

import copy

import pytest

from k3jax.config import ConfigError, from_hf_config
from k3jax.presets import KIMI_K3, KIMI_LINEAR_48B, preset, preset_hf_config


def test_kimi_k3_reads_nested_text_config():
    cfg = from_hf_config(KIMI_K3)
    assert cfg.num_layers == 93 and cfg.hidden_size == 7168
    assert cfg.layer_types.count("kda") == 69 and cfg.layer_types.count("mla") == 24
    assert [i for i, t in enumerate(cfg.layer_types) if t == "mla"][-2:] == [91, 92]
    assert cfg.kda.gate_lower_bound == -5.0 and cfg.kda.full_rank_gate
    assert cfg.mla.q_lora_rank == 1536 and cfg.mla.output_gate
    assert cfg.moe.latent_size == 3584 and cfg.moe.latent_norm and cfg.moe.num_experts == 896
    assert cfg.hidden_act == "situ" and cfg.attn_res_block_size == 12 and cfg.mx_experts


def test_kimi_linear_reads_flat_config():
    cfg = from_hf_config(KIMI_LINEAR_48B)
    assert cfg.num_layers == 27 and cfg.layer_types.count("mla") == 7
    assert cfg.kda.gate_lower_bound is None and not cfg.kda.full_rank_gate
    assert cfg.mla.q_lora_rank is None and not cfg.mla.output_gate
    assert cfg.moe.latent_size is None and cfg.moe.routed_scaling_factor == 2.446
    assert cfg.hidden_act == "silu" and cfg.attn_res_block_size is None and not cfg.mx_experts


def test_extra_keys_are_ignored_and_hf_layer_types_accepted():
    c = preset_hf_config("kimi-linear-48b")
    c.update(auto_map={"AutoConfig": "x"}, torch_dtype="bfloat16", use_cache=True, some_new_key=3)
    full = set(c["linear_attn_config"]["full_attn_layers"])
    c["layer_types"] = ["full_attention" if i + 1 in full else "linear_attention" for i in range(27)]
    assert from_hf_config(c) == from_hf_config(KIMI_LINEAR_48B)


@pytest.mark.parametrize(
    "change, key",
    [
        (lambda c: c.update(hidden_act="gelu"), "hidden_act"),
        (lambda c: c.update(layer_types=["linear_attention"] * 26 + ["sliding"]), "layer_types"),
        (lambda c: c.update(layer_types=["linear_attention"] * 27), "layer_types"),
        (lambda c: c["linear_attn_config"].update(kda_layers=[1, 2, 3]), "kda_layers"),
        (lambda c: c["linear_attn_config"].update(full_attn_layers=[4, 28]), "full_attn_layers"),
        (lambda c: c["linear_attn_config"].update(head_dim="128"), "linear_attn_config.head_dim"),
        (lambda c: c.update(topk_method="greedy"), "topk_method"),
        (lambda c: c.update(num_expert_group=8), "num_expert_group"),
        (lambda c: c.update(num_experts_per_token=300), "num_experts_per_token"),
        (lambda c: c.pop("kv_lora_rank"), "kv_lora_rank"),
        (lambda c: c.update(model_type="llama"), "model_type"),
    ],
)
def test_unsupported_settings_name_the_key(change, key):
    c = copy.deepcopy(KIMI_LINEAR_48B)
    change(c)
    with pytest.raises(ConfigError, match=key):
        from_hf_config(c)


def test_presets_have_the_features_they_promise():
    tiny = preset("tiny")
    assert tiny.kda.gate_lower_bound == -5.0 and tiny.kda.full_rank_gate and tiny.mla.q_lora_rank
    assert tiny.mla.output_gate and tiny.attn_res_block_size < tiny.num_layers and tiny.moe.latent_norm
    assert tiny.hidden_act == "situ" and tiny.moe.num_experts > tiny.moe.experts_per_token > 1
    lin = preset("tiny_linear")
    assert lin.kda.gate_lower_bound is None and lin.mla.q_lora_rank is None and lin.attn_res_block_size is None
    mini = preset("mini")
    assert mini.kda.head_dim == 128 and mini.mla.qk_head_dim == 192
    with pytest.raises(KeyError, match="unknown preset"):
        preset("huge")
