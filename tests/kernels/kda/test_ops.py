"""The KDA op's kernel entries (``pallas_kernels.kda.ops``: interpret mode on CPU) against the float32 reference,
and its choice of lowering.

Inputs are bf16-rounded once and both sides see the same rounded values; errors are ||a - b|| / ||b||.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.functional import kda as ref
from k3jax.implementation import KernelPolicy, use_implementation
from kda_inputs import plain_inputs as inputs
from kda_inputs import raw_inputs
from pallas_kernels.kda import KDABlocks, chunk_kda, chunk_kda_fused, step_kda, step_kda_fused
from pallas_kernels.kda import reference
from pallas_kernels.kda.ops import resolve_decode_lowering, resolve_lowering
from pallas_kernels.kda.triton import _unit_lower_inverse
from reference_numpy import rel_err

TOL = 5e-3
BLOCKS = KDABlocks(chunk=16, block_v=16)  # one 16-token tile per chunk: the cheapest to interpret
_chunk = jax.jit(functools.partial(chunk_kda, blocks=BLOCKS))  # one compile per input signature
_recurrent = jax.jit(ref.recurrent_kda)


@pytest.mark.parametrize("T,gate,with_state", [
    (37, "random", True), (50, "floor", False), (1, "near_zero", True), (37, "near_zero", True),
])
def test_chunk_matches_reference(T, gate, with_state):
    q, k, v, g, beta, h0 = inputs(T, T=T, gate=gate)
    h0 = h0 if with_state else None
    o, s = _chunk(q, k, v, g, beta, h0)
    ro, rs = _recurrent(q, k, v, g, beta, h0)
    assert o.shape == ro.shape and o.dtype == jnp.float32 and s.shape == rs.shape
    assert rel_err(o, ro) < TOL and rel_err(s, rs) < TOL


def test_default_blocks_two_sub_tiles():
    """The default chunk (32 tokens = two 16-token sub-tiles) exercises the off-diagonal blocks."""
    q, k, v, g, beta, _ = inputs(7, T=50)
    o, s = jax.jit(chunk_kda)(q, k, v, g, beta, None)
    ro, rs = _recurrent(q, k, v, g, beta, None)
    assert rel_err(o, ro) < TOL and rel_err(s, rs) < TOL


@pytest.mark.parametrize("cosine", [0.0, 0.99])
def test_block_inverse_matches_exact(cosine):
    """The 16x16 (I + L)^-1 by block doubling, for random and nearly parallel unit keys (beta = 1)."""
    ks = jax.random.split(jax.random.PRNGKey(21), 2)
    shared, own = jax.random.normal(ks[0], (1, 64)), jax.random.normal(ks[1], (16, 64))
    keys = ref.l2_normalize(cosine * shared + (1 - cosine**2) ** 0.5 * own)
    lower = jnp.tril(keys @ keys.T, -1)
    exact = np.linalg.inv(np.eye(16) + np.asarray(lower, np.float64))
    assert rel_err(_unit_lower_inverse(lower), exact) < 1e-6


def test_fused_inputs_match():
    q, k, v, z, a_log, dt_bias, beta_logits, h0 = raw_inputs(11)
    args = (q, k, v, z, a_log, dt_bias, beta_logits, -5.0, h0)
    o, s = jax.jit(lambda *a: chunk_kda_fused(*a, blocks=BLOCKS), static_argnums=7)(*args)
    ro, rs = reference.chunk_kda_fused(*args)
    assert rel_err(o, ro) < TOL and rel_err(s, rs) < TOL
    with pytest.raises(ValueError):
        chunk_kda_fused(*args[:7], lower_bound=-20.0)


def test_unbounded_gate_falls_back_to_reference():
    q, k, v, g, beta, h0 = inputs(5, T=37)
    g = -40.0 * jnp.abs(g)  # softplus-style gates far below the floor
    o, s = chunk_kda(q, k, v, g, beta, h0, safe_gate=False)
    ro, rs = _recurrent(q, k, v, g, beta, h0)
    assert rel_err(o, ro) < 1e-4 and rel_err(s, rs) < 1e-4


def test_decode_step_matches():
    q, k, v, g, beta, h0 = inputs(3, T=1, V=32)
    o, s = jax.jit(lambda *a: step_kda(*a, blocks=KDABlocks(decode_block_v=16)))(
        q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], h0)
    ro, rs = ref.step_kda(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], h0)
    assert rel_err(o, ro) < 1e-5 and rel_err(s, rs) < 1e-5


def test_fused_decode_step_matches():
    """Raw inputs for one token: the kernel's gate, norms and sigmoid against the reference's."""
    q, k, v, z, a_log, dt_bias, beta_logits, h0 = raw_inputs(4, T=1, V=32)
    q, k, v, z, beta_logits = (a[:, 0] for a in (q, k, v, z, beta_logits))
    blocks = KDABlocks(decode_block_v=16)
    o, s = jax.jit(lambda *a: step_kda_fused(*a, lower_bound=-5.0, blocks=blocks))(
        q, k, v, z, a_log, dt_bias, beta_logits, h0)
    rq, rk, g, beta = reference.fused_inputs(q, k, z, a_log, dt_bias, beta_logits, -5.0)
    ro, rs = ref.step_kda(rq, rk, v, g, beta, h0)
    assert rel_err(o, ro) < 1e-5 and rel_err(s, rs) < 1e-5


def test_gradients_match_reference_autodiff():
    q, k, v, g, beta, h0 = (a.astype(jnp.float32) for a in inputs(13, T=37))
    w_o, w_s = jax.random.normal(jax.random.PRNGKey(99), (2, 37, 2, 16)), jax.random.normal(jax.random.PRNGKey(98), h0.shape)

    def loss(fn):  # linear in the outputs, so both sides see the same cotangents
        def f(q, k, v, g, beta, h0):
            o, s = fn(q, k, v, g, beta, h0)
            return jnp.sum(o * w_o) + jnp.sum(s * w_s)
        return f

    grads = jax.jit(jax.grad(loss(_chunk), argnums=range(6)))(q, k, v, g, beta, h0)
    ref_grads = jax.grad(loss(ref.chunk_kda), argnums=range(6))(q, k, v, g, beta, h0)
    for got, want in zip(grads, ref_grads):
        assert rel_err(got, want) < 1e-5


@pytest.mark.parametrize("lowering", ["mosaic_gpu", "mosaic_tpu"])
def test_public_entry_points_run_each_lowering(lowering):
    """``KDABlocks.lowering`` routes the public functions to the Mosaic kernels (their interpret modes
    here): fused prefill over two calls (the state carried between them) and a fused decode step."""
    q, k, v, z, a_log, dt_bias, beta_logits, h0 = raw_inputs(21, B=1, T=41, H=1, K=64, V=64)
    blocks = KDABlocks(lowering=lowering)
    fused = jax.jit(lambda *a: chunk_kda_fused(*a, blocks=blocks), static_argnums=7)
    o1, s1 = fused(*(a[:, :37] for a in (q, k, v, z)), a_log, dt_bias, beta_logits[:, :37], -5.0, h0)
    o2, s2 = step_kda_fused(*(a[:, 37] for a in (q, k, v, z)), a_log, dt_bias, beta_logits[:, 37], s1, blocks=blocks)
    ro, rs = reference.chunk_kda_fused(q[:, :38], k[:, :38], v[:, :38], z[:, :38], a_log, dt_bias,
                                       beta_logits[:, :38], -5.0, h0)
    assert rel_err(o1, ro[:, :37]) < TOL and rel_err(o2, ro[:, 37]) < TOL and rel_err(s2, rs) < TOL
    with pytest.raises(ValueError, match="lowering"):
        KDABlocks(lowering="cuda")


@pytest.mark.parametrize("backend,version,dims,expected", [
    ("tpu", "0.10.2", (128, 128), "mosaic_tpu"),
    ("gpu", "0.11.2", (128, 128), "mosaic_gpu"),
    ("gpu", "0.11.2", (32, 128), "triton"),  # the Mosaic GPU walk needs K and V in multiples of 64
    ("gpu", "0.10.2", (128, 128), "triton"),
    ("cpu", "0.11.2", (128, 128), "triton"),  # interpret mode runs the Triton bodies
])
def test_auto_lowering_by_backend_and_version(monkeypatch, backend, version, dims, expected):
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    monkeypatch.setattr(jax, "__version__", version)
    assert resolve_lowering("auto", *dims) == expected
    threshold = KernelPolicy().kda_mosaic_decode_min_state_bytes
    large, small = threshold, threshold - 1
    assert resolve_decode_lowering("auto", *dims, large) == expected
    assert resolve_decode_lowering("auto", *dims, small) == ("triton" if expected == "mosaic_gpu" else expected)
    with use_implementation("pallas", policy=KernelPolicy(kda_mosaic_decode_min_state_bytes=small)):
        assert resolve_decode_lowering("auto", *dims, small) == expected  # the threshold is the policy's
    assert resolve_decode_lowering("mosaic_gpu", *dims, small) == "mosaic_gpu"
    assert resolve_lowering("mosaic_tpu", *dims) == "mosaic_tpu"


def test_float32_inputs_keep_float32_intermediates():
    """The kernels' precision follows the inputs: float32 q, k, v keep float32 between the kernels
    (``FLOAT32_BLOCKS``) and match the float32 maths to its rounding; bf16 intermediates, asked for with
    ``DEFAULT_BLOCKS``, are off by bf16's rounding."""
    q, k, v, z, a_log, dt_bias, beta_logits, h0 = (a.astype(jnp.float32) for a in raw_inputs(17, T=41))
    expected = reference.chunk_kda_fused(q, k, v, z, a_log, dt_bias, beta_logits, -5.0, h0)
    precise = chunk_kda_fused(q, k, v, z, a_log, dt_bias, beta_logits, -5.0, h0)
    rounded = chunk_kda_fused(q, k, v, z, a_log, dt_bias, beta_logits, -5.0, h0, blocks=KDABlocks())
    for out, ref_out in zip(precise, expected):
        assert rel_err(out, ref_out) < 2e-5
    assert rel_err(rounded[0], expected[0]) > 1e-3
