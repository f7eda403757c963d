"""The name table against the released tensor names, shapes and dtypes listed in the spec (section 6)."""

from __future__ import annotations

import pytest

from convert.names import param_table, prefix_for, released_specs
from k3jax.presets import preset, preset_hf_config


def _specs(name):
    cfg = preset(name)
    specs, missing = released_specs(param_table(cfg), prefix_for(preset_hf_config(name)), cfg.mx_experts)
    assert not missing
    return {s.name: (s.dtype, list(s.shape)) for s in specs}


K3 = {
    "model.embed_tokens.weight": ("BF16", [163840, 7168]),
    "lm_head.weight": ("BF16", [163840, 7168]),
    "model.norm.weight": ("BF16", [7168]),
    "model.output_attn_res_norm.weight": ("BF16", [7168]),
    "model.output_attn_res_proj.weight": ("BF16", [1, 7168]),
    "model.layers.0.self_attention_res_proj.weight": ("BF16", [1, 7168]),
    "model.layers.0.mlp_res_norm.weight": ("BF16", [7168]),
    "model.layers.0.self_attn.q_proj.weight": ("BF16", [12288, 7168]),
    "model.layers.0.self_attn.k_conv1d.weight": ("F32", [12288, 1, 4]),
    "model.layers.0.self_attn.f_a_proj.weight": ("BF16", [128, 7168]),
    "model.layers.0.self_attn.f_b_proj.weight": ("BF16", [12288, 128]),
    "model.layers.0.self_attn.b_proj.weight": ("BF16", [96, 7168]),
    "model.layers.0.self_attn.A_log": ("F32", [128]),
    "model.layers.0.self_attn.dt_bias": ("F32", [12288]),
    "model.layers.0.self_attn.o_norm.weight": ("BF16", [128]),
    "model.layers.0.self_attn.o_proj.weight": ("BF16", [7168, 12288]),
    "model.layers.0.self_attn.g_proj.weight": ("BF16", [12288, 7168]),
    "model.layers.0.mlp.gate_proj.weight": ("BF16", [33792, 7168]),
    "model.layers.0.mlp.down_proj.weight": ("BF16", [7168, 33792]),
    "model.layers.3.self_attn.q_a_proj.weight": ("BF16", [1536, 7168]),
    "model.layers.3.self_attn.q_a_layernorm.weight": ("BF16", [1536]),
    "model.layers.3.self_attn.q_b_proj.weight": ("BF16", [18432, 1536]),
    "model.layers.3.self_attn.kv_a_proj_with_mqa.weight": ("BF16", [576, 7168]),
    "model.layers.3.self_attn.kv_a_layernorm.weight": ("BF16", [512]),
    "model.layers.3.self_attn.kv_b_proj.weight": ("BF16", [24576, 512]),
    "model.layers.92.self_attn.o_proj.weight": ("BF16", [7168, 12288]),
    "model.layers.92.self_attn.g_proj.weight": ("BF16", [12288, 7168]),
    "model.layers.1.block_sparse_moe.gate.weight": ("BF16", [896, 7168]),
    "model.layers.1.block_sparse_moe.gate.e_score_correction_bias": ("F32", [896]),
    "model.layers.1.block_sparse_moe.shared_experts.gate_proj.weight": ("BF16", [6144, 7168]),
    "model.layers.1.block_sparse_moe.routed_expert_down_proj.weight": ("BF16", [3584, 7168]),
    "model.layers.1.block_sparse_moe.routed_expert_norm.weight": ("BF16", [3584]),
    "model.layers.1.block_sparse_moe.routed_expert_up_proj.weight": ("BF16", [7168, 3584]),
    "model.layers.92.block_sparse_moe.experts.895.w1.weight_packed": ("U8", [3072, 1792]),
    "model.layers.92.block_sparse_moe.experts.895.w1.weight_scale": ("U8", [3072, 112]),
    "model.layers.1.block_sparse_moe.experts.0.w3.weight_packed": ("U8", [3072, 1792]),
    "model.layers.1.block_sparse_moe.experts.0.w2.weight_packed": ("U8", [3584, 1536]),
    "model.layers.1.block_sparse_moe.experts.0.w2.weight_scale": ("U8", [3584, 96]),
}

LINEAR = {
    "model.layers.0.self_attn.A_log": ("F32", [1, 1, 32, 1]),
    "model.layers.0.self_attn.g_a_proj.weight": ("BF16", [128, 2304]),
    "model.layers.0.self_attn.g_b_proj.weight": ("BF16", [4096, 128]),
    "model.layers.3.self_attn.q_proj.weight": ("BF16", [6144, 2304]),
    "model.layers.3.self_attn.kv_b_proj.weight": ("BF16", [8192, 512]),
    "model.layers.0.mlp.up_proj.weight": ("BF16", [9216, 2304]),
    "model.layers.26.block_sparse_moe.experts.255.w1.weight": ("BF16", [1024, 2304]),
    "model.layers.1.block_sparse_moe.experts.0.w2.weight": ("BF16", [2304, 1024]),
    "model.layers.1.block_sparse_moe.shared_experts.gate_proj.weight": ("BF16", [1024, 2304]),
    "model.layers.1.block_sparse_moe.gate.weight": ("BF16", [256, 2304]),
}


@pytest.mark.parametrize("name, prefix, expected, count", [
    ("kimi-k3", "language_model.", K3, 92 * 896 * 3 * 2),
    ("kimi-linear-48b", "", LINEAR, 26 * 256 * 3),
])
def test_released_names_shapes_dtypes(name, prefix, expected, count):
    specs = _specs(name)
    for key, want in expected.items():
        assert specs.get(prefix + key) == want, key
    assert sum(".experts." in n for n in specs) == count
    assert all(n.startswith(prefix) for n in specs)
    mla_gate = prefix + "model.layers.3.self_attn.g_proj.weight"
    assert (mla_gate in specs) == (name == "kimi-k3")
