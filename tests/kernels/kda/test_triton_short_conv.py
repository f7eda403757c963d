"""The short convs + SiLU kernels (pallas_kernels/kda/triton_short_conv.py, interpret mode on CPU: a decode step's, a
prefill chunk's) against ``causal_conv`` over the inputs side by side, then ``jax.nn.silu`` (``causal_conv`` itself:
tests/functional/test_conv.py; the KDA layer's prefill with the chunk kernel: tests/layers/test_pallas_path.py)."""

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
