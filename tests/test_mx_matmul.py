"""Pallas MX matmul kernels (interpret mode on CPU) against the decode-then-dot references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.mx import MXTensor
from k3jax.functional.moe import grouped_matmul, moe_dense, moe_sorted, situ
from pallas_kernels.mx_matmul import (
    MXBlocks,
    fused_moe_mx,
    fused_moe_mx_split,
    grouped_mx_matmul,
    grouped_mx_matmul_reference,
    mx_matmul,
    mx_matmul_reference,
    tiled_moe_mx,
)
from pallas_kernels.mx_matmul.triton import decode_mxfp4_pallas
from pallas_kernels.mx_matmul.ops import _kernel_weight_layout
from reference_numpy import rel_err

# Small tiles so that every kernel loops over several row, column and contracted tiles.
SMALL = MXBlocks(bm=16, bn=32, bk=64)  # PTX decode (its jnp emulation here), x . w^T
SMALL_LHS = MXBlocks(bm=16, bn=32, bk=64, weights_lhs=True)  # (w . x^T)^T
SMALL_ARITH = MXBlocks(bm=16, bn=32, bk=64, weights_lhs=True, decode="arith")
DECODE_THEN_DOT = MXBlocks(bn=32, bk=64, decode_then_dot=True)
GEMV = MXBlocks(bm=1, bn=32, bk=64, gemv=True)  # one row per program, no dot
GEMV_ARITH = MXBlocks(bm=1, bn=32, bk=64, gemv=True, decode="arith")
N, K = 96, 160  # K = 5 scale blocks: not a power of two, not a multiple of bk


def bf16_normal(key, shape):
    """Random activations that bf16 holds exactly (the kernels feed bf16 to the matrix units)."""
    return jax.random.normal(key, shape, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32)


@pytest.fixture(scope="module")
def weight():
    return MXTensor.quantize(jax.random.normal(jax.random.key(10), (N, K)) * 0.05)


@pytest.mark.parametrize("m", [1, 7, 100])
def test_mx_matmul_matches_reference(weight, m):
    x = bf16_normal(jax.random.key(m), (m, K))
    out = mx_matmul(x, weight, blocks=SMALL)
    assert out.shape == (m, N) and out.dtype == jnp.float32
    assert rel_err(out, mx_matmul_reference(x, weight)) < 1e-5


@pytest.mark.parametrize("blocks,m", [(SMALL_LHS, 1), (SMALL_LHS, 100), (SMALL_ARITH, 7), (DECODE_THEN_DOT, 7)])
def test_mx_matmul_paths_match_reference(weight, blocks, m):
    x = bf16_normal(jax.random.key(20 + m), (m, K))
    assert rel_err(mx_matmul(x, weight, blocks=blocks), mx_matmul_reference(x, weight)) < 1e-5


@pytest.mark.parametrize("blocks,m", [(GEMV, 1), (GEMV, 7), (GEMV_ARITH, 1)])
def test_mx_matmul_gemv_matches_reference(weight, blocks, m):
    x = bf16_normal(jax.random.key(30 + m), (m, K))
    out = mx_matmul(x, weight, blocks=blocks)
    assert out.shape == (m, N)
    assert rel_err(out, mx_matmul_reference(x, weight)) < 1e-5


def test_gemv_needs_one_row_blocks(weight):
    for bad in [dict(bm=16), dict(bm=1, weights_lhs=True), dict(bm=1, decode_then_dot=True)]:
        with pytest.raises(ValueError, match="gemv needs bm == 1"):
            MXBlocks(gemv=True, **bad)


@pytest.mark.parametrize("decode", ["ptx", "arith"])
def test_decode_kernel_bit_exact(decode):
    """Every code byte, scale bytes 1..254 (random): the Pallas decode equals XLA's, bit for bit."""
    n, k = 32, 256
    codes = jax.random.bits(jax.random.key(12), (n, k // 2), jnp.uint8).at[0].set(jnp.arange(128, dtype=jnp.uint8))
    codes = codes.at[1].set(jnp.arange(128, 256).astype(jnp.uint8))
    scales = jax.random.randint(jax.random.key(13), (n, k // 32), 1, 255).astype(jnp.uint8)
    w = MXTensor(codes, scales, "mxfp4")
    out = decode_mxfp4_pallas(*_kernel_weight_layout(w, n), blocks=MXBlocks(bn=16, bk=64, decode=decode),
                              interpret=True)
    ref = w.decode(jnp.bfloat16)
    planar = np.asarray(out).view(np.uint16)
    np.testing.assert_array_equal(planar[:, 0], np.asarray(ref[:, 0::2]).view(np.uint16))
    np.testing.assert_array_equal(planar[:, 1], np.asarray(ref[:, 1::2]).view(np.uint16))


@pytest.mark.parametrize("m", [1, 7])  # M = 1 defaults to the one-row kernel, 7 to the dot path
def test_mx_matmul_bf16_input_default_blocks(weight, m):
    x = bf16_normal(jax.random.key(3), (m, K)).astype(jnp.bfloat16)
    out = mx_matmul(x, weight)
    assert out.dtype == jnp.bfloat16
    assert rel_err(out, mx_matmul_reference(x, weight)) < 1e-2  # bf16 output rounding


@pytest.mark.parametrize("blocks", [SMALL, GEMV])
def test_mx_matmul_w4a8_equals_quantize_then_reference(weight, blocks):
    x = jax.random.normal(jax.random.key(4), (7, K)) * 3.0
    xq = MXTensor.quantize(x, "mxfp8")
    out = mx_matmul(xq, weight, blocks=blocks, out_dtype=jnp.float32)
    assert rel_err(out, mx_matmul_reference(xq, weight)) < 1e-5
    assert rel_err(out, mx_matmul_reference(x, weight)) < 0.1  # MXFP8 activations stay close


def test_awkward_n_is_padded():
    w = MXTensor.quantize(jax.random.normal(jax.random.key(5), (40, 96)))  # 40 = 16 * 2.5
    x = bf16_normal(jax.random.key(6), (7, 96))
    assert rel_err(mx_matmul(x, w, blocks=SMALL), mx_matmul_reference(x, w)) < 1e-5


G = 6
GROUP_SIZES = jnp.array([7, 0, 20, 0, 1, 15], jnp.int32)  # empty experts; sums to 43 < M = 50


@pytest.fixture(scope="module")
def experts():
    return MXTensor.quantize(jax.random.normal(jax.random.key(11), (G, N, K)) * 0.05)


@pytest.mark.parametrize("blocks", [SMALL, SMALL_LHS, GEMV])
def test_grouped_matches_ragged_reference(experts, blocks):
    m = 50
    x = bf16_normal(jax.random.key(7), (m, K))
    out = grouped_mx_matmul(x, experts, GROUP_SIZES, blocks=blocks)
    ref = grouped_mx_matmul_reference(x, experts, GROUP_SIZES)
    assert out.shape == (m, N)
    assert rel_err(out, ref) < 1e-5
    assert not np.asarray(out[43:]).any()  # rows past sum(group_sizes) are zero
    for g, (start, size) in enumerate(zip(np.cumsum(GROUP_SIZES) - GROUP_SIZES, GROUP_SIZES)):
        if size:  # each group's rows multiply its own expert
            rows = slice(int(start), int(start + size))
            assert rel_err(out[rows], mx_matmul_reference(x[rows], experts_at(experts, g))) < 1e-5


def experts_at(w: MXTensor, g: int) -> MXTensor:
    return jax.tree_util.tree_map(lambda a: a[g], w)


@pytest.mark.parametrize("blocks", [SMALL, GEMV])
def test_grouped_w4a8_equals_quantize_then_reference(experts, blocks):
    xq = MXTensor.quantize(jax.random.normal(jax.random.key(8), (50, K)), "mxfp8")
    out = grouped_mx_matmul(xq, experts, GROUP_SIZES, blocks=blocks, out_dtype=jnp.float32)
    assert rel_err(out, grouped_mx_matmul_reference(xq, experts, GROUP_SIZES)) < 1e-5


def test_grouped_group_spanning_tiles_with_default_blocks(experts):
    sizes = jnp.array([0, 33, 0, 0, 2, 0], jnp.int32)  # one group over three 16-row tiles
    x = bf16_normal(jax.random.key(9), (35, K))
    out = grouped_mx_matmul(x, experts, sizes)
    assert rel_err(out, grouped_mx_matmul_reference(x, experts, sizes)) < 1e-5


def test_shape_errors(weight, experts):
    with pytest.raises(ValueError, match="disagree on K"):
        mx_matmul(jnp.ones((4, 64)), weight)
    with pytest.raises(ValueError, match="rank 3"):
        grouped_mx_matmul(jnp.ones((4, K)), weight, GROUP_SIZES)
    with pytest.raises(ValueError, match=r"group_sizes must be \[G\]"):
        grouped_mx_matmul(jnp.ones((4, K)), experts, GROUP_SIZES[:3])
    with pytest.raises(ValueError, match="dense only"):
        grouped_mx_matmul(jnp.ones((4, K)), experts, GROUP_SIZES, blocks=DECODE_THEN_DOT)


def _expert_stacks(keys, E: int, F: int, R: int) -> tuple[MXTensor, MXTensor, MXTensor]:
    """Random MXFP4 expert stacks w1, w3 [E, F, R] and w2 [E, R, F] from keys[0..2], scaled by fan-in."""
    w1, w3 = (MXTensor.quantize(jax.random.normal(kk, (E, F, R)) * R**-0.5) for kk in keys[:2])
    return w1, w3, MXTensor.quantize(jax.random.normal(keys[2], (E, R, F)) * F**-0.5)


@pytest.mark.parametrize("fused", [fused_moe_mx, fused_moe_mx_split])
@pytest.mark.parametrize("tokens", [1, 3])
def test_fused_moe_matches_dense_reference(fused, tokens):
    """The fused MoE (one kernel, or two) for a few tokens (F = 96, R = 160: three and five scale
    blocks) against every expert on every token combined by the routing weights, float32 on decoded
    weights."""
    E, F, R, k = 6, 96, 160, 2
    keys = jax.random.split(jax.random.key(20), 5)
    w1, w3, w2 = _expert_stacks(keys, E, F, R)
    x = bf16_normal(keys[3], (tokens, R))
    experts = jnp.array([[4, 1], [1, 0], [5, 4]], jnp.int32)[:tokens]  # expert 1 and 4 shared by tokens
    weights = jax.random.uniform(keys[4], (tokens, k))
    out = fused(x, w1, w3, w2, weights, experts, situ)
    ref = moe_dense(x, *(w.decode(jnp.float32) for w in (w1, w3, w2)), weights, experts, situ)
    assert out.shape == (tokens, R) and out.dtype == jnp.float32
    assert rel_err(out, ref) < 1e-5
    with pytest.raises(ValueError, match="disagree"):
        fused(x, w1, w3, w1, weights, experts, situ)


# Several tiles per program. Both forms: 2 blocks of 64 hidden units, 2 contracted steps of 128. One kernel:
# 16 atomic adds of 16 output rows each; two kernels: 16 blocks of 16 output rows, each summing its token's
# 3 pairs in 2 tiles of 64 hidden units.
HIDDEN_TILES = MXBlocks(bm=1, bn=64, bk=128, gemv=True)
TILED_MOE = {
    fused_moe_mx: dict(blocks=HIDDEN_TILES, down_rows=16),
    fused_moe_mx_split: dict(blocks=HIDDEN_TILES, down_blocks=MXBlocks(bm=1, bn=16, bk=64, gemv=True)),
}


@pytest.mark.parametrize("fused", list(TILED_MOE))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fused_moe_tiles_and_repeated_experts(fused, dtype):
    """Several tiles per program (``TILED_MOE``), 4 tokens, an expert picked twice by one token and
    shared across tokens, against the dense reference; bf16 x gives a bf16 output."""
    E, F, R, k, T = 5, 128, 256, 3, 4
    keys = jax.random.split(jax.random.key(21), 5)
    w1, w3, w2 = _expert_stacks(keys, E, F, R)
    x = bf16_normal(keys[3], (T, R)).astype(dtype)
    experts = jnp.array([[2, 2, 0], [4, 1, 2], [0, 3, 1], [3, 3, 3]], jnp.int32)
    weights = jax.random.uniform(keys[4], (T, k))
    out = fused(x, w1, w3, w2, weights, experts, situ, **TILED_MOE[fused])
    ref = moe_dense(x.astype(jnp.float32), *(w.decode(jnp.float32) for w in (w1, w3, w2)), weights, experts, situ)
    assert out.shape == (T, R) and out.dtype == dtype
    assert rel_err(out.astype(jnp.float32), ref) < (1e-5 if dtype == jnp.float32 else 1e-2)
    sums = fused(x, w1, w3, w2, weights, experts, situ, **TILED_MOE[fused], out_dtype=jnp.float32)
    assert sums.dtype == jnp.float32 and rel_err(sums, ref) < (1e-5 if dtype == jnp.float32 else 1e-2)
    np.testing.assert_array_equal(np.float32(sums.astype(dtype)), np.float32(out))  # the same sums, unrounded


@pytest.mark.parametrize("tiles,tokens", [({}, 1), (TILED_MOE[fused_moe_mx_split], 4)])
def test_split_moe_h_planar_equals_interleaved(monkeypatch, tiles, tokens):
    """The two kernels with h planar between them (``PLANAR_H_MAX_TOKENS``; 8 units of a parity a hidden program at the
    default tiles, 32 over two blocks at the tiled ones) give the interleaved form's sums: the same products
    in the same order, only stored and loaded differently (the row sums' reduction order may differ with
    the tensors' shapes: float32 rounding)."""
    from pallas_kernels.mx_matmul import moe_split

    E, F, R, k = 5, 128, 256, 3
    keys = jax.random.split(jax.random.key(22), 5)
    w1, w3, w2 = _expert_stacks(keys, E, F, R)
    x = bf16_normal(keys[3], (tokens, R))
    experts = jnp.array([[2, 2, 0], [4, 1, 2], [0, 3, 1], [3, 3, 3]], jnp.int32)[:tokens]
    weights = jax.random.uniform(keys[4], (tokens, k))
    sums = {}
    for planar in (False, True):
        monkeypatch.setattr(moe_split, "PLANAR_H_MAX_TOKENS", tokens if planar else 0)
        sums[planar] = np.asarray(fused_moe_mx_split(x, w1, w3, w2, weights, experts, situ, **tiles,
                                                     out_dtype=jnp.float32))
    assert rel_err(sums[True], sums[False]) < 1e-6
    ref = moe_dense(x.astype(jnp.float32), *(w.decode(jnp.float32) for w in (w1, w3, w2)), weights, experts, situ)
    assert rel_err(sums[True], ref) < 1e-5


@pytest.mark.parametrize("fused,tokens,planar", [(fused_moe_mx, 2, False), (fused_moe_mx_split, 1, False),
                                                 (fused_moe_mx_split, 2, False), (fused_moe_mx_split, 1, True)])
def test_fused_moe_lowers_for_cuda_through_triton(monkeypatch, fused, tokens, planar):
    """Pallas' Triton lowering of the fused MoE (x's even / odd columns by strided loads), on the CPU; the
    two kernels at one token with their one-token down tiles (one output row per program), and with h
    planar (``PLANAR_H_MAX_TOKENS``: the hidden rows by parity, strided)."""
    from pallas_kernels.mx_matmul import moe_split

    monkeypatch.setattr(moe_split, "PLANAR_H_MAX_TOKENS", tokens if planar else 0)
    E, F, R, k = 4, 64, 256, 2
    w1, w2 = MXTensor.quantize(jnp.ones((E, F, R))), MXTensor.quantize(jnp.ones((E, R, F)))
    fn = lambda x, weights, experts: fused(x, w1, w1, w2, weights, experts, situ, interpret=False)
    args = [jax.ShapeDtypeStruct((tokens, R), jnp.bfloat16), jax.ShapeDtypeStruct((tokens, k), jnp.float32),
            jax.ShapeDtypeStruct((tokens, k), jnp.int32)]
    assert "xla.gpu.triton" in jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


# Mosaic GPU kernel (mosaic_gpu.py): interpret mode on CPU (its register decode as the jnp twin with the
# same words, masks and register-to-column map), and Pallas' Mosaic GPU lowering for CUDA on the CPU.
MOSAIC_128 = MXBlocks(bk=128, num_stages=2, mosaic_gpu=True)
MOSAIC_256 = MXBlocks(bk=256, num_stages=3, mosaic_gpu=True)


def test_mosaic_k_permutation_is_a_permutation():
    from pallas_kernels.mx_matmul.mosaic_gpu import k_permutation

    for bk in (128, 256):
        assert sorted(k_permutation(bk).tolist()) == list(range(bk))


@pytest.mark.parametrize("bk,k", [(128, 160), (256, 544)])
def test_mosaic_x_operand_is_the_k_permutation(bk, k):
    """``x_operand``'s transpose puts column k_permutation(bk)[p] of each bk tile at p, x padded with zeros."""
    from pallas_kernels.mx_matmul.mosaic_gpu import k_permutation, x_operand

    x = bf16_normal(jax.random.key(80), (3, k))
    kp = -(-k // bk) * bk
    padded = np.zeros((5, kp), np.float32)
    padded[:3, :k] = np.asarray(x, np.float32)
    columns = (np.arange(kp) // bk) * bk + np.tile(k_permutation(bk), kp // bk)
    np.testing.assert_array_equal(np.asarray(x_operand(x, 5, bk), np.float32), padded[:, columns])


def test_mosaic_decode_twin_bit_exact():
    """The register decode's jnp twin against XLA's decode, bit for bit: every code byte, every finite
    scale byte (0..254), columns in the k_permutation order."""
    from pallas_kernels.mx_matmul.mosaic_gpu import ROWS, _decode_emulated, k_permutation

    bk = 256
    codes = jax.random.permutation(jax.random.key(45), jnp.tile(jnp.arange(256, dtype=jnp.uint8), ROWS * bk // 512))
    scales = jnp.arange(ROWS * bk // 32, dtype=jnp.int32).reshape(ROWS, bk // 32) % 255
    w = MXTensor(codes.reshape(ROWS, bk // 2), scales.astype(jnp.uint8), "mxfp4")
    out = _decode_emulated(w.codes, w.scales, bk)
    ref = w.decode(jnp.bfloat16)[:, k_permutation(bk)]
    np.testing.assert_array_equal(np.asarray(out).view(np.uint16), np.asarray(ref).view(np.uint16))


@pytest.mark.parametrize("blocks,m,n,k", [(MOSAIC_128, 1, 96, 160), (MOSAIC_256, 13, 200, 544)])
def test_mosaic_gpu_matches_reference(blocks, m, n, k):
    """N not a multiple of 64, K not of bk (padded); 13 rows padded to wgmma's 16."""
    w = MXTensor.quantize(jax.random.normal(jax.random.key(40 + m), (n, k)) * 0.05)
    x = bf16_normal(jax.random.key(41 + m), (m, k))
    out = mx_matmul(x, w, blocks=blocks)
    assert out.shape == (m, n) and out.dtype == jnp.float32
    assert rel_err(out, mx_matmul_reference(x, w)) < 1e-5


def test_mosaic_gpu_w4a8_and_large_scales():
    """MXFP8 x; scale bytes up to 140 (the GPU decode's two-multiply branch above 128)."""
    n, k = 64, 256
    codes = jax.random.bits(jax.random.key(42), (n, k // 2), jnp.uint8)
    w = MXTensor(codes, jax.random.randint(jax.random.key(43), (n, k // 32), 100, 141).astype(jnp.uint8), "mxfp4")
    xq = MXTensor.quantize(jax.random.normal(jax.random.key(44), (3, k)), "mxfp8")
    out = mx_matmul(xq, w, blocks=MOSAIC_128, out_dtype=jnp.float32)
    assert rel_err(out, mx_matmul_reference(xq, w)) < 1e-5


def test_mosaic_gpu_lowers_for_cuda():
    """The decode shape's kernel through Pallas' Mosaic GPU lowering for CUDA (inline PTX, wgmma, TMA)."""
    from pallas_kernels.mx_matmul.mosaic_gpu import MosaicBlocks, mx_matmul_mosaic

    for m, blocks in [(16, MosaicBlocks(128, 3)), (16, MosaicBlocks(256, 2)), (1, MosaicBlocks(256, 2, out_mn=True))]:
        args = [jax.ShapeDtypeStruct(s, d) for s, d in
                [((m, 3584), jnp.bfloat16), ((4096, 1792), jnp.uint8), ((4096, 112), jnp.uint8)]]
        fn = lambda x, c, s, b=blocks: mx_matmul_mosaic(x, c, s, blocks=b)
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text


# out_mn (the kernel writes [M, N]): K = 544 gives 5 / 3 steps at bk = 128 / 256, so the pipelines refill slots.
@pytest.mark.parametrize("bk,stages,m,n", [(128, 2, 1, 96), (256, 2, 13, 200)])
def test_mosaic_gpu_out_mn_matches_reference(bk, stages, m, n):
    from pallas_kernels.mx_matmul.mosaic_gpu import MosaicBlocks, interpret_params, mx_matmul_mosaic

    k = 544
    w = MXTensor.quantize(jax.random.normal(jax.random.key(50 + m), (n, k)) * 0.05)
    x = bf16_normal(jax.random.key(51 + m), (m, k))
    blocks = MosaicBlocks(bk, stages, out_mn=True)
    out = mx_matmul_mosaic(x, w.codes, w.scales, blocks=blocks, interpret=interpret_params())
    assert out.shape == (m, n) and out.dtype == jnp.float32
    assert rel_err(out, mx_matmul_reference(x, w)) < 1e-5


def test_mosaic_blocks_reject_bad_options():
    from pallas_kernels.mx_matmul.mosaic_gpu import MosaicBlocks

    for bad in [dict(bk=512), dict(stages=0)]:
        with pytest.raises(ValueError):
            MosaicBlocks(**bad)


def _router_case(tokens: int, E: int = 12):
    """Router logits [T, E] and bias [E] where the bias puts expert 7 first (low score, large bias:
    weighted by its score) and experts 2 and 5 tie on score + bias next (the lower index goes first)."""
    logits = jax.random.normal(jax.random.key(30 + tokens), (tokens, E))
    logits = logits.at[:, 2].set(5.0).at[:, 5].set(5.0).at[:, 7].set(-2.0)
    bias = (jax.random.uniform(jax.random.key(40), (E,)) * 0.1).at[5].set(0.0).at[2].set(0.0).at[7].set(0.9)
    return logits, bias


@pytest.mark.parametrize("renormalize", [True, False])
def test_slot_picks_by_rank_equal_select_experts(renormalize):
    """Each slot's (expert, weight) by ranks against ``select_experts`` (lax.top_k), 12 experts in 16 lanes."""
    from k3jax.functional.moe import select_experts
    from pallas_kernels.moe.triton_select import expert_ranks, padded_router_inputs, slot_expert, slot_weight

    k, tokens = 4, 3
    logits, bias = _router_case(tokens)
    weights, experts = select_experts(logits, bias, k, renormalize, 2.5)
    assert np.all(np.asarray(experts[:, :3]) == [7, 2, 5])
    padded, padded_bias = padded_router_inputs(logits, bias)
    for t in range(tokens):
        for slot in range(k):
            scores, rank = expert_ranks(padded[t], padded_bias[0])
            expert, weight = slot_expert(rank, slot), slot_weight(scores, rank, slot, k, renormalize, 2.5)
            assert int(expert) == int(experts[t, slot])
            np.testing.assert_allclose(float(weight), float(weights[t, slot]), rtol=1e-6)


@pytest.mark.parametrize("tokens", [1, 3])
def test_routed_moe_matches_select_then_dense_reference(tokens):
    """``routed_moe_mx_split`` (the selection in the hidden kernel) against ``select_experts`` and every
    expert on every token combined by its weights, float32 on decoded weights; bad logits raise."""
    from k3jax.functional.moe import select_experts
    from pallas_kernels.mx_matmul import routed_moe_mx_split

    E, F, R, k = 12, 64, 96, 3
    keys = jax.random.split(jax.random.key(22), 4)
    w1, w3, w2 = _expert_stacks(keys, E, F, R)
    x = bf16_normal(keys[3], (tokens, R))
    logits, bias = _router_case(tokens)
    out = routed_moe_mx_split(x, w1, w3, w2, logits, bias, situ, k=k, renormalize=True, scaling_factor=2.5)
    weights, experts = select_experts(logits, bias, k, True, 2.5)
    ref = moe_dense(x, *(w.decode(jnp.float32) for w in (w1, w3, w2)), weights, experts, situ)
    assert out.shape == (tokens, R) and rel_err(out, ref) < 1e-5
    with pytest.raises(ValueError, match="disagree"):
        routed_moe_mx_split(x, w1, w3, w2, logits[:, :8], bias, situ, k=k, renormalize=True, scaling_factor=1.0)


def test_routed_moe_lowers_for_cuda_through_triton():
    """Pallas' Triton lowering of the routed MoE (the [E, E] rank comparison and the pair stores), on the CPU."""
    from pallas_kernels.mx_matmul import routed_moe_mx_split

    E, F, R, k = 12, 64, 256, 2
    w1, w2 = MXTensor.quantize(jnp.ones((E, F, R))), MXTensor.quantize(jnp.ones((E, R, F)))
    fn = lambda x, logits, bias: routed_moe_mx_split(x, w1, w1, w2, logits, bias, situ, k=k, renormalize=True,
                                                     scaling_factor=1.0, interpret=False)
    args = [jax.ShapeDtypeStruct((1, R), jnp.bfloat16), jax.ShapeDtypeStruct((1, E), jnp.float32),
            jax.ShapeDtypeStruct((E,), jnp.float32)]
    assert "xla.gpu.triton" in jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


# Grouped Mosaic GPU kernel (mosaic_gpu_grouped.py): rows in tiles of one group each.
GROUP_SIZES_TILED = jnp.array([7, 0, 20, 1, 9], jnp.int32)  # 37 of 40 rows; group 1 empty


def test_tiled_rows_layout():
    """Each group's rows start a tile of 8; tiles past the groups' (and the padding to 32) get G."""
    from pallas_kernels.mx_matmul.mosaic_gpu_grouped import tiled_rows

    dest, tile_groups = tiled_rows(GROUP_SIZES_TILED, 40, 8)
    expected = list(range(7)) + list(range(8, 28)) + [32] + list(range(40, 49)) + [80] * 3
    np.testing.assert_array_equal(np.asarray(dest), expected)
    np.testing.assert_array_equal(np.asarray(tile_groups), [0, 2, 2, 2, 3, 4, 4] + [5] * 25)


def test_tiled_rows_bound_with_fewer_rows_than_groups():
    """Decode: 3 rows in 10 groups take ceil(3 / 8) + 3 = 4 tiles' bound (not 1 + 10), the two groups with
    rows one tile each."""
    from pallas_kernels.mx_matmul.mosaic_gpu_grouped import tiled_row_count, tiled_rows

    sizes = jnp.array([0, 2, 0, 0, 1, 0, 0, 0, 0, 0], jnp.int32)
    assert tiled_row_count(3, 10, 8) == 32
    dest, tile_groups = tiled_rows(sizes, 3, 8)
    np.testing.assert_array_equal(np.asarray(dest), [0, 1, 8])
    np.testing.assert_array_equal(np.asarray(tile_groups), [1, 4] + [10] * 30)


@pytest.mark.parametrize("tokens,k,experts,bm", [(13, 3, 7, 8), (40, 8, 5, 64)])
def test_pair_slots_follow_the_stable_sort(tokens, k, experts, bm):
    """``pair_slots`` (counting) against a loop over the pairs in numpy's stable sort by expert: random ids
    with repeats within a token and ids past the experts (another device's), tiles of bm slots per expert."""
    from pallas_kernels.moe.mosaic_gpu_tiled import pair_slots

    ids = np.asarray(jax.random.randint(jax.random.key(tokens), (tokens, k), 0, experts + 2), np.int32)
    flat = ids.reshape(-1)
    bound = (-(-flat.size // bm) + min(experts, flat.size)) * bm
    expected, row, last = np.full(flat.size, bound), -bm, None
    for f in np.argsort(flat, kind="stable"):
        if flat[f] >= experts:
            continue
        row = row + 1 if flat[f] == last else -(-(row + 1) // bm) * bm  # a new expert starts a tile
        expected[f], last = row, flat[f]
    slot, tile_groups = pair_slots(jnp.asarray(ids), experts, bm)
    np.testing.assert_array_equal(np.asarray(slot), expected)
    sizes = np.bincount(flat[flat < experts], minlength=experts)
    groups = np.repeat(np.arange(experts), -(-sizes // bm))
    np.testing.assert_array_equal(np.asarray(tile_groups)[:groups.size], groups)
    assert (np.asarray(tile_groups)[groups.size:] == experts).all()


@pytest.mark.parametrize("bm,bk,stages,k", [(8, 128, 2, 160), (16, 256, 3, 544)])
def test_grouped_mosaic_gpu_matches_reference(bm, bk, stages, k):
    """The grouped Mosaic GPU kernel in interpret mode: an empty group, rows past the groups (zero),
    N and K not multiples of 64 and bk; K = 544 at bk 256 refills the pipeline's slots."""
    G, n, m = 5, 96, 40
    w = MXTensor.quantize(jax.random.normal(jax.random.key(60 + bm), (G, n, k)) * 0.05)
    x = bf16_normal(jax.random.key(61 + bm), (m, k))
    blocks = MXBlocks(bm=bm, bk=bk, num_stages=stages, mosaic_gpu=True)
    out = grouped_mx_matmul(x, w, GROUP_SIZES_TILED, blocks=blocks, out_dtype=jnp.float32)
    assert out.shape == (m, n)
    assert rel_err(out, grouped_mx_matmul_reference(x, w, GROUP_SIZES_TILED)) < 1e-5
    assert not np.any(np.asarray(out[37:]))
    if bm == 8:  # W4A8: MXFP8 x decodes exactly to the bf16 operand
        xq = MXTensor.quantize(x, "mxfp8")
        out = grouped_mx_matmul(xq, w, GROUP_SIZES_TILED, blocks=blocks, out_dtype=jnp.float32)
        assert rel_err(out, grouped_mx_matmul_reference(xq, w, GROUP_SIZES_TILED)) < 1e-5


def test_grouped_mosaic_gpu_lowers_for_cuda_and_checks_arguments():
    """Pallas' Mosaic GPU lowering for CUDA at mini's prefill gate shape (2048 rows over 64 experts), bf16
    out; a tile height that is not a multiple of 8 and mismatched scales raise."""
    from pallas_kernels.mx_matmul.mosaic_gpu import MosaicBlocks
    from pallas_kernels.mx_matmul.mosaic_gpu_grouped import grouped_mx_matmul_mosaic

    args = [jax.ShapeDtypeStruct(s, d) for s, d in [((2048, 1024), jnp.bfloat16), ((64, 768, 512), jnp.uint8),
                                                    ((64, 768, 32), jnp.uint8), ((64,), jnp.int32)]]
    for bm, blocks in [(128, MosaicBlocks(128, 3)), (64, MosaicBlocks(256, 2))]:
        fn = lambda x, c, s, g, b=blocks, bm=bm: grouped_mx_matmul_mosaic(x, c, s, g, bm=bm, blocks=b,
                                                                           out_dtype=jnp.bfloat16)
        assert "mosaic_gpu" in jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    x, codes, scales = jnp.zeros((4, 64), jnp.bfloat16), jnp.zeros((2, 64, 32), jnp.uint8), jnp.zeros((2, 64, 2), jnp.uint8)
    with pytest.raises(ValueError, match="multiple of 8"):
        grouped_mx_matmul_mosaic(x, codes, scales, jnp.array([2, 2]), bm=12)
    with pytest.raises(ValueError, match="disagree"):
        grouped_mx_matmul_mosaic(x, codes, scales[:, :, :1], jnp.array([2, 2]))


@pytest.mark.parametrize("T", [13, 1])
def test_tiled_moe_matches_references(T):
    """The routed experts by the grouped Mosaic GPU kernel in its tiled layout (interpret mode), 8-pair
    tiles: an expert with no pairs, one picked twice by a token, F = 96 and R = 160 not multiples of 64 and
    of bk; at one token (decode) fewer pairs than experts, so the layout's bound is set by the pairs.
    Against the sorted dispatch with every product rounded to bf16 as the kernel's are (float32 products
    of the decoded weights), and against every expert on every token in float32."""
    from pallas_kernels.mx_matmul.mosaic_gpu import MosaicBlocks

    E, F, R, k = 6, 96, 160, 3
    keys = jax.random.split(jax.random.key(70), 6)
    w1, w3, w2 = _expert_stacks(keys, E, F, R)
    x = bf16_normal(keys[3], (T, R)).astype(jnp.bfloat16)
    experts = jax.random.randint(keys[4], (T, k), 0, E - 1).at[0].set(jnp.array([2, 2, 4]))  # expert 5: none
    weights = jax.random.uniform(keys[5], (T, k))
    out = tiled_moe_mx(x, w1, w3, w2, weights, experts, situ, bm=8, blocks=MosaicBlocks(128, 2), interpret=True)
    decoded = [w.decode(jnp.float32) for w in (w1, w3, w2)]
    rounded = lambda xs, w, sizes: grouped_matmul(xs.astype(jnp.float32), w, sizes).astype(jnp.bfloat16)
    assert out.shape == (T, R) and out.dtype == jnp.bfloat16
    assert rel_err(out, moe_sorted(x, *decoded, weights, experts, situ, matmul=rounded)) < 1e-5
    assert rel_err(out, moe_dense(x.astype(jnp.float32), *decoded, weights, experts, situ)) < 1e-2
    with pytest.raises(ValueError, match="bf16"):
        tiled_moe_mx(x.astype(jnp.float32), w1, w3, w2, weights, experts, situ, interpret=True)


def test_tiled_moe_expert_parallel_shards():
    """Expert parallelism's shards on the tiled MoE (interpret mode): each of 2 shards of 3 experts gets the
    pairs of the other's experts as expert 3 (``local_pairs``), which must add nothing; the shards' sum
    equals the whole MoE, and a shard holding none of a token's experts gives that token zeros."""
    from k3jax.sharding import local_pairs
    from pallas_kernels.mx_matmul.mosaic_gpu import MosaicBlocks

    E, F, R, k, T = 6, 64, 96, 2, 5
    keys = jax.random.split(jax.random.key(71), 6)
    w1, w3, w2 = _expert_stacks(keys, E, F, R)
    x = bf16_normal(keys[3], (T, R)).astype(jnp.bfloat16)
    experts = jax.random.randint(keys[4], (T, k), 0, E).at[0].set(jnp.array([0, 1]))  # token 0: shard 0 only
    weights = jax.random.uniform(keys[5], (T, k))
    moe = jax.jit(lambda x, w1, w3, w2, weights, experts: tiled_moe_mx(
        x, w1, w3, w2, weights, experts, situ, bm=8, blocks=MosaicBlocks(128, 2), interpret=True))
    shard = lambda s, w: jax.tree.map(lambda a: a[3 * s:3 * s + 3], w)
    parts = [moe(x, shard(s, w1), shard(s, w3), shard(s, w2), *local_pairs(weights, experts, 3 * s, 3))
             for s in (0, 1)]
    decoded = [w.decode(jnp.float32) for w in (w1, w3, w2)]
    rounded = lambda xs, w, sizes: grouped_matmul(xs.astype(jnp.float32), w, sizes).astype(jnp.bfloat16)
    want = moe_sorted(x, *decoded, weights, experts, situ, matmul=rounded)
    assert bool(jnp.all(parts[1][0] == 0))
    assert rel_err(parts[0].astype(jnp.float32) + parts[1].astype(jnp.float32), want) < 1e-2


def test_tiled_moe_lowers_for_cuda():
    """The tiled MoE at mini's prefill chunk (2048 tokens, 8 of 64 experts) lowers for CUDA through Mosaic
    GPU; mismatched stacks raise."""
    E, F, R, k, T = 64, 768, 1024, 8, 2048
    w1 = MXTensor(jnp.zeros((E, F, R // 2), jnp.uint8), jnp.zeros((E, F, R // 32), jnp.uint8), "mxfp4")
    w2 = MXTensor(jnp.zeros((E, R, F // 2), jnp.uint8), jnp.zeros((E, R, F // 32), jnp.uint8), "mxfp4")
    fn = lambda x, weights, experts: tiled_moe_mx(x, w1, w1, w2, weights, experts, situ)
    args = [jax.ShapeDtypeStruct((T, R), jnp.bfloat16), jax.ShapeDtypeStruct((T, k), jnp.float32),
            jax.ShapeDtypeStruct((T, k), jnp.int32)]
    assert "mosaic_gpu" in jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    with pytest.raises(ValueError, match="disagree"):
        tiled_moe_mx(jnp.zeros((T, R), jnp.bfloat16), w1, w1, w1, jnp.zeros((T, k)), jnp.zeros((T, k), jnp.int32), situ)
