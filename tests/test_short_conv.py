"""The short convs + SiLU kernels (pallas_kernels/short_conv.py, interpret mode on CPU: a decode step's, a prefill
chunk's) against ``causal_conv`` over the inputs side by side, then ``jax.nn.silu``; ``causal_conv`` itself against a
loop; the KDA layer's prefill with the chunk kernel against its XLA convs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.functional.conv import causal_conv
from pallas_kernels.kda.triton_short_conv import conv_silu_chunk, conv_silu_step

W = 4


def _inputs(batch: int, width: int, dtype, seed: int):
    keys = jax.random.split(jax.random.key(seed), 7)
    xs = [jax.random.normal(k, (batch, width), dtype) for k in keys[:3]]
    taps = [jax.random.normal(k, (width, W)) for k in keys[3:6]]
    state = jax.random.normal(keys[6], (batch, W - 1, 3 * width))
    return xs, taps, state


@pytest.mark.parametrize("batch,width,dtype", [(1, 48, jnp.bfloat16), (3, 512, jnp.float32)])
def test_conv_silu_step_matches_causal_conv(batch, width, dtype):
    """48 channels: blocks of 16, three per input; 512: two blocks of 256 per input."""
    xs, taps, state = _inputs(batch, width, dtype, seed=width)
    y, new_state = causal_conv(jnp.concatenate(xs, axis=-1)[:, None], jnp.concatenate(taps), state)
    ys, got_state = jax.jit(conv_silu_step)(xs, taps, state)
    assert all(a.shape == (batch, width) and a.dtype == jnp.float32 for a in ys)
    np.testing.assert_allclose(np.concatenate(ys, axis=-1), jax.nn.silu(y[:, 0]), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(got_state, new_state)


@pytest.mark.parametrize("batch,tokens,width,dtype", [(2, 24, 48, jnp.bfloat16), (1, 3, 512, jnp.float32),
                                                     (1, 256, 16, jnp.bfloat16)])
def test_conv_silu_chunk_matches_causal_conv(batch, tokens, width, dtype):
    """24 tokens: blocks of 8 tokens (the first reads the state); 3: blocks of one token, the first two reading
    the state for some taps; 256: blocks of 64, the later ones reading x before their first token."""
    keys = jax.random.split(jax.random.key(tokens), 3)
    steps = [_inputs(batch, width, dtype, seed=s) for s in range(tokens)]
    xs = [jnp.stack([step[0][i] for step in steps], axis=1) for i in range(3)]
    _, taps, state = steps[0]
    state = state + jax.random.normal(keys[0], state.shape)
    ys = jax.jit(conv_silu_chunk)(xs, taps, state)
    y, _ = causal_conv(jnp.concatenate(xs, axis=-1), jnp.concatenate(taps), state)
    assert all(a.shape == (batch, tokens, width) and a.dtype == jnp.float32 for a in ys)
    np.testing.assert_allclose(np.concatenate(ys, axis=-1), jax.nn.silu(y), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("step", [True, False])
def test_lowers_for_cuda_through_triton(step):
    shape = (2, 2048) if step else (1, 2048, 2048)
    kernel = conv_silu_step if step else conv_silu_chunk
    f = lambda xs, taps, state: kernel(xs, taps, state, interpret=False)
    xs = [jax.ShapeDtypeStruct(shape, jnp.bfloat16)] * 3
    taps = [jax.ShapeDtypeStruct((2048, W), jnp.float32)] * 3
    state = jax.ShapeDtypeStruct((shape[0], W - 1, 3 * 2048), jnp.float32)
    assert "xla.gpu.triton" in jax.jit(f).trace(xs, taps, state).lower(lowering_platforms=("cuda",)).as_text()


def test_bad_inputs_are_refused():
    xs, taps, state = _inputs(2, 16, jnp.float32, seed=0)
    with pytest.raises(ValueError, match="as many taps as inputs"):
        conv_silu_step(xs, taps[:2], state)
    with pytest.raises(ValueError, match=r"input 1 must be \[B, F\]"):
        conv_silu_step([xs[0], xs[1][:, :8], xs[2]], taps, state)
    with pytest.raises(ValueError, match=r"taps 2 must be \[F, W\]"):
        conv_silu_step(xs, [taps[0], taps[1], taps[2][:8]], state)
    with pytest.raises(ValueError, match=r"state must be float32 \[B, W-1, n F\]"):
        conv_silu_step(xs, taps, state[:, :2])
    with pytest.raises(ValueError, match=r"input 0 must be \[B, T, F\]"):
        conv_silu_chunk(xs, taps, state)


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


def test_kda_prefill_with_the_chunk_kernel_equals_xla_convs(monkeypatch):
    """The KDA layer on the Pallas path over two chunks of a ragged batch (the state carried from the first) with
    ``CONV_KERNEL_AT_PREFILL`` on and off: the same outputs and states."""
    from flax import nnx

    from k3jax.config import KDAConfig
    from k3jax.implementation import use_implementation
    from k3jax.layers import kda as kda_module

    cfg = KDAConfig(num_heads=2, head_dim=16, conv_size=W, gate_lower_bound=-5.0)
    layer = kda_module.KDA(32, cfg, 1e-6, rngs=nnx.Rngs(3))
    x = jax.random.normal(jax.random.key(1), (2, 24, 32))
    valid = jnp.arange(24)[None] < jnp.array([[24], [13]])
    runs, kernels = {}, {}
    for on in (True, False):
        monkeypatch.setattr(kda_module, "CONV_KERNEL_AT_PREFILL", on)
        with use_implementation("pallas"):  # one chunk's function, traced under the switch, for both chunks
            chunk = jax.jit(lambda x, state, valid: layer(x, state, valid=valid))
            state = layer.initial_state(2)
            kernels[on] = str(chunk.trace(x[:, :12], state, valid[:, :12]).jaxpr).count("name=conv_silu_chunk")
            first, state = chunk(x[:, :12], state, valid[:, :12])
            second, state = chunk(x[:, 12:], state, valid[:, 12:])
        runs[on] = (first, second, state.conv, state.recurrent)
    assert (kernels[True], kernels[False]) == (1, 0)
    for got, want in zip(runs[True], runs[False]):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
