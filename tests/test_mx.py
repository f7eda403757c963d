"""MX formats (k3jax.mx) against tables written here from the OCP MX v1.0 specification."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from k3jax import mx
from k3jax.mx import MXTensor

# OCP MX v1.0, FP4 E2M1: 1 sign, 2 exponent (bias 1), 1 mantissa bit; exponent 0 is subnormal.
FP4_TABLE = {
    0b0000: 0.0, 0b0001: 0.5, 0b0010: 1.0, 0b0011: 1.5,
    0b0100: 2.0, 0b0101: 3.0, 0b0110: 4.0, 0b0111: 6.0,
    0b1000: -0.0, 0b1001: -0.5, 0b1010: -1.0, 0b1011: -1.5,
    0b1100: -2.0, 0b1101: -3.0, 0b1110: -4.0, 0b1111: -6.0,
}


def e8m0_table(byte: int) -> float:
    """OCP E8M0: unsigned exponent, bias 127, no mantissa."""
    return float(np.ldexp(np.float64(1.0), byte - 127))


def quantize_one_block(values):
    """A 32-element block padded with zeros -> (decoded float32 [32], scale byte, codes [32])."""
    block = np.zeros(32, np.float32)
    block[: len(values)] = values
    t = MXTensor.quantize(jnp.asarray(block)[None])
    codes = np.asarray(mx.unpack_fp4(t.codes))[0]
    return np.asarray(t.decode())[0], int(t.scales[0, 0]), codes


def test_every_fp4_code_decodes_to_table():
    got = np.asarray(mx.fp4_e2m1_to_float(jnp.arange(16, dtype=jnp.uint8)))
    want = np.array([FP4_TABLE[c] for c in range(16)], np.float32)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))


def test_every_scale_byte_decodes_to_table():
    got = np.asarray(mx.e8m0_to_float(jnp.arange(255, dtype=jnp.uint8)), np.float64)
    want = np.array([e8m0_table(b) for b in range(255)])
    np.testing.assert_array_equal(got, want)


def test_nan_scale_rejected_with_tensor_name():
    codes = jnp.full((4, 16), 0x21, jnp.uint8)
    scales = jnp.full((4, 1), 127, jnp.uint8).at[2, 0].set(255)
    with pytest.raises(ValueError, match=r"experts\.3\.w1\.weight_scale: E8M0 scale byte 255 is NaN"):
        MXTensor(codes, scales).decode(name="experts.3.w1.weight_scale")
    with pytest.raises(ValueError, match=r"experts\.3\.w1\.weight_scale"):
        MXTensor.from_checkpoint(codes, scales, name="experts.3.w1.weight_scale")
    traced = jax.jit(lambda s: mx.e8m0_to_float(s))(scales)
    assert np.isnan(np.asarray(traced)[2, 0])


def test_nibble_order_and_checkpoint_layout():
    # element 0 = 1.0 (code 2) in the low nibble, element 1 = -3.0 (code 13) in the high nibble
    packed = jnp.array([[0xD2] * 16], jnp.uint8)
    t = MXTensor.from_checkpoint(packed, jnp.array([[128]], jnp.uint8))
    assert t.shape == (1, 32)
    np.testing.assert_array_equal(np.asarray(t.decode())[0, :4], [2.0, -6.0, 2.0, -6.0])


def test_round_trip_of_representable_values():
    rng = np.random.default_rng(0)
    grid = np.array([FP4_TABLE[c] for c in range(16)], np.float32)
    exps = rng.integers(-20, 20, size=(3, 5, 1, 1))
    values = rng.choice(grid, size=(3, 5, 3, 32))
    values[..., 0] = 6.0  # amax 6 fixes the scale to the block exponent
    x = np.ldexp(values, exps).reshape(3, 5, 96).astype(np.float32)
    t = MXTensor.quantize(jnp.asarray(x))
    assert t.codes.shape == (3, 5, 48) and t.scales.shape == (3, 5, 3) and t.shape == (3, 5, 96)
    np.testing.assert_array_equal(np.asarray(t.decode()), x)
    again = MXTensor.quantize(t.decode())
    np.testing.assert_array_equal(np.asarray(again.codes), np.asarray(t.codes))


def test_quantize_random_error_bound():
    x = jax.random.normal(jax.random.key(1), (7, 160), jnp.float32)
    err = np.abs(np.asarray(MXTensor.quantize(x).decode()) - np.asarray(x))
    amax = np.abs(np.asarray(x)).reshape(7, 5, 32).max(-1, keepdims=True)
    # in scale units 2**(floor(log2 amax) - 2): rounding errs by <= 1 (spacing 2 at the top),
    # saturating [6, 8) to 6 by < 2
    bound = np.repeat(2 * np.exp2(np.floor(np.log2(amax)) - 2), 32, axis=-1).reshape(7, 160)
    assert np.all(err <= bound + 1e-7)


def test_pytree_and_jit():
    t = MXTensor.quantize(jax.random.normal(jax.random.key(2), (2, 64, 96)))
    leaves, treedef = jax.tree_util.tree_flatten(t)
    assert [leaf.dtype for leaf in leaves] == [jnp.uint8, jnp.uint8]
    rebuilt = jax.tree_util.tree_unflatten(treedef, leaves)
    assert rebuilt.format == "mxfp4" and rebuilt.shape == (2, 64, 96)
    sliced = jax.tree_util.tree_map(lambda a: a[1], t)
    assert sliced.shape == (64, 96)
    out = jax.jit(lambda w: w.decode(jnp.bfloat16))(t)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(t.decode()))


def test_k_not_multiple_of_32_rejected():
    with pytest.raises(ValueError, match="multiple of 32"):
        MXTensor.quantize(jnp.ones((4, 48)), name="w")


@pytest.mark.parametrize(
    "values, scale_byte, expected",
    [
        # amax 6 -> scale 2**0; 2.5 ties 2/3 -> 2 (even), 3.5 ties 3/4 -> 4, 5 ties 4/6 -> 4
        ([6.0, 2.5, 3.5, 5.0, 1.25, 1.75, 0.25, 0.75], 127, [6.0, 2.0, 4.0, 4.0, 1.0, 2.0, 0.0, 1.0]),
        # amax 7 -> scale 2**0 (floor(log2 7) - 2 = 0); 7 saturates to 6
        ([7.0, 0.5, -0.5], 127, [6.0, 0.5, -0.5]),
        # amax 7.9 -> same scale, saturates to 6; subnormal 0.5 kept exact
        ([-7.9, 0.5, 0.3], 127, [-6.0, 0.5, 0.5]),
        # amax 1 -> scale 2**-2: elements 0.5 * 4 = 2 etc.; -0.0625 ties 0/0.125 -> -0 (even)
        ([1.0, -0.5, 0.125, -0.0625, 0.375], 125, [1.0, -0.5, 0.125, -0.0, 0.375]),
        # amax 48 -> scale 2**3
        ([48.0, -20.0, 11.0, 3.9], 130, [48.0, -16.0, 12.0, 4.0]),
    ],
)
def test_fp4_hand_worked_cases(values, scale_byte, expected):
    decoded, byte, _ = quantize_one_block(values)
    assert byte == scale_byte
    np.testing.assert_array_equal(decoded[: len(expected)], np.array(expected, np.float32))
    np.testing.assert_array_equal(np.signbit(decoded[: len(expected)]), np.signbit(expected))


def test_all_zero_block_scale_and_negative_codes():
    decoded, byte, codes = quantize_one_block([])
    assert byte == mx.ZERO_BLOCK_SCALE_BYTE == 127
    assert not decoded.any() and not codes.any()
    _, _, codes = quantize_one_block([-6.0, -0.5, 3.0, -1.5])
    np.testing.assert_array_equal(codes[:4], [0b1111, 0b1001, 0b0101, 0b1011])


@pytest.mark.parametrize(
    "values, scale_byte, expected",
    [
        # amax 448 -> floor(log2) 8 -> scale 2**0; 300 is on the grid (spacing 32 in [256, 512))
        ([448.0, 300.0, -1.0, 0.0625], 127, [448.0, 288.0, -1.0, 0.0625]),
        # amax 500 -> scale 2**0, saturates to 448; 272 ties 256/288 -> 256 (even mantissa)
        ([500.0, 272.0, -17.0], 127, [448.0, 256.0, -16.0]),
        # amax 1 -> scale 2**-8: 1 -> 256; subnormal E4M3 (2**-9 spacing at 2**-6 binade) after scaling
        ([1.0, 2.0 ** -12, -0.75], 119, [1.0, 2.0 ** -12, -0.75]),
    ],
)
def test_fp8_e4m3_hand_worked_cases(values, scale_byte, expected):
    block = np.zeros((1, 32), np.float32)
    block[0, : len(values)] = values
    t = MXTensor.quantize(jnp.asarray(block), "mxfp8")
    assert t.codes.dtype == jnp.float8_e4m3fn and int(t.scales[0, 0]) == scale_byte
    np.testing.assert_array_equal(np.asarray(t.decode())[0, : len(expected)], np.array(expected, np.float32))


def test_fp8_matches_ml_dtypes_rounding_on_random_data():
    x = jax.random.normal(jax.random.key(3), (5, 96), jnp.float32) * 3.0
    t = MXTensor.quantize(x, "mxfp8")
    scale = np.asarray(mx.e8m0_to_float(t.scales))
    scaled = np.asarray(x).reshape(5, 3, 32) / scale[..., None]
    want = np.clip(scaled, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    got = np.asarray(t.codes.astype(jnp.float32)).reshape(5, 3, 32)
    np.testing.assert_array_equal(got, want)
