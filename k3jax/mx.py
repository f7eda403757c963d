"""OCP Microscaling (MX v1.0) formats: MXFP4 weights and MXFP8 activations.

A block of ``BLOCK = 32`` consecutive elements along the last (contracted) axis shares one E8M0
scale byte ``s`` whose value is ``2**(s - 127)``; ``s = 255`` is NaN. Elements are

- FP4 E2M1 (MXFP4): sign bit 3, magnitude bits 0-2 index {0, 0.5, 1, 1.5, 2, 3, 4, 6}; packed two
  codes per byte, the low nibble holds the even element and the high nibble the odd one;
- FP8 E4M3 (MXFP8): ``jnp.float8_e4m3fn`` (max normal 448, no infinities).

Quantizing a block (spec section 7): shared exponent ``e = floor(log2(amax)) - emax`` (emax 2 for
E2M1, 8 for E4M3), clamped to the E8M0 range [-127, 127]; elements are
``round_to_nearest_even(x / 2**e)`` saturated to the element maximum (6 or 448). An all-zero block
gets scale byte 127 (scale 1.0) and zero elements. A negative input that rounds to zero keeps its
sign (FP4 code 8, the negative zero). Inputs are assumed finite.

``MXTensor`` holds ``codes`` and ``scales`` in exactly the byte layout of the released K3
checkpoint (``weight_packed`` uint8 [..., N, K//2], ``weight_scale`` uint8 [..., N, K//32]), so a
converter copies bytes straight in with ``MXTensor.from_checkpoint``.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.typing import Array

BLOCK = 32
FP4_MAX = 6.0
FP8_E4M3_MAX = 448.0
E8M0_BIAS = 127
E8M0_NAN = 255
ZERO_BLOCK_SCALE_BYTE = 127

MXFormat = Literal["mxfp4", "mxfp8"]

# (mantissa bits, min normal exponent, max value, emax) of the element formats.
_ELEMENT = {"mxfp4": (1, 0, FP4_MAX, 2), "mxfp8": (3, -6, FP8_E4M3_MAX, 8)}


def _check_last_axis(x: Array, name: str | None) -> None:
    k = x.shape[-1] if x.ndim else 0
    if x.ndim == 0 or k % BLOCK != 0:
        label = f"{name}: " if name else ""
        raise ValueError(
            f"{label}MX quantization needs the last (contracted) axis to be a multiple of {BLOCK}; "
            f"got shape {tuple(x.shape)}"
        )


def _is_concrete(x: Array) -> bool:
    return not isinstance(x, jax.core.Tracer)


def check_scales(scales: Array, name: str | None = None) -> None:
    """Raise if concrete E8M0 ``scales`` (uint8, any shape) hold the NaN byte 255.

    Traced values are not checked (a jitted decode turns byte 255 into NaN instead).
    """
    if not _is_concrete(scales):
        return
    bad = np.argwhere(np.asarray(scales) == E8M0_NAN)
    if bad.size:
        label = name or "MX tensor"
        raise ValueError(
            f"{label}: E8M0 scale byte 255 is NaN (OCP MX v1.0) at {len(bad)} position(s), "
            f"first at index {tuple(int(i) for i in bad[0])}; the tensor is corrupt or not MX-encoded"
        )


def e8m0_to_float(scale_bytes: Array) -> Array:
    """E8M0 scale bytes (uint8 or int32, any shape) -> float32 ``2**(s - 127)``; byte 255 -> NaN.

    Exact for every byte: byte 0 is the float32 subnormal 2**-127. Elementwise integer ops only, so
    kernels use it on tiles too.
    """
    s = scale_bytes.astype(jnp.int32)
    bits = jnp.where(s == 0, jnp.int32(1 << 22), s << 23)
    bits = jnp.where(s == E8M0_NAN, jnp.int32(0x7FC00000), bits)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def fp4_e2m1_to_float(nibbles: Array) -> Array:
    """FP4 E2M1 codes (integers 0..15, any shape) -> float32 values.

    Magnitude ``m = code & 7``: twice the value is ``m`` for m < 2, else ``(2 + (m & 1)) << (m//2 - 1)``
    ({0, 1, 2, 3, 4, 6, 8, 12}); bit 3 is the sign. Elementwise integer ops only (no table gather),
    so kernels use it on tiles too.
    """
    code = nibbles.astype(jnp.int32)
    mag = code & 7
    shift = jnp.maximum((mag >> 1) - 1, 0)
    twice = jnp.where(mag < 2, mag, (2 + (mag & 1)) << shift)
    half = jnp.where((code >> 3) == 1, jnp.float32(-0.5), jnp.float32(0.5))
    return twice.astype(jnp.float32) * half


def unpack_fp4(packed: Array) -> Array:
    """uint8 [..., K//2] packed pairs -> int32 codes [..., K] (low nibble = even element)."""
    p = packed.astype(jnp.int32)
    pairs = jnp.stack([p & 0xF, p >> 4], axis=-1)  # [..., K//2, 2]
    return pairs.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def pack_fp4(codes: Array) -> Array:
    """int codes 0..15 [..., K] (K even) -> uint8 [..., K//2] (low nibble = even element)."""
    c = codes.astype(jnp.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def _blocks(x: Array) -> Array:
    """[..., K] -> [..., K//32, 32]."""
    return x.reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)


def _shared_exponent(xb: Array, emax: int) -> tuple[Array, Array]:
    """Blocks [..., G, 32] float32 -> (E8M0 bytes uint8 [..., G], exponent int32 [..., G])."""
    amax = jnp.max(jnp.abs(xb), axis=-1)
    _, e = jnp.frexp(amax)  # amax = f * 2**e with f in [0.5, 1), so floor(log2(amax)) = e - 1
    exponent = jnp.clip(e - 1 - emax, -E8M0_BIAS, E8M0_BIAS)
    exponent = jnp.where(amax == 0, ZERO_BLOCK_SCALE_BYTE - E8M0_BIAS, exponent)
    return (exponent + E8M0_BIAS).astype(jnp.uint8), exponent


def _round_to_element(v: Array, mantissa_bits: int, min_exponent: int, max_value: float) -> Array:
    """Round float32 ``v`` to the nearest value of a small float format, ties to even, saturating.

    The grid spacing in the binade of ``|v|`` is ``2**(max(floor(log2|v|), min_exponent) - mantissa_bits)``
    (subnormals share the lowest binade's spacing); ``jnp.round`` rounds half to even.
    """
    a = jnp.abs(v)
    _, e = jnp.frexp(a)
    binade = jnp.maximum(e - 1, min_exponent)
    step_exp = binade - mantissa_bits
    rounded = jnp.ldexp(jnp.round(jnp.ldexp(a, -step_exp)), step_exp)
    return jnp.copysign(jnp.minimum(rounded, max_value), v)


def _quantize_blocks(x: Array, fmt: MXFormat, name: str | None) -> tuple[Array, Array]:
    """float [..., K] -> (element values float32 [..., K] on the element grid, scales uint8 [..., K//32])."""
    _check_last_axis(x, name)
    mantissa_bits, min_exponent, max_value, emax = _ELEMENT[fmt]
    xb = _blocks(x.astype(jnp.float32))
    scale_bytes, exponent = _shared_exponent(xb, emax)
    scaled = jnp.ldexp(xb, -exponent[..., None])
    elements = _round_to_element(scaled, mantissa_bits, min_exponent, max_value)
    return elements.reshape(x.shape), scale_bytes


def _fp4_codes_from_values(v: Array) -> Array:
    """Values on the E2M1 grid (float32) -> codes 0..15 (uint8)."""
    a = jnp.abs(v)
    magnitude = jnp.where(a < 2, a * 2, jnp.where(a < 4, a + 2, a / 2 + 4)).astype(jnp.uint8)
    return magnitude | (jnp.signbit(v).astype(jnp.uint8) << 3)


def quantize_mxfp4(x: Array, *, name: str | None = None) -> tuple[Array, Array]:
    """float [..., K] -> (packed codes uint8 [..., K//2], E8M0 scales uint8 [..., K//32])."""
    values, scales = _quantize_blocks(x, "mxfp4", name)
    return pack_fp4(_fp4_codes_from_values(values)), scales


def quantize_mxfp8(x: Array, *, name: str | None = None) -> tuple[Array, Array]:
    """float [..., K] -> (values float8_e4m3fn [..., K], E8M0 scales uint8 [..., K//32])."""
    values, scales = _quantize_blocks(x, "mxfp8", name)
    return values.astype(jnp.float8_e4m3fn), scales


def _apply_scales(elements: Array, scales: Array, dtype: jnp.dtype) -> Array:
    """elements float32 [..., K], scales uint8 [..., K//32] -> dtype [..., K]."""
    scaled = _blocks(elements) * e8m0_to_float(scales)[..., None]
    return scaled.reshape(elements.shape).astype(dtype)


def decode_mxfp4(packed: Array, scales: Array, *, dtype=jnp.float32, name: str | None = None) -> Array:
    """uint8 [..., K//2] codes and uint8 [..., K//32] scales -> dtype [..., K].

    Raises ValueError naming ``name`` if concrete scales hold the NaN byte 255.
    """
    check_scales(scales, name)
    return _apply_scales(fp4_e2m1_to_float(unpack_fp4(packed)), scales, dtype)


def decode_mxfp8(values: Array, scales: Array, *, dtype=jnp.float32, name: str | None = None) -> Array:
    """float8_e4m3fn [..., K] values and uint8 [..., K//32] scales -> dtype [..., K]."""
    check_scales(scales, name)
    return _apply_scales(values.astype(jnp.float32), scales, dtype)


@dataclasses.dataclass(frozen=True)
class MXTensor:
    """A block-scaled tensor of logical shape [..., N, K]; a JAX pytree.

    Leaves: ``codes`` (MXFP4: uint8 [..., N, K//2], two E2M1 codes a byte; MXFP8: float8_e4m3fn
    [..., N, K]) and ``scales`` (uint8 E8M0 [..., N, K//32]). Static aux data: ``format``.
    ``shape`` is derived from ``codes`` so that slicing the leaves (``lax.scan`` over stacked
    layers, ``vmap``) keeps it right.
    """

    codes: Array
    scales: Array
    format: MXFormat = "mxfp4"

    @property
    def shape(self) -> tuple[int, ...]:
        """Logical shape [..., N, K]."""
        *lead, last = self.codes.shape
        return (*lead, last * 2 if self.format == "mxfp4" else last)

    @property
    def ndim(self) -> int:
        return len(self.codes.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of codes plus scales."""
        return int(np.prod(self.codes.shape)) * self.codes.dtype.itemsize + int(np.prod(self.scales.shape))

    @classmethod
    def quantize(cls, x: Array, format: MXFormat = "mxfp4", *, name: str | None = None) -> MXTensor:
        """float [..., N, K] (K a multiple of 32) -> MXTensor of that logical shape."""
        quantize = quantize_mxfp4 if format == "mxfp4" else quantize_mxfp8
        codes, scales = quantize(x, name=name)
        return cls(codes, scales, format)

    @classmethod
    def from_checkpoint(cls, weight_packed: Array, weight_scale: Array, *, name: str | None = None) -> MXTensor:
        """Wrap released ``weight_packed`` uint8 [..., N, K//2] and ``weight_scale`` uint8 [..., N, K//32]."""
        label = name or "MX tensor"
        if weight_packed.dtype != jnp.uint8 or weight_scale.dtype != jnp.uint8:
            raise ValueError(f"{label}: weight_packed and weight_scale must be uint8, got "
                             f"{weight_packed.dtype} and {weight_scale.dtype}")
        k = weight_packed.shape[-1] * 2
        if k % BLOCK or tuple(weight_scale.shape) != (*weight_packed.shape[:-1], k // BLOCK):
            raise ValueError(f"{label}: weight_packed {tuple(weight_packed.shape)} and weight_scale "
                             f"{tuple(weight_scale.shape)} do not describe MXFP4 blocks of {BLOCK}")
        check_scales(weight_scale, name)
        return cls(weight_packed, weight_scale, "mxfp4")

    def decode(self, dtype=jnp.float32, *, name: str | None = None) -> Array:
        """-> dtype [..., N, K]; raises ValueError naming ``name`` on a concrete NaN scale."""
        decode = decode_mxfp4 if self.format == "mxfp4" else decode_mxfp8
        return decode(self.codes, self.scales, dtype=dtype, name=name)


jax.tree_util.register_dataclass(MXTensor, data_fields=["codes", "scales"], meta_fields=["format"])

# Compiled once per shape; called eagerly, the element-wise encode compiles op by op (about a second
# a tensor shape), which dominates model initialization and conversion.
quantize_compiled = jax.jit(MXTensor.quantize, static_argnums=1)
decode_compiled = jax.jit(lambda t, dtype: t.decode(dtype), static_argnums=1)


__all__ = [
    "decode_compiled",
    "quantize_compiled",
    "BLOCK",
    "FP4_MAX",
    "FP8_E4M3_MAX",
    "ZERO_BLOCK_SCALE_BYTE",
    "MXFormat",
    "MXTensor",
    "check_scales",
    "decode_mxfp4",
    "decode_mxfp8",
    "e8m0_to_float",
    "fp4_e2m1_to_float",
    "pack_fp4",
    "quantize_mxfp4",
    "quantize_mxfp8",
    "unpack_fp4",
]
