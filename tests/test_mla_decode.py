"""MLA decode attention over the latent cache in one pass (pallas_kernels/mla_decode.py, interpret mode on
CPU) against softmax attention in float64 NumPy, and the MLA layer's decode steps with it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import k3jax.layers.mla as mla_layer
from k3jax import preset
from k3jax.implementation import use_implementation
from k3jax.layers.mla import MLA
from pallas_kernels.mla_decode import combine_splits, default_splits, latent_attention
from reference_numpy import rel_err

B, H, R, P, S = 3, 3, 32, 16, 100
LENGTHS = np.array([1, 57, 100])  # one row, a split boundary inside a block, the whole cache
_attend = jax.jit(latent_attention, static_argnames=("scale", "window", "splits", "block"))


def _inputs(dtype, seed: int = 0):
    keys = jax.random.split(jax.random.key(seed), 4)
    shapes = [(B, H, R), (B, H, P), (B, S, R), (B, S, P)]
    return [jax.random.normal(k, s).astype(dtype) for k, s in zip(keys, shapes)]


def _numpy_attention(q_lat, q_pe, c_kv, k_pe, lengths, scale):
    q, qp, c, kp = (np.asarray(a, np.float64) for a in (q_lat, q_pe, c_kv, k_pe))
    scores = (np.einsum("bhr,bsr->bhs", q, c) + np.einsum("bhp,bsp->bhs", qp, kp)) * scale
    scores = np.where(np.arange(S)[None, None, :] < np.asarray(lengths)[:, None, None], scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    return np.einsum("bhs,bsr->bhr", probs / probs.sum(-1, keepdims=True), c)


@pytest.mark.parametrize("splits", [1, 2, 5, None])
def test_matches_softmax_attention(splits):
    """float32: every split count (5: splits past a short sequence's keys see none) to float32 rounding."""
    q_lat, q_pe, c_kv, k_pe = _inputs(jnp.float32)
    out = _attend(q_lat, q_pe, c_kv, k_pe, jnp.asarray(LENGTHS), 0.3, splits=splits, block=16)
    assert out.shape == (B, H, R) and out.dtype == jnp.float32
    assert rel_err(out, _numpy_attention(q_lat, q_pe, c_kv, k_pe, LENGTHS, 0.3)) < 1e-5


def test_head_groups():
    """40 heads: two programs of 32 heads per (sequence, split), the second half padding."""
    keys = jax.random.split(jax.random.key(5), 4)
    q_lat, q_pe = jax.random.normal(keys[0], (B, 40, R)), jax.random.normal(keys[1], (B, 40, P))
    c_kv, k_pe = jax.random.normal(keys[2], (B, S, R)), jax.random.normal(keys[3], (B, S, P))
    out = _attend(q_lat, q_pe, c_kv, k_pe, jnp.asarray(LENGTHS), 0.3, splits=2, block=16)
    assert out.shape == (B, 40, R)
    assert rel_err(out, _numpy_attention(q_lat, q_pe, c_kv, k_pe, LENGTHS, 0.3)) < 1e-5


def test_bf16_cache_within_bf16_rounding():
    """A bf16 cache: products in bf16 (q_lat and the probabilities rounded), sums in float32."""
    q_lat, q_pe, c_kv, k_pe = _inputs(jnp.bfloat16, seed=1)
    out = _attend(q_lat.astype(jnp.float32), q_pe, c_kv, k_pe, jnp.asarray(LENGTHS), 0.3, splits=2, block=16)
    assert rel_err(out, _numpy_attention(q_lat, q_pe, c_kv, k_pe, LENGTHS, 0.3)) < 1e-2


def test_window_reads_only_its_rows():
    """``window`` bounds the rows read, even for a length past it: rows from the window on may hold
    anything (here NaN) without effect."""
    q_lat, q_pe, c_kv, k_pe = _inputs(jnp.float32, seed=2)
    poisoned = c_kv.at[:, 60:].set(jnp.nan), k_pe.at[:, 60:].set(jnp.nan)
    out = _attend(q_lat, q_pe, *poisoned, jnp.asarray(LENGTHS), 0.3, window=60, splits=3, block=16)
    expected = _numpy_attention(q_lat, q_pe, c_kv, k_pe, np.minimum(LENGTHS, 60), 0.3)
    assert rel_err(out, expected) < 1e-5


def test_combine_splits_weighs_each_split_by_its_maximum_and_total():
    """Two splits of one head's keys, worked by hand in base 2: each split's normalized output weighs
    2^(m - top) l, and a split with no key (m = -inf, l = 0) adds nothing."""
    out = jnp.array([[[[2.0, 4.0]], [[1.0, 3.0]], [[0.0, 0.0]]]])  # [B=1, J=3, H=1, R=2]
    m = jnp.array([[[3.0], [1.0], [-jnp.inf]]])
    l = jnp.array([[[2.0], [1.0], [0.0]]])
    expected = (2.0 * np.array([2.0, 4.0]) + 0.25 * np.array([1.0, 3.0])) / (2.0 + 0.25)
    np.testing.assert_allclose(np.asarray(combine_splits(out, m, l))[0, 0], expected, rtol=1e-6)


def test_default_splits():
    assert default_splits(1, 192) == 3  # a short cache: one block each
    assert default_splits(1, 1 << 20) == 128 and default_splits(64, 1 << 20) == 2


def test_mla_decode_steps_with_the_kernel_equal_the_expanded_form(monkeypatch):
    """The layer's decode steps on the Pallas path with ``DECODE_ATTENTION_KERNEL`` (the trace holds the
    kernel) equal the expanded full-sequence attention, as the absorbed form does."""
    monkeypatch.setattr(mla_layer, "DECODE_ATTENTION_KERNEL", True)
    cfg = preset("tiny").mla
    mla = MLA(37, cfg, rngs=nnx.Rngs(3))
    x = jax.random.normal(jax.random.key(4), (2, 9, 37))
    expanded = mla(x)
    with use_implementation("pallas"):
        step = jax.jit(lambda x, cache, start: mla.extend(x, cache, start))
        cache, outs = mla.init_cache(2, 16), []
        for t in range(9):
            o, cache = step(x[:, t : t + 1], cache, jnp.full((2,), t, jnp.int32))
            outs.append(o)
        jaxpr = str(jax.make_jaxpr(lambda x, c: mla.extend(x, c, jnp.zeros(2, jnp.int32)))(x[:, :1], cache))
    assert "latent_attention" in jaxpr
    assert rel_err(jnp.concatenate(outs, axis=1), expanded) < 1e-5


def test_lowers_for_cuda_through_triton():
    """Pallas' Triton lowering at K3's widths (96 heads: three programs of 32; R 512, P 64) over 200 cache
    rows, on the CPU."""
    f = lambda q, qp, c, kp, n: latent_attention(q, qp, c, kp, n, 0.07, interpret=False)
    args = [jax.ShapeDtypeStruct(s, d) for s, d in [((1, 96, 512), jnp.float32), ((1, 96, 64), jnp.bfloat16),
                                                    ((1, 200, 512), jnp.bfloat16), ((1, 200, 64), jnp.bfloat16),
                                                    ((1,), jnp.int32)]]
    assert "xla.gpu.triton" in jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_bad_inputs_are_refused():
    q_lat, q_pe, c_kv, k_pe = _inputs(jnp.float32)
    with pytest.raises(ValueError, match="k_pe"):
        latent_attention(q_lat, q_pe, c_kv, k_pe[:, :, :8], jnp.asarray(LENGTHS), 0.3)
    with pytest.raises(ValueError, match="lengths"):
        latent_attention(q_lat, q_pe, c_kv, k_pe, jnp.asarray(LENGTHS[:2]), 0.3)
    with pytest.raises(ValueError, match="power of two"):
        latent_attention(q_lat, q_pe, c_kv, k_pe, jnp.asarray(LENGTHS), 0.3, block=24)
    with pytest.raises(ValueError, match="on a GPU"):
        latent_attention(q_lat[:, :, :24], q_pe, c_kv[:, :, :24], k_pe, jnp.asarray(LENGTHS), 0.3, interpret=False)
