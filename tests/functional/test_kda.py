"""Chunked KDA (16-token tiles, WY transform) against the per-token recurrence, and the gates."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.functional.kda import bounded_gate, chunk_kda, l2_normalize, recurrent_kda, softplus_gate
from reference_numpy import rel_err

B, H, K, V = 2, 3, 12, 10
chunked = jax.jit(chunk_kda)
recurrent = jax.jit(recurrent_kda)


def inputs(T, seed, gate_scale=1.0, bounded=True):
    ks = jax.random.split(jax.random.key(seed), 8)
    q = l2_normalize(jax.random.normal(ks[0], (B, T, H, K)))
    k = l2_normalize(jax.random.normal(ks[1], (B, T, H, K)))
    v = jax.random.normal(ks[2], (B, T, H, V))
    z = gate_scale * jax.random.normal(ks[3], (B, T, H, K))
    a_log, dt_bias = jax.random.normal(ks[4], (H,)), jax.random.normal(ks[5], (H, K))
    g = bounded_gate(z, a_log, dt_bias, -5.0) if bounded else softplus_gate(z, a_log, dt_bias)
    beta = jax.nn.sigmoid(jax.random.normal(ks[6], (B, T, H)))
    state = jax.random.normal(ks[7], (B, H, K, V))
    return q, k, v, g, beta, state


@pytest.mark.parametrize("T, with_state", [(1, False), (1, True), (37, False), (37, True), (50, True)])
def test_chunked_equals_recurrent(T, with_state):
    q, k, v, g, beta, s0 = inputs(T, seed=T)
    s0 = s0 if with_state else None
    o_ref, s_ref = recurrent(q, k, v, g, beta, s0)
    o, s = chunked(q, k, v, g, beta, s0)
    assert rel_err(o, o_ref) < 1e-5 and rel_err(s, s_ref) < 1e-5


def test_unbounded_softplus_gate_chunked_equals_recurrent():
    q, k, v, g, beta, s0 = inputs(50, seed=7, gate_scale=30.0, bounded=False)
    assert float(g.min()) < -20.0  # far beyond what the bounded gate allows
    o_ref, s_ref = recurrent(q, k, v, g, beta, s0)
    o, s = chunked(q, k, v, g, beta, s0)
    assert rel_err(o, o_ref) < 1e-5 and rel_err(s, s_ref) < 1e-5


def test_bounded_gate_stays_in_range():
    z = jnp.concatenate([jnp.linspace(-1e4, 1e4, 4001), jnp.array([jnp.inf, -jnp.inf])]).reshape(-1, 1, 1)
    g = bounded_gate(z, jnp.array([2.0]), jnp.zeros((1, 1)), -5.0)
    assert bool(jnp.all((g >= -5.0) & (g <= 0.0)))
    moderate = bounded_gate(jnp.linspace(-2, 2, 101).reshape(-1, 1, 1), jnp.array([0.5]), jnp.zeros((1, 1)), -5.0)
    assert bool(jnp.all((moderate > -5.0) & (moderate < 0.0)))
    # not a clamp of the softplus gate: a different function of z
    assert not np.allclose(moderate, jnp.maximum(softplus_gate(jnp.linspace(-2, 2, 101).reshape(-1, 1, 1),
                                                                 jnp.array([0.5]), jnp.zeros((1, 1))), -5.0))


def test_chunked_finite_with_gates_pinned_at_the_floor():
    T = 3000
    q, k, v, _, beta, s0 = inputs(T, seed=3)
    g = jnp.full((B, T, H, K), -5.0)
    o, s = chunked(q, k, v, g, beta, s0)
    o_ref, s_ref = recurrent(q, k, v, g, beta, s0)
    assert bool(jnp.isfinite(o).all()) and bool(jnp.isfinite(s).all())
    assert rel_err(o, o_ref) < 1e-5 and rel_err(s, s_ref) < 1e-5
