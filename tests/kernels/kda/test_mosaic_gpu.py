"""The Mosaic GPU KDA forward (pallas_kernels/kda/mosaic_gpu.py) in Mosaic GPU's interpret mode on CPU,
against the float32 reference.

Inputs are bf16-rounded once and both sides see the same rounded values; errors are ||a - b|| / ||b||.
K = V = 64: the smallest head that the kernel's wgmma tiling takes. One jit per sequence length.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

from k3jax.functional import kda as ref
from kda_inputs import plain_inputs, raw_inputs
from pallas_kernels.kda import mosaic_gpu, reference
from pallas_kernels.kda.ops import _gate_params
from reference_numpy import rel_err

TOL = 5e-3
B, H, K, V = 1, 2, 64, 64
LOWER = -5.0


def _padded(arrays):
    pad = -arrays[0].shape[1] % mosaic_gpu.CHUNK
    return [jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2)) for a in arrays]


@functools.partial(jax.jit, static_argnames=("lower_bound",))
def _forward(q, k, v, g, beta, gate_params, h0, lower_bound=0.0):
    T = q.shape[1]
    o, state = mosaic_gpu.forward(*_padded([q, k, v, g, beta]), gate_params, h0, seq_len=T, scale=K**-0.5,
                                  lower_bound=lower_bound, interpret=mosaic_gpu.interpret_params())
    return o[:, :T], state


def _plain_inputs(seed, T, gate):
    return plain_inputs(seed, B=B, T=T, H=H, K=K, V=V, gate=gate)


@pytest.mark.parametrize("T,gate,with_state", [(45, "random", True), (50, "floor", False), (37, "near_zero", True)])
def test_plain_matches_reference(T, gate, with_state):
    q, k, v, g, beta, h0 = _plain_inputs(T, T, gate)
    h0 = h0 if with_state else jnp.zeros_like(h0)
    o, s = _forward(q, k, v, g, beta, None, h0)
    ro, rs = ref.recurrent_kda(q, k, v, g, beta, h0)
    assert o.shape == ro.shape and o.dtype == jnp.float32 and s.dtype == jnp.float32
    assert rel_err(o, ro) < TOL and rel_err(s, rs) < TOL


def test_fused_matches_reference():
    """Raw q, k, z and beta logits: the gate, the L2 norms and the sigmoid inside the intra kernel."""
    q, k, v, z, a_log, dt_bias, beta_logits, h0 = raw_inputs(11, B=B, T=45, H=H, K=K, V=V)
    gate_params = _gate_params(a_log, dt_bias, K)
    o, s = _forward(q, k, v, z, beta_logits, gate_params, h0, lower_bound=LOWER)
    ro, rs = reference.chunk_kda_fused(q, k, v, z, a_log, dt_bias, beta_logits, LOWER, h0)
    assert rel_err(o, ro) < TOL and rel_err(s, rs) < TOL
