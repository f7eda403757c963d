"""The split decode MoE (``pallas_kernels/moe/triton_split.py``: two Triton kernels, interpret mode on CPU) against
every expert on every token combined by the routing weights, float32 on decoded weights; its Triton lowering."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.functional.moe import moe_dense, select_experts, situ
from k3jax.implementation import KernelPolicy, use_implementation
from k3jax.mx import MXTensor
from mx_inputs import bf16_normal, expert_stacks, router_case
from pallas_kernels.moe.triton_split import fused_moe_mx_split, routed_moe_mx_split
from pallas_kernels.mx_matmul import MXBlocks
from reference_numpy import rel_err


@pytest.mark.parametrize("tokens", [1, 3])
def test_split_moe_matches_dense_reference(tokens):
    """The two kernels for a few tokens (F = 96, R = 160: three and five scale
    blocks) against every expert on every token combined by the routing weights, float32 on decoded
    weights."""
    E, F, R, k = 6, 96, 160, 2
    keys = jax.random.split(jax.random.key(20), 5)
    w1, w3, w2 = expert_stacks(keys, E, F, R)
    x = bf16_normal(keys[3], (tokens, R))
    experts = jnp.array([[4, 1], [1, 0], [5, 4]], jnp.int32)[:tokens]  # expert 1 and 4 shared by tokens
    weights = jax.random.uniform(keys[4], (tokens, k))
    out = fused_moe_mx_split(x, w1, w3, w2, weights, experts, situ)
    ref = moe_dense(x, *(w.decode(jnp.float32) for w in (w1, w3, w2)), weights, experts, situ)
    assert out.shape == (tokens, R) and out.dtype == jnp.float32
    assert rel_err(out, ref) < 1e-5
    with pytest.raises(ValueError, match="disagree"):
        fused_moe_mx_split(x, w1, w3, w1, weights, experts, situ)


# Several tiles per program: 2 blocks of 64 hidden units, 2 contracted steps of 128; 16 blocks of 16 output
# rows, each summing its token's 3 pairs in 2 tiles of 64 hidden units.
HIDDEN_TILES = MXBlocks(bm=1, bn=64, bk=128, gemv=True)
TILED_MOE = dict(blocks=HIDDEN_TILES, down_blocks=MXBlocks(bm=1, bn=16, bk=64, gemv=True))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_split_moe_tiles_and_repeated_experts(dtype):
    """Several tiles per program (``TILED_MOE``), 4 tokens, an expert picked twice by one token and
    shared across tokens, against the dense reference; bf16 x gives a bf16 output."""
    E, F, R, k, T = 5, 128, 256, 3, 4
    keys = jax.random.split(jax.random.key(21), 5)
    w1, w3, w2 = expert_stacks(keys, E, F, R)
    x = bf16_normal(keys[3], (T, R)).astype(dtype)
    experts = jnp.array([[2, 2, 0], [4, 1, 2], [0, 3, 1], [3, 3, 3]], jnp.int32)
    weights = jax.random.uniform(keys[4], (T, k))
    out = fused_moe_mx_split(x, w1, w3, w2, weights, experts, situ, **TILED_MOE)
    ref = moe_dense(x.astype(jnp.float32), *(w.decode(jnp.float32) for w in (w1, w3, w2)), weights, experts, situ)
    assert out.shape == (T, R) and out.dtype == dtype
    assert rel_err(out.astype(jnp.float32), ref) < (1e-5 if dtype == jnp.float32 else 1e-2)
    sums = fused_moe_mx_split(x, w1, w3, w2, weights, experts, situ, **TILED_MOE, out_dtype=jnp.float32)
    assert sums.dtype == jnp.float32 and rel_err(sums, ref) < (1e-5 if dtype == jnp.float32 else 1e-2)
    np.testing.assert_array_equal(np.float32(sums.astype(dtype)), np.float32(out))  # the same sums, unrounded


@pytest.mark.parametrize("tiles,tokens", [({}, 1), (TILED_MOE, 4)])
def test_split_moe_h_planar_equals_interleaved(tiles, tokens):
    """The two kernels with h planar between them (``KernelPolicy.split_moe_planar_h_max_tokens``; 8 units of a
    parity a hidden program at the default tiles, 32 over two blocks at the tiled ones) give the interleaved
    form's sums: the same products in the same order, only stored and loaded differently (the row sums'
    reduction order may differ with the tensors' shapes: float32 rounding)."""
    E, F, R, k = 5, 128, 256, 3
    keys = jax.random.split(jax.random.key(22), 5)
    w1, w3, w2 = expert_stacks(keys, E, F, R)
    x = bf16_normal(keys[3], (tokens, R))
    experts = jnp.array([[2, 2, 0], [4, 1, 2], [0, 3, 1], [3, 3, 3]], jnp.int32)[:tokens]
    weights = jax.random.uniform(keys[4], (tokens, k))
    sums = {}
    for planar in (False, True):
        with use_implementation("pallas", policy=KernelPolicy(split_moe_planar_h_max_tokens=tokens if planar else 0)):
            sums[planar] = np.asarray(fused_moe_mx_split(x, w1, w3, w2, weights, experts, situ, **tiles,
                                                         out_dtype=jnp.float32))
    assert rel_err(sums[True], sums[False]) < 1e-6
    ref = moe_dense(x.astype(jnp.float32), *(w.decode(jnp.float32) for w in (w1, w3, w2)), weights, experts, situ)
    assert rel_err(sums[True], ref) < 1e-5


@pytest.mark.parametrize("tokens,planar", [(1, False), (2, False), (1, True)])
def test_split_moe_lowers_for_cuda_through_triton(tokens, planar):
    """Pallas' Triton lowering of the two kernels (x's even / odd columns by strided loads), on the CPU; at one
    token with their one-token down tiles (one output row per program), and with h planar
    (``KernelPolicy.split_moe_planar_h_max_tokens``: the hidden rows by parity, strided)."""
    E, F, R, k = 4, 64, 256, 2
    w1, w2 = MXTensor.quantize(jnp.ones((E, F, R))), MXTensor.quantize(jnp.ones((E, R, F)))
    fn = lambda x, weights, experts: fused_moe_mx_split(x, w1, w1, w2, weights, experts, situ, interpret=False)
    args = [jax.ShapeDtypeStruct((tokens, R), jnp.bfloat16), jax.ShapeDtypeStruct((tokens, k), jnp.float32),
            jax.ShapeDtypeStruct((tokens, k), jnp.int32)]
    with use_implementation("pallas", policy=KernelPolicy(split_moe_planar_h_max_tokens=tokens if planar else 0)):
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "xla.gpu.triton" in text


@pytest.mark.parametrize("tokens", [1, 3])
def test_routed_moe_matches_select_then_dense_reference(tokens):
    """``routed_moe_mx_split`` (the selection in the hidden kernel) against ``select_experts`` and every
    expert on every token combined by its weights, float32 on decoded weights; bad logits raise."""
    E, F, R, k = 12, 64, 96, 3
    keys = jax.random.split(jax.random.key(22), 4)
    w1, w3, w2 = expert_stacks(keys, E, F, R)
    x = bf16_normal(keys[3], (tokens, R))
    logits, bias = router_case(tokens)
    out = routed_moe_mx_split(x, w1, w3, w2, logits, bias, situ, k=k, renormalize=True, scaling_factor=2.5)
    weights, experts = select_experts(logits, bias, k, True, 2.5)
    ref = moe_dense(x, *(w.decode(jnp.float32) for w in (w1, w3, w2)), weights, experts, situ)
    assert out.shape == (tokens, R) and rel_err(out, ref) < 1e-5
    with pytest.raises(ValueError, match="disagree"):
        routed_moe_mx_split(x, w1, w3, w2, logits[:, :8], bias, situ, k=k, renormalize=True, scaling_factor=1.0)


def test_routed_moe_lowers_for_cuda_through_triton():
    """Pallas' Triton lowering of the routed MoE (the [E, E] rank comparison and the pair stores), on the CPU."""
    E, F, R, k = 12, 64, 256, 2
    w1, w2 = MXTensor.quantize(jnp.ones((E, F, R))), MXTensor.quantize(jnp.ones((E, R, F)))
    fn = lambda x, logits, bias: routed_moe_mx_split(x, w1, w1, w2, logits, bias, situ, k=k, renormalize=True,
                                                     scaling_factor=1.0, interpret=False)
    args = [jax.ShapeDtypeStruct((1, R), jnp.bfloat16), jax.ShapeDtypeStruct((1, E), jnp.float32),
            jax.ShapeDtypeStruct((E,), jnp.float32)]
    assert "xla.gpu.triton" in jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
