"""An independent float64 numpy reference of Kimi K3 / Kimi Linear, written from the model specification (docs/model.md).

Nothing here imports k3jax: the tests compare the JAX implementation against these functions.
The code is deliberately plain: KDA is the per-token, per-head delta rule; MLA is a per-head,
per-query softmax; the MoE is a per-token loop over the chosen experts; Block AttnRes keeps its
blocks in a Python list, exactly as the spec's pseudocode.

Parameters are nested dicts of arrays named like the released tensors without the ``model.``
prefix, e.g. ``params["layers"][3]["self_attn"]["q_proj"]["weight"]`` (the pure-dict form of the
NNX state). Linear weights use the PyTorch [out, in] layout. Sequence functions take one
sequence ``x [T, d]``; ``decoder_forward`` loops over the batch.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np

LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm (spec section 4)
L2_EPS = 1e-6  # KDA q/k l2 normalization (spec section 3)


# ----------------------------------------------------------------------------- small pieces


def f64(a) -> np.ndarray:
    return np.asarray(a, dtype=np.float64)


def as_f64(tree):
    """A nested dict of arrays -> the same dict of float64 numpy arrays."""
    if isinstance(tree, Mapping):
        return {k: as_f64(v) for k, v in tree.items()}
    return f64(tree)


def rel_err(actual, expected) -> float:
    """||actual - expected|| / ||expected|| in float64."""
    a, b = f64(actual), f64(expected)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def sigmoid(x):
    x = f64(x)
    with np.errstate(over="ignore"):
        e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def softplus(x):
    return np.logaddexp(0.0, f64(x))


def silu(x):
    return f64(x) * sigmoid(x)


def situ(a, b, beta: float = 4.0, linear_beta: float = 25.0):
    """SiTU(a, b) = [beta tanh(a/beta) sigmoid(a)] * [linear_beta tanh(b/linear_beta)]."""
    return (beta * np.tanh(f64(a) / beta) * sigmoid(a)) * (linear_beta * np.tanh(f64(b) / linear_beta))


def swiglu(a, b):
    return silu(a) * f64(b)


def linear(x, p):
    """x [..., in] times the [out, in] weight of module dict p."""
    return f64(x) @ f64(p["weight"]).T


def rms_norm(x, weight, eps: float):
    x = f64(x)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * f64(weight)


def softmax(scores, axis: int):
    s = f64(scores)
    e = np.exp(s - np.max(s, axis=axis, keepdims=True))
    return e / np.sum(e, axis=axis, keepdims=True)


# ----------------------------------------------------------------------------- KDA (spec section 3)


def short_conv(u, weight, history=None):
    """Causal depthwise conv. u [T, F]; weight [F, 1, W]: tap W-1 multiplies the current token,
    tap W-1-lag the token ``lag`` steps back. history [W-1, F]: the inputs before u (zeros when
    None). Returns (y [T, F], the last W-1 inputs [W-1, F])."""
    u, w = f64(u), f64(weight)[:, 0, :]
    T, F = u.shape
    W = w.shape[-1]
    past = [row for row in (np.zeros((W - 1, F)) if history is None else f64(history))]
    seq = past + [row for row in u]  # input at time t sits at seq[t + W - 1]
    y = np.zeros((T, F))
    for t in range(T):
        for lag in range(W):
            y[t] += w[:, W - 1 - lag] * seq[t + W - 1 - lag]
    return y, np.stack(seq[len(seq) - (W - 1):])


def l2_normalize(x, eps: float = L2_EPS):
    x = f64(x)
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + eps)


def kda_gate(z, a_log, dt_bias, lower_bound: float | None):
    """Per-channel log decay. z [T, H, K] (f_b_proj output), a_log (>= H entries), dt_bias [H*K].
    Bounded (K3): lower_bound * sigmoid(exp(A_log[h]) * (z + dt_bias));
    softplus (Kimi Linear): -exp(A_log[h]) * softplus(z + dt_bias)."""
    T, H, K = z.shape
    out = np.zeros((T, H, K))
    a = f64(a_log).reshape(-1)
    bias = f64(dt_bias).reshape(H, K)
    for h in range(H):
        rate = np.exp(a[h])
        zz = f64(z[:, h, :]) + bias[h]
        out[:, h, :] = lower_bound * sigmoid(rate * zz) if lower_bound is not None else -rate * softplus(zz)
    return out


def delta_rule(q, k, v, g, beta, initial_state=None, scale: float | None = None):
    """The gated delta rule, one token and one head at a time.

    q, k [T, H, K] (already l2-normalized), v [T, H, V], g [T, H, K] log decay, beta [T, H];
    state [H, K, V]. Per head: S = Diag(exp g_t) S; S = S + beta_t k_t (v_t - S^T k_t)^T;
    o_t = S^T (scale q_t). Returns (o [T, H, V], final state [H, K, V]).
    """
    q, k, v, g, beta = (f64(a) for a in (q, k, v, g, beta))
    T, H, K = q.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else scale
    S = [np.zeros((K, V)) if initial_state is None else f64(initial_state)[h].copy() for h in range(H)]
    o = np.zeros((T, H, V))
    for t in range(T):
        for h in range(H):
            Sh = np.exp(g[t, h])[:, None] * S[h]
            err = v[t, h] - Sh.T @ k[t, h]
            Sh = Sh + beta[t, h] * np.outer(k[t, h], err)
            o[t, h] = Sh.T @ (scale * q[t, h])
            S[h] = Sh
    return o, np.stack(S)


def kda_layer(
    p, x, *, num_heads: int, head_dim: int, eps: float, lower_bound: float | None,
    full_rank_gate: bool, cache: Mapping[str, Any] | None = None,
):
    """The KDA layer on one sequence x [T, d]. cache: {'conv_q', 'conv_k', 'conv_v' [W-1, H*K],
    'state' [H, K, V]} carried in from earlier tokens, or None for a fresh sequence.
    Returns (out [T, d], the new cache)."""
    x = f64(x)
    T = x.shape[0]
    H, K = num_heads, head_dim
    cache = cache or {}
    new_cache = {}
    feats = {}
    for name in ("q", "k", "v"):
        u = linear(x, p[f"{name}_proj"])
        c, new_cache[f"conv_{name}"] = short_conv(u, p[f"{name}_conv1d"]["weight"], cache.get(f"conv_{name}"))
        feats[name] = silu(c).reshape(T, H, K)
    q, k, v = l2_normalize(feats["q"]), l2_normalize(feats["k"]), feats["v"]
    z = linear(linear(x, p["f_a_proj"]), p["f_b_proj"]).reshape(T, H, K)
    g = kda_gate(z, p["A_log"], p["dt_bias"], lower_bound)
    beta = sigmoid(linear(x, p["b_proj"]))  # [T, H]
    o, new_cache["state"] = delta_rule(q, k, v, g, beta, cache.get("state"))
    if full_rank_gate:
        gate = linear(x, p["g_proj"])
    else:
        gate = linear(linear(x, p["g_a_proj"]), p["g_b_proj"])
    gate = gate.reshape(T, H, K)
    out = np.zeros((T, H, K))
    for h in range(H):
        out[:, h] = rms_norm(o[:, h], p["o_norm"]["weight"], eps) * sigmoid(gate[:, h])
    return linear(out.reshape(T, H * K), p["o_proj"]), new_cache


# ----------------------------------------------------------------------------- MLA (spec section 4)


def mla_layer(
    p, x, *, num_heads: int, q_lora: bool, kv_lora_rank: int, nope_dim: int, rope_dim: int,
    v_dim: int, output_gate: bool,
):
    """Gated MLA without rotary on one sequence x [T, d] -> [T, d]."""
    x = f64(x)
    T = x.shape[0]
    H, Dq = num_heads, nope_dim + rope_dim
    if q_lora:
        q = linear(rms_norm(linear(x, p["q_a_proj"]), p["q_a_layernorm"]["weight"], LATENT_NORM_EPS), p["q_b_proj"])
    else:
        q = linear(x, p["q_proj"])
    q = q.reshape(T, H, Dq)
    c = linear(x, p["kv_a_proj_with_mqa"])
    c_kv, k_pe = c[:, :kv_lora_rank], c[:, kv_lora_rank:]
    assert k_pe.shape[1] == rope_dim
    kv = linear(rms_norm(c_kv, p["kv_a_layernorm"]["weight"], LATENT_NORM_EPS), p["kv_b_proj"])
    kv = kv.reshape(T, H, nope_dim + v_dim)
    o = np.zeros((T, H, v_dim))
    for h in range(H):
        keys = [np.concatenate([kv[s, h, :nope_dim], k_pe[s]]) for s in range(T)]  # k_pe shared, not rotated
        values = [kv[s, h, nope_dim:] for s in range(T)]
        for t in range(T):
            scores = np.array([q[t, h] @ keys[s] for s in range(t + 1)]) * Dq**-0.5
            w = np.exp(scores - scores.max())
            w = w / w.sum()
            o[t, h] = sum(w[s] * values[s] for s in range(t + 1))
    o = o.reshape(T, H * v_dim)
    if output_gate:
        o = o * sigmoid(linear(x, p["g_proj"]))
    return linear(o, p["o_proj"])


# ----------------------------------------------------------------------------- MLPs and MoE (spec section 5)


def gated_mlp(p, x, act: Callable):
    """down_proj(act(gate_proj x, up_proj x)); dense layer 0 and the shared experts."""
    return linear(act(linear(x, p["gate_proj"]), linear(x, p["up_proj"])), p["down_proj"])


def route_token(x_t, gate_weight, correction_bias, top_k: int, renormalize: bool, scaling: float):
    """Sigmoid router, noaux_tc: the bias only picks. Returns (chosen experts list, weights [k])."""
    s = sigmoid(f64(gate_weight) @ f64(x_t))  # [E]
    biased = s + f64(correction_bias)
    chosen = sorted(range(len(s)), key=lambda e: -biased[e])[:top_k]
    w = np.array([s[e] for e in chosen])
    if renormalize:
        w = w / (w.sum() + 1e-20)
    return chosen, w * scaling


def moe_layer(
    p, x, *, top_k: int, renormalize: bool, scaling: float, act: Callable, eps: float,
    latent: bool, latent_norm: bool, shared: bool,
):
    """MoE on x [T, d], token by token. Returns (out [T, d], routing: list of (chosen, weights))."""
    x = f64(x)
    e = p["experts"]
    w1, w2, w3 = f64(e["w1"]), f64(e["w2"]), f64(e["w3"])  # [E, F, R], [E, R, F], [E, F, R]
    gate_w, bias = p["gate"]["weight"], p["gate"]["e_score_correction_bias"]
    out, routing = [], []
    for t in range(x.shape[0]):
        chosen, weights = route_token(x[t], gate_w, bias, top_k, renormalize, scaling)
        routing.append((chosen, weights))
        z = linear(x[t], p["routed_expert_down_proj"]) if latent else x[t]
        y = np.zeros_like(z)
        for ex, wj in zip(chosen, weights):
            y = y + wj * (w2[ex] @ act(w1[ex] @ z, w3[ex] @ z))
        if latent:
            if latent_norm:
                y = rms_norm(y, p["routed_expert_norm"]["weight"], eps)
            y = linear(y, p["routed_expert_up_proj"])
        if shared:
            y = y + gated_mlp(p["shared_experts"], x[t], act)
        out.append(y)
    return np.stack(out), routing


# ----------------------------------------------------------------------------- Block AttnRes (spec section 2)


def attn_res_mix(sources: list, p, eps: float):
    """Softmax over depth. sources: a list of n raw [T, d] arrays; p: {'norm': {'weight' [d]},
    'proj': {'weight' [1, d]}}. Returns (sum_i w_i V_i [T, d], weights [n, T])."""
    query = f64(p["norm"]["weight"]) * f64(p["proj"]["weight"])[0]
    scores = []
    for V in sources:
        V = f64(V)
        scores.append((V / np.sqrt(np.mean(V * V, axis=-1, keepdims=True) + eps)) @ query)  # [T]
    w = softmax(np.stack(scores), axis=0)
    out = sum(w[i][:, None] * f64(sources[i]) for i in range(len(sources)))
    return out, w


# ----------------------------------------------------------------------------- the decoder


def text_config(hf_config: Mapping[str, Any]) -> Mapping[str, Any]:
    return hf_config.get("text_config") or hf_config


def _layer_fns(c: Mapping[str, Any], L: int):
    """(attention(p, x), ffn(p, x)) for layer L, read from the released config keys."""
    lac = c["linear_attn_config"]
    eps = c["rms_norm_eps"]
    if c.get("hidden_act") == "situ":
        beta, lin_beta = c.get("activation_situ_beta", 4.0), c.get("activation_situ_linear_beta", 25.0)
        act = lambda a, b: situ(a, b, beta, lin_beta)
    else:
        assert c.get("hidden_act", "silu") == "silu"
        act = swiglu
    if L + 1 in set(lac["full_attn_layers"]):
        def attention(p, x):
            return mla_layer(
                p, x, num_heads=c["num_attention_heads"], q_lora=c.get("q_lora_rank") is not None,
                kv_lora_rank=c["kv_lora_rank"], nope_dim=c["qk_nope_head_dim"], rope_dim=c["qk_rope_head_dim"],
                v_dim=c["v_head_dim"], output_gate=bool(c.get("mla_use_output_gate", False)),
            )
    else:
        def attention(p, x):
            return kda_layer(
                p, x, num_heads=lac["num_heads"], head_dim=lac["head_dim"], eps=eps,
                lower_bound=lac.get("gate_lower_bound"), full_rank_gate=bool(lac.get("use_full_rank_gate", False)),
            )[0]
    if L < c.get("first_k_dense_replace", 0):
        def ffn(p, x):
            return gated_mlp(p["mlp"], x, act)
    else:
        def ffn(p, x):
            return moe_layer(
                p["block_sparse_moe"], x, top_k=c["num_experts_per_token"],
                renormalize=c.get("moe_renormalize", True), scaling=c.get("routed_scaling_factor", 1.0),
                act=act, eps=eps, latent=c.get("routed_expert_hidden_size") is not None,
                latent_norm=bool(c.get("latent_moe_use_norm", False)), shared=bool(c.get("num_shared_experts")),
            )[0]
    return attention, ffn


def sequence_forward(params, hf_config, tokens):
    """One sequence of token ids [T] -> (logits [T, V], mix log or None).

    The mix log (K3 only) has, per layer, the weights of the attention-side and MLP-side mixes as
    [n, T] arrays over that mix's sources (the stored blocks in order, then the live partial sum),
    and the output mix's weights."""
    c = text_config(hf_config)
    eps = c["rms_norm_eps"]
    layers = params["layers"]
    x = f64(params["embed_tokens"]["weight"])[np.asarray(tokens)]
    block = c.get("attn_res_block_size")
    log = None
    if block:
        blocks: list = []
        partial = x
        log = {"layers": [], "output": None}
        for L in range(c["num_hidden_layers"]):
            attention, ffn = _layer_fns(c, L)
            lp = layers[L]
            partial_in = partial
            if blocks:
                h, w_attn = attn_res_mix(blocks + [partial_in], lp["self_attention_res"], eps)
            else:
                h, w_attn = partial_in, np.ones((1, x.shape[0]))  # one source: weight one
            if L % block == 0:
                blocks.append(partial_in)
                partial = np.zeros_like(partial_in)
            else:
                partial = partial_in
            partial = partial + attention(lp["self_attn"], rms_norm(h, lp["input_layernorm"]["weight"], eps))
            h, w_mlp = attn_res_mix(blocks + [partial], lp["mlp_res"], eps)
            partial = partial + ffn(lp, rms_norm(h, lp["post_attention_layernorm"]["weight"], eps))
            log["layers"].append((w_attn, w_mlp))
        x, log["output"] = attn_res_mix(blocks + [partial], params["output_attn_res"], eps)
    else:
        for L in range(c["num_hidden_layers"]):
            attention, ffn = _layer_fns(c, L)
            lp = layers[L]
            x = x + attention(lp["self_attn"], rms_norm(x, lp["input_layernorm"]["weight"], eps))
            x = x + ffn(lp, rms_norm(x, lp["post_attention_layernorm"]["weight"], eps))
    logits = linear(rms_norm(x, params["norm"]["weight"], eps), params["lm_head"])
    return logits, log


def decoder_forward(params, hf_config, tokens):
    """tokens [B, T] -> (logits [B, T, V] float64, per-sequence mix logs (K3) or None)."""
    outs = [sequence_forward(params, hf_config, row) for row in np.asarray(tokens)]
    logs = [log for _, log in outs]
    return np.stack([lg for lg, _ in outs]), (logs if logs[0] is not None else None)


# ----------------------------------------------------------------------------- random parameters


def random_params(shapes, seed: int, attn_res_scale: float = 0.3, bias_scale: float = 0.3):
    """Random float32 parameters for a nested dict whose leaves have ``.shape`` (and ``.dtype``).

    Nothing is zero, so every parameter can make a test fail: norm weights 1 + 0.25 N(0, 1);
    AttnRes queries (``proj``, zero-initialized in the model) attn_res_scale N(0, 1); the router's
    correction bias (zero-initialized) bias_scale N(0, 1); A_log log U(0.2, 2); dt_bias 0.5 N(0, 1);
    every other tensor N(0, 1 / fan_in) with fan_in its last axis.
    """
    rng = np.random.default_rng(seed)

    def make(path, leaf):
        shape = tuple(leaf.shape)
        name, parent = path[-1], (path[-2] if len(path) > 1 else "")
        if name == "A_log":
            v = np.log(rng.uniform(0.2, 2.0, shape))
        elif name == "dt_bias":
            v = 0.5 * rng.standard_normal(shape)
        elif name == "e_score_correction_bias":
            v = bias_scale * rng.standard_normal(shape)
        elif name == "weight" and "norm" in str(parent):
            v = 1.0 + 0.25 * rng.standard_normal(shape)
        elif name == "weight" and parent == "proj":  # an AttnRes query
            v = attn_res_scale * rng.standard_normal(shape)
        else:
            v = rng.standard_normal(shape) * shape[-1] ** -0.5
        return v.astype(getattr(leaf, "dtype", np.float32))

    def walk(path, tree):
        if isinstance(tree, Mapping):
            return {k: walk(path + (k,), v) for k, v in tree.items()}
        return make(path, tree)

    return walk((), shapes)
