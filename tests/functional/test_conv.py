"""``k3jax.functional.conv.causal_conv`` (KDA's short convs) against a loop over the state and the inputs."""

import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.functional.conv import causal_conv


@pytest.mark.parametrize("tokens", [1, 2, 3, 7])
@pytest.mark.parametrize("ragged", [False, True])
def test_causal_conv_matches_a_loop(tokens, ragged):
    """``causal_conv`` (each tap x delayed, the state filling in; no concatenation) against a loop over the
    state and x side by side, from prompts shorter than the state to longer, with ragged lengths (right
    padding that the new state skips)."""
    rng = np.random.default_rng(tokens)
    batch, width, taps = 3, 5, 4
    x = rng.standard_normal((batch, tokens, width)).astype(np.float32)
    weight = rng.standard_normal((width, taps)).astype(np.float32)
    state = rng.standard_normal((batch, taps - 1, width)).astype(np.float32)
    lengths = np.array([tokens, max(tokens - 1, 0), 1]) if ragged else np.full(batch, tokens)
    y, new_state = causal_conv(jnp.asarray(x), jnp.asarray(weight), jnp.asarray(state),
                               jnp.asarray(lengths) if ragged else None)
    seq = np.concatenate([state, x], axis=1)
    want = np.stack([sum(weight[:, j] * seq[:, t + j] for j in range(taps)) for t in range(tokens)], axis=1)
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-6, atol=1e-6)
    want_state = np.stack([seq[b, n : n + taps - 1] for b, n in enumerate(lengths)])
    np.testing.assert_array_equal(np.asarray(new_state), want_state)
