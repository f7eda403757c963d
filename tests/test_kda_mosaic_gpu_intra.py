"""The Mosaic GPU intra-chunk kernel (pallas_kernels/kda/mosaic_gpu_intra.py), on the CPU only.

1. Mosaic GPU's interpret mode: each of its six outputs against ``kernel.intra_chunk`` at chunk 32 in
   Pallas' (Triton) interpret mode on the same bf16-rounded inputs, and the whole Mosaic GPU forward
   (this kernel, then ``mosaic_gpu.state_walk``) against the float32 ``recurrent_kda``; plain inputs
   with random gates, gates at the floor -5 and near zero, and fused raw inputs; T not a multiple of
   32, padded as ``ops._pad_tokens`` does. K = V = 64, the smallest head the wgmma tiling takes.
2. Lowering for CUDA without a GPU (``lowering_platforms=("cuda",)``) at K = V = 128 and 64, plain
   and fused: Pallas' Mosaic GPU lowering of every primitive (register layouts, swizzles and tilings
   of the wgmma operands and shared-memory tiles, TMA copy sizes, the shared-memory total) into the
   Mosaic GPU custom call. ptxas and the GPU run are not covered.

Errors are ||a - b|| / ||b||. One jit per configuration (both kernels and the walk in one).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

from k3jax.functional import kda as ref
from kda_inputs import plain_inputs, raw_inputs
from pallas_kernels.kda import mosaic_gpu, mosaic_gpu_intra, reference
from pallas_kernels.kda.kernel import KDABlocks, intra_chunk
from pallas_kernels.kda.ops import _gate_params
from reference_numpy import rel_err

TOL = 5e-3  # the whole forward against the float32 reference
TOL_BF16 = 4e-3  # a bf16 output against the Triton kernel's (bf16 rounding, 2^-9 per value at most)
TOL_F32 = 2e-5  # exp(G_C), float32
B, H, K, V = 1, 2, 64, 64
T = 45  # padded to 64: two chunks, the second one part padding
LOWER = -5.0
OUTPUTS = ("w", "u", "qg", "kg", "aqk", "gend")


def _padded(arrays):
    pad = -arrays[0].shape[1] % mosaic_gpu.CHUNK
    return [jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2)) for a in arrays]


@functools.partial(jax.jit, static_argnames=("lower_bound",))
def _run(q, k, v, g, beta, gate_params, h0, lower_bound=0.0):
    """(Mosaic GPU intra outputs, Triton intra outputs, forward o, forward final state)."""
    kw = dict(seq_len=q.shape[1], scale=K**-0.5, lower_bound=lower_bound)
    padded = _padded([q, k, v, g, beta])
    interpret = mosaic_gpu.interpret_params()
    mine = mosaic_gpu_intra.intra_chunk(*padded, gate_params, interpret=interpret, **kw)
    triton = intra_chunk(*padded, gate_params, blocks=KDABlocks(chunk=mosaic_gpu.CHUNK), **kw)
    o, state = mosaic_gpu.state_walk(*mine, h0, interpret=interpret)
    return mine, triton, o[:, : q.shape[1]], state


def _check_intra(mine, triton):
    for name, a, b in zip(OUTPUTS, mine, triton):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert rel_err(a, b) < (TOL_F32 if name == "gend" else TOL_BF16), (name, rel_err(a, b))


@pytest.mark.parametrize("gate", ["random", "floor", "near_zero"])
def test_plain_matches_triton_and_reference(gate):
    q, k, v, g, beta, h0 = plain_inputs(3, B=B, T=T, H=H, K=K, V=V, gate=gate)
    mine, triton, o, s = _run(q, k, v, g, beta, None, h0)
    _check_intra(mine, triton)
    ro, rs = ref.recurrent_kda(q, k, v, g, beta, h0)
    assert rel_err(o, ro) < TOL and rel_err(s, rs) < TOL


def test_fused_matches_triton_and_reference():
    """Raw q, k, z and beta logits: the gate, the L2 norms and the sigmoid inside the kernel."""
    q, k, v, z, a_log, dt_bias, beta_logits, h0 = raw_inputs(11, B=B, T=T, H=H, K=K, V=V)
    gate_params = _gate_params(a_log, dt_bias, K)
    mine, triton, o, s = _run(q, k, v, z, beta_logits, gate_params, h0, lower_bound=LOWER)
    _check_intra(mine, triton)
    rq, rk, rg, rbeta = reference.fused_inputs(q, k, z, a_log, dt_bias, beta_logits, LOWER)
    ro, rs = ref.recurrent_kda(rq, rk, v, rg, rbeta, h0)
    assert rel_err(o, ro) < TOL and rel_err(s, rs) < TOL


@pytest.mark.parametrize("head", [128, 64])
@pytest.mark.parametrize("fused", [False, True])
def test_lowers_for_cuda(fused, head):
    """The kernel at K = V = ``head`` through Pallas' Mosaic GPU lowering for CUDA, on the CPU."""
    b, t, h, k, v = 1, 64, 2, head, head
    shape = lambda *s, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(s, dtype)
    raw = jnp.bfloat16 if fused else jnp.float32  # z and beta logits bf16; g and beta float32
    gate_params = (shape(h, k, dtype=jnp.float32),) * 2 if fused else None
    args = [shape(b, t, h, k), shape(b, t, h, k), shape(b, t, h, v), shape(b, t, h, k, dtype=raw),
            shape(b, t, h, dtype=raw), gate_params]
    kernel = lambda *a: mosaic_gpu_intra.intra_chunk(*a, seq_len=50, scale=k**-0.5, lower_bound=LOWER,
                                                     interpret=False)
    lowered = jax.jit(kernel).trace(*args).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()
