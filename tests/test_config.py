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


def _linear(**changes):
    c = preset_hf_config("kimi-linear-48b")
    c.update(changes)
    return c


def test_first_k_dense_replace_defaults_to_one_as_in_hf_transformers():
    c = _linear()
    del c["first_k_dense_replace"]
    assert from_hf_config(c).first_k_dense_replace == 1


def test_mlp_layer_types_decide_the_dense_layers():
    c = _linear(mlp_layer_types=["dense"] * 2 + ["sparse"] * 25)
    del c["first_k_dense_replace"]
    assert from_hf_config(c).first_k_dense_replace == 2
    for kinds, match in (
        (["dense"] * 2 + ["sparse"] * 25, r"first_k_dense_replace is 1 but mlp_layer_types starts with 2 dense"),
        (["dense", "sparse", "dense"] + ["sparse"] * 24, r"mlp_layer_types: a dense layer after a sparse one"),
        (["dense"] + ["sparse"] * 25, r"mlp_layer_types: expected 27 entries"),
        (["dense"] + ["moe"] * 26, r"each 'dense' or 'sparse'"),
    ):
        with pytest.raises(ConfigError, match=match):
            from_hf_config(_linear(mlp_layer_types=kinds))


def test_hf_saved_spellings_read_as_the_released_ones():
    c = _linear()
    for released, saved in (("num_experts", "n_routed_experts"), ("num_experts_per_token", "num_experts_per_tok"),
                            ("num_shared_experts", "n_shared_experts"), ("moe_renormalize", "norm_topk_prob"),
                            ("num_expert_group", "n_group"), ("intermediate_size", "dense_ffn_hidden")):
        c[saved] = c.pop(released)
    lac = c.pop("linear_attn_config")
    c.update(linear_num_heads=lac["num_heads"], linear_head_dim=lac["head_dim"],
             linear_conv_kernel_dim=lac["short_conv_kernel_size"],
             layer_types=["full_attention" if i + 1 in lac["full_attn_layers"] else "linear_attention" for i in range(27)],
             mlp_layer_types=["dense"] + ["sparse"] * 26)
    assert from_hf_config(c) == from_hf_config(KIMI_LINEAR_48B)
    with pytest.raises(ConfigError, match=r"num_experts is 256 but n_routed_experts is 128; expected one value"):
        from_hf_config(_linear(n_routed_experts=128))


def test_hf_defaults_where_keys_are_absent():
    c = _linear(attn_res_block_size=0)
    for key in ("num_shared_experts", "routed_scaling_factor", "moe_renormalize", "intermediate_size"):
        del c[key]
    cfg = from_hf_config(c)
    assert (cfg.moe.num_shared_experts, cfg.moe.routed_scaling_factor, cfg.moe.renormalize) == (1, 2.446, True)
    assert cfg.dense_intermediate_size == 9216 and cfg.attn_res_block_size is None


@pytest.mark.parametrize("config, match", [
    ([1, 2], r"x/config.json: the top level: expected a JSON object, got a list of 2"),
    (_linear(num_hidden_layers="27"), r"x/config.json: num_hidden_layers: expected an integer >= 1, got '27'"),
    (_linear(num_hidden_layers=True), r"num_hidden_layers: expected an integer >= 1, got True"),
    (_linear(linear_attn_config="kda"), r"x/config.json: linear_attn_config: expected a JSON object, got 'kda'"),
    (_linear(hidden_act=3), r"hidden_act: expected one of \['situ', 'silu'\], got 3"),
    (_linear(rms_norm_eps=-1.0), r"rms_norm_eps: expected a positive number"),
    (_linear(routed_scaling_factor="2.4"), r"routed_scaling_factor: expected a number, got '2.4'"),
    ({"text_config": [1]}, r"x/config.json: text_config: expected a JSON object, got a list of 1"),
])
def test_wrong_types_name_the_file_key_and_expectation(config, match):
    with pytest.raises(ConfigError, match=match):
        from_hf_config(config, source="x/config.json")


@pytest.mark.parametrize("change, match", [
    (dict(tie_word_embeddings=True), r"tie_word_embeddings: expected false"),
    (dict(attention_bias=True), r"attention_bias: expected false"),
    (dict(num_key_value_heads=8), r"num_key_value_heads: expected 32"),
    (dict(mla_use_nope=False), r"mla_use_nope: expected true"),
    (dict(moe_layer_freq=2), r"moe_layer_freq: expected 1"),
    (dict(num_expert_group=None, n_group=4), r"num_expert_group: expected 1"),
    (dict(hidden_act="situ"), r"activation_situ_beta: expected a number with hidden_act 'situ'"),
    (dict(quantization_config={"format": "fp8"}), r"quantization_config.format: expected 'mxfp4-pack-quantized'"),
])
def test_settings_that_change_the_model_are_refused(change, match):
    with pytest.raises(ConfigError, match=match):
        from_hf_config(_linear(**change))
