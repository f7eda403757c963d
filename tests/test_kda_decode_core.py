"""A KDA layer's decode core in one kernel (pallas_kernels/kda/decode_core.py, interpret mode on CPU) against
the plain-JAX reference: ``causal_conv`` + SiLU, the f_b einsum, the gates and ``recurrent_kda``, then
``gated_rms_norm``; and the KDA layer at one token with the kernel against the reference implementation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import k3jax.layers.kda as kda_layer
from k3jax import use_implementation
from k3jax.config import KDAConfig
from k3jax.functional import kda as F
from k3jax.functional.conv import causal_conv
from k3jax.functional.norms import gated_rms_norm
from pallas_kernels.kda.decode_core import decode_core

W, EPS, BOUND = 4, 1e-5, -5.0


def _inputs(B, H, K, R, dtype, seed):
    keys = iter(jax.random.split(jax.random.key(seed), 16))
    n = lambda shape, scale=1.0, dt=jnp.float32: (jax.random.normal(next(keys), shape) * scale).astype(dt)
    HK = H * K
    return dict(
        q=n((B, HK), 1.0, dtype), k=n((B, HK), 1.0, dtype), v=n((B, HK), 1.0, dtype),
        taps=tuple(n((HK, W), 0.5) for _ in range(3)), conv=n((B, W - 1, 3 * HK)),
        f_a=n((B, R), 1.0, dtype), f_b=n((HK, R), R**-0.5, dtype), beta_logits=n((B, H), 1.0, dtype),
        gate=n((B, HK), 1.0, dtype), a_log=n((H,), 0.5), dt_bias=n((H, K)), norm_weight=1.0 + n((K,), 0.1),
        state=n((B, H, K, K), 0.3),
    )


def _reference(a):
    """The layer's plain-JAX decode step between its projections."""
    B, HK = a["q"].shape
    H, K = a["dt_bias"].shape
    x = jnp.concatenate([a["q"], a["k"], a["v"]], axis=-1)[:, None]
    y, conv = causal_conv(x, jnp.concatenate(a["taps"]), a["conv"])
    q, k, v = (jax.nn.silu(t).reshape(B, 1, H, K) for t in jnp.split(y, 3, axis=-1))
    z = jnp.einsum("bi,oi->bo", a["f_a"], a["f_b"], precision="highest").reshape(B, 1, H, K)
    g = F.bounded_gate(z, a["a_log"], a["dt_bias"], BOUND)
    beta = jax.nn.sigmoid(a["beta_logits"].astype(jnp.float32))[:, None]
    o, state = F.recurrent_kda(F.l2_normalize(q), F.l2_normalize(k), v, g, beta, a["state"])
    o = gated_rms_norm(o[:, 0], a["gate"].reshape(B, H, K), a["norm_weight"], EPS)
    return o.reshape(B, HK), conv, state


def _run(a, out_dtype, **kw):
    return decode_core(a["q"], a["k"], a["v"], a["taps"], a["conv"], a["f_a"], a["f_b"], a["beta_logits"],
                       a["gate"], a["a_log"], a["dt_bias"], a["norm_weight"], a["state"], eps=EPS, lower_bound=BOUND,
                       out_dtype=out_dtype, **kw)


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


@pytest.mark.parametrize("B,H,K,R,dtype", [(1, 3, 16, 16, jnp.float32), (3, 2, 8, 4, jnp.bfloat16)])
def test_decode_core_matches_reference(B, H, K, R, dtype):
    """float32: the reference to float32 rounding; bf16 inputs: z rounded to bf16 as the layer's einsum
    returns it (the reference's einsum too), the output rounded to bf16 once."""
    a = _inputs(B, H, K, R, dtype, seed=B * 10 + H)
    o, conv, state = jax.jit(lambda a: _run(a, dtype))(a)
    o_ref, conv_ref, state_ref = _reference(a)
    assert o.shape == (B, H * K) and o.dtype == dtype
    np.testing.assert_array_equal(conv, conv_ref)  # the conv state only moves values
    tol = 2e-6 if dtype == jnp.float32 else 1e-2
    assert _rel(o, o_ref) < tol and _rel(state, state_ref) < 2e-6


def test_lowers_for_cuda_through_triton():
    a = _inputs(1, 16, 128, 128, jnp.bfloat16, seed=0)
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), a)
    text = jax.jit(lambda a: _run(a, jnp.bfloat16, interpret=False)).trace(shapes).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "xla.gpu.triton" in text


def test_bad_shapes_are_refused():
    a = _inputs(2, 2, 8, 4, jnp.float32, seed=1)
    with pytest.raises(ValueError, match=r"'f_b': \(16, 8\)"):
        _run({**a, "f_b": jnp.zeros((16, 8))}, jnp.float32)
    with pytest.raises(ValueError, match="conv and state must be float32"):
        _run({**a, "state": a["state"].astype(jnp.bfloat16)}, jnp.float32)


@pytest.mark.parametrize("full_rank_gate", [True, False])
def test_layer_decode_step_with_the_kernel(monkeypatch, full_rank_gate):
    """The KDA layer at one token on the Pallas path with ``DECODE_CORE_KERNEL`` on (its trace holds the
    kernel) against the reference implementation from the same state: output and both states."""
    monkeypatch.setattr(kda_layer, "DECODE_CORE_KERNEL", True)
    D, B, H, K = 32, 2, 2, 8
    cfg = KDAConfig(num_heads=H, head_dim=K, conv_size=W, gate_lower_bound=BOUND, full_rank_gate=full_rank_gate)
    layer = kda_layer.KDA(D, cfg, EPS, rngs=nnx.Rngs(3))
    keys = jax.random.split(jax.random.key(7), 3)
    x = jax.random.normal(keys[0], (B, 1, D))
    start = kda_layer.KDAState(jax.random.normal(keys[1], (B, W - 1, 3 * H * K)),
                               0.3 * jax.random.normal(keys[2], (B, H, K, K)))
    with use_implementation("pallas"):
        assert "kda_decode_core" in str(jax.make_jaxpr(lambda x: layer(x, start))(x))
        out, state = layer(x, start)
    with use_implementation("reference"):
        out_ref, state_ref = layer(x, start)
    assert _rel(out, out_ref) < 2e-6
    np.testing.assert_array_equal(state.conv, state_ref.conv)
    assert _rel(state.recurrent, state_ref.recurrent) < 2e-6
