"""The MX matmul op's entries (``pallas_kernels.mx_matmul.ops``: the Triton, Mosaic GPU and grouped Mosaic GPU
kernels, interpret mode on CPU) against the decode-then-dot references. The routed-expert kernels built on them:
tests/kernels/moe/."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.mx import MXTensor
from mx_inputs import bf16_normal
from pallas_kernels.mx_matmul import (
    MXBlocks,
    grouped_mx_matmul,
    grouped_mx_matmul_reference,
    mx_matmul,
    mx_matmul_reference,
)
from pallas_kernels.mx_matmul.layout import kernel_weight_layout
from pallas_kernels.mx_matmul.triton import decode_mxfp4_pallas
from reference_numpy import rel_err

# Small tiles so that every kernel loops over several row, column and contracted tiles.
SMALL = MXBlocks(bm=16, bn=32, bk=64)  # PTX decode (its jnp emulation here), x . w^T
SMALL_LHS = MXBlocks(bm=16, bn=32, bk=64, weights_lhs=True)  # (w . x^T)^T
SMALL_ARITH = MXBlocks(bm=16, bn=32, bk=64, weights_lhs=True, decode="arith")
DECODE_THEN_DOT = MXBlocks(bn=32, bk=64, decode_then_dot=True)
GEMV = MXBlocks(bm=1, bn=32, bk=64, gemv=True)  # one row per program, no dot
GEMV_ARITH = MXBlocks(bm=1, bn=32, bk=64, gemv=True, decode="arith")
N, K = 96, 160  # K = 5 scale blocks: not a power of two, not a multiple of bk


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
    out = decode_mxfp4_pallas(*kernel_weight_layout(w, n), blocks=MXBlocks(bn=16, bk=64, decode=decode),
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
