"""The training objective against independent numpy forms: masked cross-entropy, bits per byte, the router's
bias-only balancing rule, the bf16 compute dtypes."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from k3jax.objective import balance_router_bias, bits_per_byte, compute_dtypes, cross_entropy
from k3jax.presets import preset


def test_cross_entropy_matches_numpy_and_ignores_padding():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 5, 7)).astype(np.float32) * 3
    targets = rng.integers(0, 7, (2, 5))
    mask = np.array([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]], np.float32)
    logp = logits.astype(np.float64) - np.log(np.exp(logits.astype(np.float64)).sum(-1, keepdims=True))
    expected = -sum(logp[b, t, targets[b, t]] for b in range(2) for t in range(5) if mask[b, t])
    nll, count = cross_entropy(jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(mask))
    assert float(count) == 7 and abs(float(nll) - expected) < 1e-4 * abs(expected)
    changed = targets.copy()
    changed[1, 2:] = (changed[1, 2:] + 1) % 7  # padded targets do not count
    assert float(cross_entropy(jnp.asarray(logits), jnp.asarray(changed), jnp.asarray(mask))[0]) == float(nll)


def test_bits_per_byte():
    assert abs(bits_per_byte(8 * math.log(2.0), 4) - 2.0) < 1e-12  # 2 bits a byte
    assert bits_per_byte(0.0, 0) == 0.0


def test_router_bias_moves_toward_under_loaded_experts():
    params = {"layers": {0: {"mlp": {"w": jnp.ones(3)}},
                         1: {"block_sparse_moe": {"gate": {"e_score_correction_bias": jnp.array([0.5, 0.0, -0.5, 0.0])}}}},
              "other": {"e_score_correction_bias": jnp.zeros(4)}}
    load = jnp.array([[0.0, 0.0, 0.0, 0.0], [9.0, 1.0, 3.0, 3.0]])  # layer 1 mean 4
    out = balance_router_bias(params, load, 0.25)
    np.testing.assert_array_equal(out["layers"][1]["block_sparse_moe"]["gate"]["e_score_correction_bias"],
                                  [0.25, 0.25, -0.25, 0.25])
    np.testing.assert_array_equal(out["layers"][0]["mlp"]["w"], np.ones(3))
    np.testing.assert_array_equal(out["other"]["e_score_correction_bias"], np.zeros(4))  # not a layer's router


def test_bfloat16_compute_keeps_the_float32_parameters():
    dtypes = compute_dtypes(preset("tiny"), jnp.bfloat16)
    kda = dtypes["layers"][0]["self_attn"]
    assert kda["q_proj"]["weight"] == jnp.bfloat16
    assert kda["A_log"] == jnp.float32 and kda["q_conv1d"]["weight"] == jnp.float32
    assert dtypes["layers"][1]["block_sparse_moe"]["gate"]["e_score_correction_bias"] == jnp.float32
