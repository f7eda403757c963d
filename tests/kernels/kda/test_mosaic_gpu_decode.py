"""The Mosaic GPU KDA decode step (pallas_kernels/kda/mosaic_gpu_decode.py), on the CPU only.

1. Mosaic GPU's interpret mode against the float32 reference step (``k3jax.functional.kda.step_kda``):
   plain inputs with random gates, gates at the floor -5 and near zero, and the fused raw inputs
   (norms, bounded gate, beta sigmoid in the kernel). K = 64, V = 128 in four 32-column blocks: 24
   tiles over 7 programs (4, 4, 4, 3, 3, 3, 3 tiles each), with 2, 3 and 6 shared-memory slots (6: more
   slots than a program has tiles). The interpreted kernel writes a new state buffer whose unwritten
   elements would be NaN.
2. Lowering for CUDA without a GPU (``lowering_platforms=("cuda",)``) at K = V = 128, plain and fused:
   Pallas' Mosaic GPU lowering of every primitive (register layouts of the state block and its
   row and column vectors, the reductions, TMA copy sizes and swizzles, the shared-memory total)
   into the Mosaic GPU custom call. ptxas and the GPU run are not covered.

Errors are ||a - b|| / ||b||. One jit per configuration.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.functional import kda as ref
from kda_inputs import plain_inputs, raw_inputs
from pallas_kernels.kda import mosaic_gpu, mosaic_gpu_decode, reference
from pallas_kernels.kda.ops import _gate_params
from reference_numpy import rel_err

TOL = 1e-5  # float32 throughout
B, H, K, V = 2, 3, 64, 128
BLOCK_V, PROGRAMS = 32, 7
LOWER = -5.0


@functools.partial(jax.jit, static_argnames=("slots", "lower_bound"))
def _step(q, k, v, g, beta, state, gate_params, slots, lower_bound=0.0):
    return mosaic_gpu_decode.decode_step(q, k, v, g, beta, state, gate_params, scale=K**-0.5,
                                         lower_bound=lower_bound, block_v=BLOCK_V, slots=slots,
                                         num_programs=PROGRAMS, interpret=mosaic_gpu.interpret_params())


def _check(out, expected):
    (o, s), (ro, rs) = out, expected
    assert o.shape == ro.shape and s.shape == rs.shape and o.dtype == s.dtype == jnp.float32
    assert np.isfinite(np.asarray(o)).all() and np.isfinite(np.asarray(s)).all()
    assert rel_err(o, ro) < TOL and rel_err(s, rs) < TOL, (rel_err(o, ro), rel_err(s, rs))


@pytest.mark.parametrize("gate,slots", [("random", 2), ("floor", 3), ("near_zero", 6)])
def test_plain_matches_reference(gate, slots):
    q, k, v, g, beta, state = plain_inputs(slots, B=B, T=1, H=H, K=K, V=V, gate=gate)
    q, k, v, g, beta = (x[:, 0] for x in (q, k, v, g, beta))
    _check(_step(q, k, v, g, beta, state, None, slots), ref.step_kda(q, k, v, g, beta, state))


def test_fused_matches_reference():
    """Raw q, k, z and beta logits (bf16): the L2 norms, K3's bounded gate and the sigmoid in the kernel."""
    q, k, v, z, a_log, dt_bias, beta_logits, state = raw_inputs(11, B=B, T=1, H=H, K=K, V=V)
    q, k, v, z, beta_logits = (x[:, 0] for x in (q, k, v, z, beta_logits))
    out = _step(q, k, v, z, beta_logits, state, _gate_params(a_log, dt_bias, K), 3, lower_bound=LOWER)
    rq, rk, rg, rbeta = reference.fused_inputs(q, k, z, a_log, dt_bias, beta_logits, LOWER)
    _check(out, ref.step_kda(rq, rk, v, rg, rbeta, state))


def test_rejects_block_not_dividing_v():
    q, k, v, g, beta, state = plain_inputs(0, B=1, T=1, H=1, K=K, V=V)
    with pytest.raises(ValueError, match="block_v"):
        mosaic_gpu_decode.decode_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state, scale=1.0,
                                      block_v=96)


@pytest.mark.parametrize("fused", [False, True])
def test_lowers_for_cuda(fused):
    """K3's head (K = V = 128) through Pallas' Mosaic GPU lowering for CUDA, on the CPU."""
    b, h, k, v = 2, 4, 128, 128
    shape = lambda *s, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(s, dtype)
    raw = jnp.bfloat16 if fused else jnp.float32  # z and beta logits bf16; g and beta float32
    gate_params = (shape(h, k, dtype=jnp.float32),) * 2 if fused else None
    args = [shape(b, h, k), shape(b, h, k), shape(b, h, v), shape(b, h, k, dtype=raw), shape(b, h, dtype=raw),
            shape(b, h, k, v, dtype=jnp.float32), gate_params]
    kernel = lambda *a: mosaic_gpu_decode.decode_step(*a, scale=k**-0.5, lower_bound=LOWER, num_programs=5)
    lowered = jax.jit(kernel).trace(*args).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()
