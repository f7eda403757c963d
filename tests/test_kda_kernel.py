"""The KDA Pallas kernels (interpret mode on CPU) against the float32 reference.

Inputs are bf16-rounded once and both sides see the same rounded values; errors are ||a - b|| / ||b||.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.functional import kda as ref
from k3jax.functional.norms import gated_rms_norm
from kda_inputs import plain_inputs as inputs
from kda_inputs import raw_inputs
from pallas_kernels.kda import KDABlocks, chunk_kda, chunk_kda_fused, step_kda, step_kda_fused
from pallas_kernels.kda import reference
from pallas_kernels.kda._compat import MOSAIC_DECODE_MIN_STATE_BYTES, resolve_decode_lowering, resolve_lowering
from pallas_kernels.kda.kernel import _unit_lower_inverse
from pallas_kernels.kda.ops import GatedNorm
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


def _low_rank_decode_inputs(seed, dtype, B=3, H=3, K=16, V=32, R=8):
    """One token's raw inputs (awkward B, H; R != K) in dtype, plus f_a [B, R], f_b [H * K, R] and the
    output norm's gate [B, H, V] and weight [V]."""
    q, k, v, _, a_log, dt_bias, beta_logits, h0 = raw_inputs(seed, B=B, T=1, H=H, K=K, V=V)
    ks = jax.random.split(jax.random.PRNGKey(seed + 1000), 4)
    f_a = jax.random.normal(ks[0], (B, R), dtype)
    f_b = (R**-0.5 * jax.random.normal(ks[1], (H * K, R))).astype(dtype)
    gate = jax.random.normal(ks[2], (B, H, V), dtype)
    weight = (1.0 + 0.1 * jax.random.normal(ks[3], (V,))).astype(dtype)
    q, k, v, beta_logits = (a[:, 0].astype(dtype) for a in (q, k, v, beta_logits))
    return (q, k, v, f_a, f_b, a_log, dt_bias, beta_logits, h0), (gate, weight)


@pytest.mark.parametrize("dtype,with_norm", [(jnp.float32, False), (jnp.float32, True), (jnp.bfloat16, True)])
def test_fused_decode_low_rank_z_and_norm(dtype, with_norm):
    """z = f_a f_b^T formed in the kernel (and the gated output norm as its epilogue) against the XLA
    composition: the layer's einsum for z, the decode kernel on it, ``gated_rms_norm`` and the cast."""
    (q, k, v, f_a, f_b, a_log, dt_bias, beta_logits, h0), (gate, weight) = _low_rank_decode_inputs(8, dtype)
    eps, blocks = 1e-6, KDABlocks(decode_block_v=16)
    norm = GatedNorm(gate, weight, eps, dtype) if with_norm else None
    o, s = jax.jit(lambda q, k, v, f_a, f_b, *a: step_kda_fused(q, k, v, (f_a, f_b), *a, norm=norm, blocks=blocks))(
        q, k, v, f_a, f_b, a_log, dt_bias, beta_logits, h0)
    z = jnp.einsum("bi,oi->bo", f_a, f_b, precision=jax.lax.Precision.HIGHEST).reshape(q.shape)
    ro, rs = step_kda_fused(q, k, v, z, a_log, dt_bias, beta_logits, h0, blocks=blocks)
    if with_norm:
        ro = gated_rms_norm(ro, gate, weight, eps).astype(dtype)
    assert o.dtype == ro.dtype and o.shape == ro.shape
    tol = 1e-5 if dtype == jnp.float32 else 5e-4  # bf16: z unrounded in the kernel would give 1.8e-3 here
    assert rel_err(o, ro) < tol and rel_err(s, rs) < tol


def test_fused_decode_bad_low_rank_or_norm_shapes():
    (q, k, v, f_a, f_b, *rest), (gate, weight) = _low_rank_decode_inputs(9, jnp.float32)
    with pytest.raises(ValueError, match="f_b"):
        step_kda_fused(q, k, v, (f_a, f_b[:, :4]), *rest)
    with pytest.raises(ValueError, match="norm gate"):
        step_kda_fused(q, k, v, (f_a, f_b), *rest, norm=GatedNorm(gate, weight[:8], 1e-6, jnp.float32))


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
    # z as (f_a, f_b) and the output norm: XLA around the Mosaic kernels, against the Triton kernel's forms
    (q, k, v, f_a, f_b, *rest), (gate, weight) = _low_rank_decode_inputs(22, jnp.bfloat16, B=1, H=1, K=64, V=64)
    norm = GatedNorm(gate, weight, 1e-6, jnp.bfloat16)
    o3, s3 = step_kda_fused(q, k, v, (f_a, f_b), *rest, norm=norm, blocks=blocks)
    ro3, rs3 = step_kda_fused(q, k, v, (f_a, f_b), *rest, norm=norm)
    assert o3.dtype == jnp.bfloat16 and rel_err(o3, ro3) < TOL and rel_err(s3, rs3) < TOL
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
    large, small = MOSAIC_DECODE_MIN_STATE_BYTES, MOSAIC_DECODE_MIN_STATE_BYTES - 1
    assert resolve_decode_lowering("auto", *dims, large) == expected
    assert resolve_decode_lowering("auto", *dims, small) == ("triton" if expected == "mosaic_gpu" else expected)
    assert resolve_decode_lowering("mosaic_gpu", *dims, small) == "mosaic_gpu"
    assert resolve_lowering("mosaic_tpu", *dims) == "mosaic_tpu"
