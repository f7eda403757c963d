"""The Mosaic TPU MX matmul kernels (``pallas_kernels/mx_matmul/tpu.py``) against the decode-then-dot
references, in Pallas' TPU interpret mode on CPU, and their Pallas -> Mosaic TPU lowering.

As in ``tests/kernels/kda/test_tpu.py``, lowering for the TPU platform on this CPU-only machine runs Pallas' TPU
lowering (block-shape rules, a rule for every primitive, the Mosaic module built and serialized) but
not Mosaic's own passes and compiler, which run in libtpu on a TPU. Nothing here ran on a TPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.mx import MXTensor, fp4_e2m1_to_float, quantize_compiled
from pallas_kernels.mx_matmul import (
    MXBlocks,
    grouped_mx_matmul,
    grouped_mx_matmul_reference,
    mx_matmul,
    mx_matmul_reference,
)
from pallas_kernels.mx_matmul import tpu
from reference_numpy import rel_err

# Small tiles: several M tiles, two N tiles (grouped), two K steps at K = 512.
SMALL = tpu.TPUBlocks(bm=32, bn=128, bk=256)
N, K = 96, 512  # N padded to 128
matmul = functools.partial(mx_matmul, blocks=SMALL, lowering="mosaic_tpu")
grouped = functools.partial(grouped_mx_matmul, blocks=SMALL, lowering="mosaic_tpu")


def bf16_normal(key, shape):
    """Random activations that bf16 holds exactly (the kernels feed bf16 to the MXU)."""
    return jax.random.normal(key, shape, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32)


def quantized(key, shape, format="mxfp4", scale=0.05):
    return quantize_compiled(jax.random.normal(key, shape) * scale, format)


@pytest.fixture(scope="module")
def weight():
    return quantized(jax.random.key(1), (N, K))


def test_e2m1_and_e4m3_decodes_are_exact():
    """Every E2M1 code and every E4M3 byte, bit for bit (NaN where float8_e4m3fn has NaN)."""
    codes = jnp.arange(16, dtype=jnp.int32)
    e2m1 = np.asarray(jax.jit(tpu._e2m1)(codes))
    np.testing.assert_array_equal(e2m1, np.asarray(fp4_e2m1_to_float(codes)))
    assert np.signbit(e2m1)[8:].all()  # code 8 is -0
    fp8 = np.arange(256, dtype=np.uint8).view(jnp.float8_e4m3fn).astype(np.float32)
    ours = np.asarray(jax.jit(tpu._e4m3)(jnp.arange(256, dtype=jnp.int32)))
    np.testing.assert_array_equal(ours.view(np.uint32)[~np.isnan(fp8)], fp8.view(np.uint32)[~np.isnan(fp8)])
    np.testing.assert_array_equal(np.isnan(ours), np.isnan(fp8))


@pytest.mark.parametrize("m,k", [(1, K), (7, 160), (100, K)])  # K = 160: one whole-K step (not a multiple of 256)
def test_dense_matches_reference(weight, m, k):
    w = weight if k == K else quantized(jax.random.key(k), (N, k))
    x = bf16_normal(jax.random.key(m), (m, k))
    out = matmul(x, w)
    assert out.shape == (m, N) and out.dtype == jnp.float32
    assert rel_err(out, mx_matmul_reference(x, w)) < 1e-5


def test_dense_w4a8_equals_quantize_then_reference(weight):
    x = jax.random.normal(jax.random.key(4), (7, K)) * 3.0
    xq = quantize_compiled(x, "mxfp8")
    out = matmul(xq, weight, out_dtype=jnp.float32)
    assert rel_err(out, mx_matmul_reference(xq, weight)) < 1e-5
    assert rel_err(out, mx_matmul_reference(x, weight)) < 0.1  # MXFP8 activations stay close


G, GN, M = 6, 256, 50  # two N tiles; two 32-row tiles


@pytest.fixture(scope="module")
def experts():
    return quantized(jax.random.key(11), (G, GN, K))


# Empty experts between and after; tile 0 shared by four groups; all rows routed; nothing routed.
@pytest.mark.parametrize("sizes", [[7, 0, 20, 0, 1, 15], [0, 33, 0, 0, 17, 0], [0] * G])
def test_grouped_matches_ragged_reference(experts, sizes):
    group_sizes = jnp.array(sizes, jnp.int32)
    x = bf16_normal(jax.random.key(7), (M, K))
    out = grouped(x, experts, group_sizes)
    assert out.shape == (M, GN)
    routed = sum(sizes)
    assert not np.asarray(out[routed:]).any()  # unrouted rows are zero
    if routed:
        assert rel_err(out, grouped_mx_matmul_reference(x, experts, group_sizes)) < 1e-5
    w = np.asarray(experts.decode(jnp.float32), np.float64)
    for g, (start, size) in enumerate(zip(np.cumsum(sizes) - sizes, sizes)):
        if size:  # each group's rows multiply its own expert
            rows = slice(int(start), int(start + size))
            assert rel_err(out[rows], np.asarray(x[rows], np.float64) @ w[g].T) < 1e-5


def test_grouped_w4a8_equals_quantize_then_reference(experts):
    group_sizes = jnp.array([7, 0, 20, 0, 1, 15], jnp.int32)
    xq = quantized(jax.random.key(8), (M, K), "mxfp8", scale=1.0)
    out = grouped(xq, experts, group_sizes, out_dtype=jnp.float32)
    assert rel_err(out, grouped_mx_matmul_reference(xq, experts, group_sizes)) < 1e-5


def test_lowering_choice_and_errors(weight):
    x = jnp.ones((4, K))
    with pytest.raises(ValueError, match="lowering 'mosaic'"):
        mx_matmul(x, weight, lowering="mosaic")
    with pytest.raises(ValueError, match="take TPUBlocks"):
        mx_matmul(x, weight, blocks=MXBlocks(), lowering="mosaic_tpu")
    with pytest.raises(ValueError, match="bn % 128"):
        tpu.TPUBlocks(bn=64)


def lower_for_tpu(fn, *args):
    """StableHLO text of ``fn`` lowered for the TPU platform (Pallas -> Mosaic TPU; raises if it cannot)."""
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("tpu",)).as_text()


_S = jax.ShapeDtypeStruct
_M, _N, _K, _G = 64, 512, 3584, 4  # K3's latent width: K / 32 = 112 scale blocks, K steps of 512


def _activations(w4a8: bool):
    if w4a8:
        return MXTensor(_S((_M, _K), jnp.float8_e4m3fn), _S((_M, _K // 32), jnp.uint8), "mxfp8")
    return _S((_M, _K), jnp.bfloat16)


def _weights(*lead):
    return MXTensor(_S((*lead, _N, _K // 2), jnp.uint8), _S((*lead, _N, _K // 32), jnp.uint8))


@pytest.mark.parametrize("w4a8", [False, True])
def test_dense_lowers_for_tpu(w4a8):
    text = lower_for_tpu(functools.partial(tpu.mx_matmul, interpret=False), _activations(w4a8), _weights())
    assert "tpu_custom_call" in text and "mx_matmul" in text


@pytest.mark.parametrize("w4a8", [False, True])
def test_grouped_lowers_for_tpu(w4a8):
    fn = functools.partial(tpu.grouped_mx_matmul, interpret=False)
    text = lower_for_tpu(fn, _activations(w4a8), _weights(_G), _S((_G,), jnp.int32))
    assert "tpu_custom_call" in text and "grouped_mx_matmul" in text
