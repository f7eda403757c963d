"""KDA, MLA, MoE, AttnRes and the dense MLP against the independent float64 numpy reference.

Float32 implementation against float64 reference, norm-relative errors ||a - b|| / ||b||. Every
parameter is random and non-zero (AttnRes queries and router correction biases too), sizes are
awkward (not powers of two; T not a multiple of the 16-token KDA tile).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax.config import KDAConfig, MLAConfig, MoEConfig
from k3jax.functional import kda as kda_fn
from k3jax.layers.attn_res import AttnRes
from k3jax.layers.kda import KDA, KDAState
from k3jax.layers.mla import MLA
from k3jax.layers.mlp import DenseMLP, activation
from k3jax.layers.moe import MoE
import reference_numpy as R

TOL = 1e-5  # float32 against float64 at these sizes; measured errors are 7e-8 .. 9e-7
D = 30  # model width for the layer tests
B = 2


def materialize(make, seed, edit=None, **random_kw):
    """Build a module abstractly, fill every parameter with random numpy values (``edit`` may change
    the numpy dict first). Returns (module, float64 parameter dict for the reference)."""
    graphdef, state = nnx.split(nnx.eval_shape(make))
    params = R.random_params(nnx.to_pure_dict(state), seed, **random_kw)
    if edit is not None:
        edit(params)
    nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, params))
    return nnx.merge(graphdef, state), R.as_f64(params)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _apply(graphdef, method, state, *args):
    return getattr(nnx.merge(graphdef, state), method)(*args)


def jcall(module, *args, method="__call__"):
    """Call a module method under jax.jit. Compiles are cached by (graph definition, method,
    shapes), so modules of one structure with different parameters share a compile."""
    graphdef, state = nnx.split(module)
    return _apply(graphdef, method, state, *(jax.tree.map(jnp.asarray, a) for a in args))


def randn(seed, *shape, scale=1.0):
    return (scale * np.random.default_rng(seed).standard_normal(shape)).astype(np.float32)


# ----------------------------------------------------------------------------- KDA maths


_RECURRENT, _CHUNK = jax.jit(kda_fn.recurrent_kda), jax.jit(kda_fn.chunk_kda)


@pytest.mark.parametrize("form", ["recurrent", "chunk"])
@pytest.mark.parametrize("gate", ["bounded", "steep"])
def test_kda_forms_vs_delta_rule(form, gate):
    """recurrent_kda and chunk_kda against the per-token delta rule, from a non-zero state.
    'steep' decays (g down to -12 per step) make a 16-token tile span far beyond float32's exp range."""
    T, H, K, V = 37, 3, 6, 5
    rng = np.random.default_rng(11)
    q = R.l2_normalize(rng.standard_normal((B, T, H, K))).astype(np.float32)
    k = R.l2_normalize(rng.standard_normal((B, T, H, K))).astype(np.float32)
    v = rng.standard_normal((B, T, H, V)).astype(np.float32)
    low = -5.0 if gate == "bounded" else -12.0
    g = rng.uniform(low, 0.0, (B, T, H, K)).astype(np.float32)
    if gate == "bounded":  # mostly gentle decay so the state keeps memory across tiles
        g = (g * rng.uniform(0, 1, (B, T, H, 1)) ** 4).astype(np.float32)
    beta = R.sigmoid(rng.standard_normal((B, T, H))).astype(np.float32)
    s0 = rng.standard_normal((B, H, K, V)).astype(np.float32)
    fn = _RECURRENT if form == "recurrent" else _CHUNK
    o, s = fn(*(jnp.asarray(a) for a in (q, k, v, g, beta, s0)))
    for b in range(B):
        o_ref, s_ref = R.delta_rule(q[b], k[b], v[b], g[b], beta[b], s0[b])
        assert R.rel_err(o[b], o_ref) < TOL
        assert R.rel_err(s[b], s_ref) < TOL
    assert np.all(np.isfinite(np.asarray(o)))


# ----------------------------------------------------------------------------- KDA layer

KDA_VARIANTS = {
    "k3": KDAConfig(num_heads=3, head_dim=6, conv_size=4, gate_lower_bound=-5.0, full_rank_gate=True),
    "kimi_linear": KDAConfig(num_heads=3, head_dim=6, conv_size=4, gate_lower_bound=None, full_rank_gate=False),
}
KDA_EPS = 1e-5


def kda_reference(params, cfg, x, cache=None):
    return R.kda_layer(
        params, x, num_heads=cfg.num_heads, head_dim=cfg.head_dim, eps=KDA_EPS,
        lower_bound=cfg.gate_lower_bound, full_rank_gate=cfg.full_rank_gate, cache=cache,
    )


PROMPT, DECODE = 18, 3  # the prompt crosses a 16-token tile; then three one-token steps


@pytest.fixture(scope="module", params=sorted(KDA_VARIANTS))
def kda_case(request):
    cfg = KDA_VARIANTS[request.param]
    module, params = materialize(lambda: KDA(D, cfg, KDA_EPS, rngs=nnx.Rngs(0)), seed=3)
    x = randn(4, B, PROMPT + DECODE, D)
    return cfg, module, params, x


def test_kda_layer_prompt_then_decode(kda_case):
    """An 18-token prompt (chunked form) then three decode tokens (recurrent form), carrying the
    conv and recurrent state, against the reference on the prompt and on all 21 tokens."""
    cfg, module, params, x = kda_case
    out, state = jcall(module, x[:, :PROMPT], module.initial_state(B))
    assert isinstance(state, KDAState)
    for b in range(B):
        out_ref, cache_ref = kda_reference(params, cfg, x[b, :PROMPT])
        assert R.rel_err(out[b], out_ref) < TOL
        assert R.rel_err(state.recurrent[b], cache_ref["state"]) < TOL
        for name, conv in zip("qkv", np.split(np.asarray(state.conv), 3, axis=-1)):
            assert R.rel_err(conv[b], cache_ref[f"conv_{name}"]) < TOL
    steps = []
    for t in range(PROMPT, PROMPT + DECODE):
        o, state = jcall(module, x[:, t : t + 1], state)
        steps.append(np.asarray(o))
    steps = np.concatenate(steps, axis=1)
    for b in range(B):
        out_ref, cache_ref = kda_reference(params, cfg, x[b])
        assert R.rel_err(steps[b], out_ref[PROMPT:]) < TOL
        assert R.rel_err(state.recurrent[b], cache_ref["state"]) < TOL


def test_kda_reference_split_consistency(kda_case):
    """The reference's own cache is consistent (guards the oracle used above)."""
    cfg, module, params, x = kda_case
    whole, _ = kda_reference(params, cfg, x[0])
    first, cache = kda_reference(params, cfg, x[0, :8])
    second, _ = kda_reference(params, cfg, x[0, 8:], cache)
    assert R.rel_err(np.concatenate([first, second]), whole) < 1e-12


# ----------------------------------------------------------------------------- MLA

MLA_VARIANTS = {
    "k3": MLAConfig(num_heads=3, q_lora_rank=14, kv_lora_rank=10, qk_nope_head_dim=6, qk_rope_head_dim=3,
                    v_head_dim=5, output_gate=True),
    "kimi_linear": MLAConfig(num_heads=3, q_lora_rank=None, kv_lora_rank=10, qk_nope_head_dim=6,
                             qk_rope_head_dim=3, v_head_dim=5, output_gate=False),
}


@pytest.mark.parametrize("variant", sorted(MLA_VARIANTS))
def test_mla_layer(variant):
    cfg = MLA_VARIANTS[variant]
    module, params = materialize(lambda: MLA(D, cfg, rngs=nnx.Rngs(0)), seed=5)
    x = randn(6, B, 19, D)
    out = jcall(module, x)
    for b in range(B):
        ref = R.mla_layer(
            params, x[b], num_heads=cfg.num_heads, q_lora=cfg.q_lora_rank is not None,
            kv_lora_rank=cfg.kv_lora_rank, nope_dim=cfg.qk_nope_head_dim, rope_dim=cfg.qk_rope_head_dim,
            v_dim=cfg.v_head_dim, output_gate=cfg.output_gate,
        )
        assert R.rel_err(out[b], ref) < TOL


# ----------------------------------------------------------------------------- MoE

MOE_VARIANTS = {
    "k3_latent": (MoEConfig(num_experts=7, experts_per_token=3, num_shared_experts=2, intermediate_size=11,
                            latent_size=18, latent_norm=True, routed_scaling_factor=2.5), "situ"),
    "kimi_linear": (MoEConfig(num_experts=7, experts_per_token=3, num_shared_experts=1, intermediate_size=11,
                              routed_scaling_factor=2.446), "silu"),
}
MOE_EPS = 1e-5


ACTS = {"situ": activation("situ"), "silu": activation("silu")}  # one object each: compiles are shared


def moe_module(variant, dispatch, seed=7, edit=None):
    cfg, act_name = MOE_VARIANTS[variant]
    act = ACTS[act_name]
    return materialize(
        lambda: MoE(D, cfg, act, MOE_EPS, rngs=nnx.Rngs(0), dispatch=dispatch), seed=seed, edit=edit
    )


def moe_reference(variant, params, x):
    cfg, act_name = MOE_VARIANTS[variant]
    return R.moe_layer(
        params, x, top_k=cfg.experts_per_token, renormalize=cfg.renormalize, scaling=cfg.routed_scaling_factor,
        act=R.situ if act_name == "situ" else R.swiglu, eps=MOE_EPS, latent=cfg.latent_size is not None,
        latent_norm=cfg.latent_norm, shared=cfg.num_shared_experts > 0,
    )


@pytest.mark.parametrize("dispatch", ["sorted", "dense"])
@pytest.mark.parametrize("variant", sorted(MOE_VARIANTS))
def test_moe_layer(variant, dispatch):
    module, params = moe_module(variant, dispatch)
    x = randn(8, B, 9, D)
    out = jcall(module, x)
    ref, routing = moe_reference(variant, params, x.reshape(B * 9, D))
    assert R.rel_err(np.asarray(out).reshape(B * 9, D), ref) < TOL
    if dispatch == "dense":
        return
    weights, experts = jcall(module, x.reshape(B * 9, D), method="route")
    for t, (chosen, w) in enumerate(routing):  # same experts with the same weights
        got = dict(zip(np.asarray(experts[t]).tolist(), np.asarray(weights[t]).tolist()))
        assert sorted(got) == sorted(chosen)
        np.testing.assert_allclose([got[e] for e in chosen], w, rtol=1e-5)


def _force(kind):
    """Edit the router bias so that some experts get no tokens: 'banned' pushes three experts below
    every other; 'only_k' lifts exactly k experts above every other (all tokens go to them)."""
    def edit(params):
        bias = params["gate"]["e_score_correction_bias"]
        if kind == "banned":
            bias[[1, 4, 5]] -= 10.0
        else:
            bias[[0, 3, 6]] += 10.0
    return edit


@pytest.mark.parametrize("variant, kind", [("k3_latent", "banned"), ("kimi_linear", "only_k")])
def test_moe_sorted_equals_dense_with_empty_experts(variant, kind):
    sorted_mod, params = moe_module(variant, "sorted", seed=9, edit=_force(kind))
    dense_mod, _ = moe_module(variant, "dense", seed=9, edit=_force(kind))
    x = randn(10, B, 9, D)
    ref, routing = moe_reference(variant, params, x.reshape(B * 9, D))
    used = {e for chosen, _ in routing for e in chosen}
    empty = set(range(MOE_VARIANTS[variant][0].num_experts)) - used
    assert empty == ({1, 4, 5} if kind == "banned" else {1, 2, 4, 5})  # the forcing worked
    out_sorted = np.asarray(jcall(sorted_mod, x)).reshape(B * 9, D)
    out_dense = np.asarray(jcall(dense_mod, x)).reshape(B * 9, D)
    assert R.rel_err(out_sorted, out_dense) < 1e-6
    assert R.rel_err(out_sorted, ref) < TOL
    assert R.rel_err(out_dense, ref) < TOL


@pytest.mark.parametrize("num_experts", [7, 300])
def test_expert_order_is_numpy_stable_argsort(num_experts):
    """The pairs' order by expert is numpy's stable argsort: ties (every expert picked many times) keep the
    pairs' order."""
    from k3jax.functional import moe as moe_fn

    experts = np.random.default_rng(num_experts).integers(0, num_experts, 999).astype(np.int32)
    order = moe_fn.expert_order(jnp.asarray(experts))
    assert order.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(order), np.argsort(experts, kind="stable"))


# ----------------------------------------------------------------------------- dense MLP


@pytest.mark.parametrize("act_name", ["situ", "silu"])
def test_dense_mlp(act_name):
    """Inputs large enough (pre-activations ~ +-30) that SiTU's tanh saturation matters."""
    module, params = materialize(lambda: DenseMLP(D, 22, ACTS[act_name], rngs=nnx.Rngs(0)), seed=12)
    x = randn(13, B, 7, D, scale=12.0)
    out = jcall(module, x)
    act = R.situ if act_name == "situ" else R.swiglu
    ref = R.gated_mlp(params, x.reshape(-1, D), act)
    assert R.rel_err(np.asarray(out).reshape(-1, D), ref) < TOL


def test_situ_bounded():
    """|SiTU| <= 4 * 25 = 100 for any inputs, and matches the reference far into saturation."""
    from k3jax.functional.moe import situ

    rng = np.random.default_rng(14)
    a, b = (rng.standard_normal(500) * 200).astype(np.float32), (rng.standard_normal(500) * 200).astype(np.float32)
    out = np.asarray(situ(jnp.asarray(a), jnp.asarray(b)))
    assert np.max(np.abs(out)) <= 100.0
    assert R.rel_err(out, R.situ(a, b)) < TOL


# ----------------------------------------------------------------------------- AttnRes

ATTN_EPS = 1e-5
N_BUF = 5


def attn_res_case(seed, n_blocks, zero_query=False):
    def edit(params):
        if zero_query:
            params["proj"]["weight"][...] = 0.0
    module, params = materialize(lambda: AttnRes(D, ATTN_EPS), seed=seed, edit=edit)
    rng = np.random.default_rng(seed + 1)
    blocks = rng.standard_normal((N_BUF, B, 17, D)).astype(np.float32)
    blocks *= rng.uniform(0.5, 3.0, (N_BUF, B, 17, 1)).astype(np.float32)  # sources of different scales
    blocks[n_blocks:] = 1e3 * rng.standard_normal(blocks[n_blocks:].shape)  # must be ignored
    partial = rng.standard_normal((B, 17, D)).astype(np.float32)
    return module, params, blocks, partial


def mixes(module, blocks, n_blocks, partial):
    """The mix called eagerly with n_blocks a Python int, and jitted with n_blocks traced (as in
    the model's scan over layers)."""
    bl, pa = jnp.asarray(blocks), jnp.asarray(partial)
    return module(bl, n_blocks, pa), jcall(module, bl, jnp.asarray(n_blocks, jnp.int32), pa)


@pytest.mark.parametrize("n_blocks", [0, 2, N_BUF])
def test_attn_res_vs_reference(n_blocks):
    module, params, blocks, partial = attn_res_case(20 + n_blocks, n_blocks)
    results = mixes(module, blocks, n_blocks, partial)
    for out, weights in results:
        weights = np.asarray(weights)
        assert weights.shape == (N_BUF + 1, B, 17)
        np.testing.assert_allclose(weights.sum(axis=0), 1.0, atol=1e-6)
        assert np.all(weights[n_blocks:N_BUF] == 0.0)
        for b in range(B):
            sources = [blocks[i, b] for i in range(n_blocks)] + [partial[b]]
            ref_out, ref_w = R.attn_res_mix(sources, params, ATTN_EPS)
            assert R.rel_err(out[b], ref_out) < TOL
            got_w = np.concatenate([weights[:n_blocks, b], weights[N_BUF:, b]])
            assert R.rel_err(got_w, ref_w) < TOL
    if n_blocks:  # the random query really does make a non-uniform mix
        assert np.ptp(np.asarray(results[0][1])[:, 0]) > 0.1


def test_attn_res_zero_query_is_uniform_average():
    n_blocks = 3
    module, params, blocks, partial = attn_res_case(30, n_blocks, zero_query=True)
    for out, weights in mixes(module, blocks, n_blocks, partial):
        expected = (blocks[0] + blocks[1] + blocks[2] + partial) / 4.0
        assert R.rel_err(out, expected) < TOL
        weights = np.asarray(weights)
        np.testing.assert_allclose(weights[[0, 1, 2, N_BUF]], 0.25, rtol=1e-6)
        assert np.all(weights[n_blocks:N_BUF] == 0.0)
        np.testing.assert_allclose(weights.sum(axis=0), 1.0, atol=1e-6)
