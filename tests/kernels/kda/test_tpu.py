"""The Mosaic TPU KDA kernels (``pallas_kernels/kda/tpu.py``) against the float32 reference, in Pallas'
TPU interpret mode on CPU, and their Pallas -> Mosaic TPU lowering.

Inputs are bf16-rounded once and both sides see the same rounded values; errors are ||a - b|| / ||b||.

The lowering tests lower for the TPU platform on this CPU-only machine
(``jax.jit(f).trace(...).lower(lowering_platforms=("tpu",))``, no libtpu needed). That runs Pallas' TPU
lowering: the block-shape rules ((8, 128) tiles or whole dims), a lowering rule for every primitive in
the kernel bodies, and the Mosaic module's construction and serialization. It does not run Mosaic's
own passes (layout inference, vector layouts, the TPU compiler), which run in libtpu on a real TPU:
a kernel that lowers here may still be rejected there. Nothing here ran on a TPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from k3jax.functional import kda as ref
from kda_inputs import plain_inputs
from kda_inputs import raw_inputs as kda_raw_inputs
from pallas_kernels.kda import reference, tpu
from reference_numpy import rel_err

TOL = 5e-3
INTERPRET = pltpu.InterpretParams()
_recurrent = jax.jit(ref.recurrent_kda)


inputs = functools.partial(plain_inputs, B=1)
raw_inputs = functools.partial(kda_raw_inputs, B=1)


def gate_params(a_log, dt_bias):
    """(exp(A_log) broadcast to [H, K], dt_bias [H, K]) float32, as the fused kernels read them."""
    return jnp.broadcast_to(jnp.exp(a_log)[:, None], dt_bias.shape), dt_bias


@functools.partial(jax.jit, static_argnames=("chunk", "lower_bound"))
def forward(q, k, v, g, beta, params, h0, *, chunk, lower_bound=0.0):
    """The caller's side of ``tpu.forward``: pad T to whole chunks, drop the padded outputs."""
    T = q.shape[1]
    pad = lambda x: jnp.pad(x, [(0, 0), (0, -T % chunk)] + [(0, 0)] * (x.ndim - 2))
    o, s = tpu.forward(pad(q), pad(k), pad(v), pad(g), pad(beta), params, h0, seq_len=T,
                       scale=q.shape[-1] ** -0.5, lower_bound=lower_bound, chunk=chunk, interpret=INTERPRET)
    return o[:, :T], s


@pytest.mark.parametrize("T,chunk,gate,with_state", [
    (37, 32, "random", True), (50, 32, "floor", False), (100, 64, "floor", True),
    (100, 64, "near_zero", False), (1, 64, "random", True),
])
def test_forward_matches_reference(T, chunk, gate, with_state):
    q, k, v, g, beta, h0 = inputs(T, T=T, gate=gate)
    h0 = h0 if with_state else jnp.zeros_like(h0)
    o, s = forward(q, k, v, g, beta, None, h0, chunk=chunk)
    ro, rs = _recurrent(q, k, v, g, beta, h0)
    assert o.shape == ro.shape and o.dtype == jnp.float32 and s.shape == rs.shape
    assert rel_err(o, ro) < TOL and rel_err(s, rs) < TOL


def test_fused_forward_matches_reference():
    """Raw inputs across two chunks: the kernel's gate, norms and sigmoid against the reference's."""
    q, k, v, z, a_log, dt_bias, beta_logits, h0 = raw_inputs(11, T=50)
    o, s = forward(q, k, v, z, beta_logits, gate_params(a_log, dt_bias), h0, chunk=32, lower_bound=-5.0)
    ro, rs = reference.chunk_kda_fused(q, k, v, z, a_log, dt_bias, beta_logits, -5.0, h0)
    assert rel_err(o, ro) < TOL and rel_err(s, rs) < TOL


@pytest.mark.parametrize("n,cosine", [(64, 0.0), (64, 0.99), (48, 0.99)])
def test_unit_lower_inverse_matches_exact(n, cosine):
    """(I + L)^-1 over a whole chunk by block doubling, for random and nearly parallel unit keys
    (beta = 1); 48 is not a power of two (a last, shorter block)."""
    ks = jax.random.split(jax.random.PRNGKey(21), 2)
    shared, own = jax.random.normal(ks[0], (1, 64)), jax.random.normal(ks[1], (n, 64))
    keys = ref.l2_normalize(cosine * shared + (1 - cosine**2) ** 0.5 * own)
    lower = jnp.tril(keys @ keys.T, -1)
    exact = np.linalg.inv(np.eye(n) + np.asarray(lower, np.float64))
    assert rel_err(jax.jit(tpu._unit_lower_inverse)(lower), exact) < 1e-5


@functools.partial(jax.jit, static_argnames=("lower_bound",))
def decode(q, k, v, g, beta, state, params, lower_bound=0.0):
    return tpu.decode_step(q, k, v, g, beta, state, params, scale=q.shape[-1] ** -0.5,
                           lower_bound=lower_bound, interpret=INTERPRET)


def test_decode_step_matches():
    q, k, v, g, beta, h0 = inputs(3, T=1, H=2 * tpu.DECODE_HEADS, V=32)  # two programs of 8 heads
    q, k, v, g, beta = (x[:, 0] for x in (q, k, v, g, beta))
    o, s = decode(q, k, v, g, beta, h0, None)
    ro, rs = ref.step_kda(q, k, v, g, beta, h0)
    assert rel_err(o, ro) < 1e-5 and rel_err(s, rs) < 1e-5


def test_fused_decode_step_matches():
    """Raw inputs for one token: the kernel's gate, norms and sigmoid against the reference's."""
    q, k, v, z, a_log, dt_bias, beta_logits, h0 = raw_inputs(4, T=1, H=2 * tpu.DECODE_HEADS, V=32)
    q, k, v, z, beta_logits = (x[:, 0] for x in (q, k, v, z, beta_logits))
    o, s = decode(q, k, v, z, beta_logits, h0, gate_params(a_log, dt_bias), lower_bound=-5.0)
    rq, rk, g, beta = reference.fused_inputs(q, k, z, a_log, dt_bias, beta_logits, -5.0)
    ro, rs = ref.step_kda(rq, rk, v, g, beta, h0)
    assert rel_err(o, ro) < 1e-5 and rel_err(s, rs) < 1e-5


def lower_for_tpu(fn, *args):
    """StableHLO text of ``fn`` lowered for the TPU platform (Pallas -> Mosaic TPU; raises if it cannot)."""
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("tpu",)).as_text()


_S = jax.ShapeDtypeStruct
_B, _T, _H, _K, _V = 2, 128, 16, 128, 128  # K = V = 128: the lane width; two decode programs per sequence


@pytest.mark.parametrize("fused", [False, True])
def test_forward_lowers_for_tpu(fused):
    bf, f32 = jnp.bfloat16, jnp.float32
    tokens = [_S((_B, _T, _H, _K), bf), _S((_B, _T, _H, _K), bf), _S((_B, _T, _H, _V), bf),
              _S((_B, _T, _H, _K), f32), _S((_B, _T, _H), f32)]
    params = (_S((_H, _K), f32), _S((_H, _K), f32)) if fused else None
    fn = functools.partial(tpu.forward, seq_len=_T - 5, scale=_K**-0.5, lower_bound=-5.0,
                           chunk=tpu.DEFAULT_CHUNK, interpret=False)
    text = lower_for_tpu(fn, *tokens, params, _S((_B, _H, _K, _V), f32))
    assert "tpu_custom_call" in text and "kda_chunk_tpu" in text


@pytest.mark.parametrize("fused", [False, True])
def test_decode_step_lowers_for_tpu(fused):
    bf, f32 = jnp.bfloat16, jnp.float32
    tokens = [_S((_B, _H, _K), bf), _S((_B, _H, _K), bf), _S((_B, _H, _V), bf), _S((_B, _H, _K), f32),
              _S((_B, _H), f32)]
    params = (_S((_H, _K), f32), _S((_H, _K), f32)) if fused else None
    fn = functools.partial(tpu.decode_step, scale=_K**-0.5, lower_bound=-5.0, interpret=False)
    text = lower_for_tpu(fn, *tokens, _S((_B, _H, _K, _V), f32), params)
    assert "tpu_custom_call" in text and "kda_decode_step_tpu" in text


def test_tpu_lowering_check_rejects_bad_blocks():
    """The check has teeth: a (5, 128) block (not a multiple of 8 sublanes, not the whole dim) fails."""
    def copy_kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...]

    def copy(x):
        spec = pl.BlockSpec((5, 128), lambda i: (i, 0))
        return pl.pallas_call(copy_kernel, grid=(2,), in_specs=[spec], out_specs=spec,
                              out_shape=_S((10, 128), jnp.float32))(x)

    with pytest.raises(ValueError, match="divisible by 8 and 128"):
        lower_for_tpu(copy, _S((10, 128), jnp.float32))
