"""The warp-specialized MXFP4 kernel (``mosaic_gpu_ws.py``): interpret mode on CPU against the float32 reference
(the memory and compute warpgroups as interpreter threads, their full / empty barriers checked by the
interpreter), and Pallas' Mosaic GPU lowering for CUDA on the CPU."""

import jax
import jax.numpy as jnp
import pytest

from k3jax.mx import MXTensor
from pallas_kernels._mosaic_gpu import interpret_params
from pallas_kernels.mx_matmul import mx_matmul_reference
from pallas_kernels.mx_matmul.mosaic_gpu_ws import SpecializedBlocks, mx_matmul_specialized
from reference_numpy import rel_err


# Each case has programs that take several units (so the ring runs across units and the output tiles are
# reused), more steps than slots (slots refilled after the empty barrier), N not a whole number of units
# and K not of bk (padded). The first keeps x in shared memory. In the first the last step's scale window is pushed back inside the scale
# columns (K padded to 1024: 32 columns, window from 16, the step's columns at offset 8); the second has
# scale bytes above 128 (the GPU decode's two-multiply branch).
@pytest.mark.parametrize("blocks,m,n,k,scale_bytes", [
    (SpecializedBlocks(consumers=2, stages=2, bk=256, programs=2, x_resident=True), 13, 600, 800, (110, 135)),
    (SpecializedBlocks(consumers=1, stages=3, bk=128, out_mn=True, programs=2), 1, 300, 544, (100, 141)),
])
def test_specialized_matches_reference(blocks, m, n, k, scale_bytes):
    kc, ks, kx = jax.random.split(jax.random.key(60 + m), 3)
    scales = jax.random.randint(ks, (n, k // 32), *scale_bytes).astype(jnp.uint8)
    w = MXTensor(jax.random.bits(kc, (n, k // 2), jnp.uint8), scales, "mxfp4")
    x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
    out = mx_matmul_specialized(x, w.codes, w.scales, blocks=blocks, interpret=interpret_params())
    assert out.shape == (m, n) and out.dtype == jnp.float32
    assert rel_err(out, mx_matmul_reference(x, w)) < 1e-5


def test_specialized_lowers_for_cuda():
    """The decode shape's kernel (M = 1 and 16) through Pallas' Mosaic GPU lowering for CUDA: setmaxnreg, the
    warpgroups' barriers, inline PTX, wgmma, TMA."""
    for m, blocks in [(1, SpecializedBlocks(out_mn=True, programs=132)),
                      (16, SpecializedBlocks(consumers=4, stages=4, programs=132))]:
        args = [jax.ShapeDtypeStruct(s, d) for s, d in
                [((m, 3584), jnp.bfloat16), ((49152, 1792), jnp.uint8), ((49152, 112), jnp.uint8)]]
        fn = lambda x, c, s, b=blocks: mx_matmul_specialized(x, c, s, blocks=b)
        assert "mosaic_gpu" in jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_specialized_rejects_bad_options():
    for bad in [dict(consumers=5), dict(consumers=0), dict(stages=0), dict(bk=512), dict(programs=0)]:
        with pytest.raises(ValueError):
            SpecializedBlocks(**bad)
    with pytest.raises(ValueError, match="at most 64 rows"):
        mx_matmul_specialized(jnp.zeros((65, 256), jnp.bfloat16), jnp.zeros((64, 128), jnp.uint8),
                              jnp.zeros((64, 8), jnp.uint8))
