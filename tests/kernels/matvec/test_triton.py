"""The several-weights matvec kernel (pallas_kernels/matvec/triton.py, interpret mode on CPU) against
jnp.einsum at precision HIGHEST on float32-cast operands, rounded once to the output dtype. The op's entry
``project``, which picks it: test_ops.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.functional.moe import situ, swiglu
from k3jax.functional.norms import rms_norm
from pallas_kernels.kda.triton_short_conv import conv_silu_step
from pallas_kernels.matvec.triton import MAX_ROWS, MatvecBlocks, matvecs

# bn = 8 (16 in the dot form), bk = 64: N = 5 is below the block, 20 and 13 are not multiples of
# it, D = 200 not of bk.
ROWS, DOT = MatvecBlocks(bn=8, bk=64), MatvecBlocks(bn=16, bk=64, dot=True)
WEIGHTS = [(5, jnp.bfloat16), (20, jnp.float32), (16, jnp.bfloat16), (13, jnp.float32)]
OUT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float32, jnp.float32)


def _reference(x, w, dtype):
    f32 = jnp.float32
    return jnp.einsum("md,nd->mn", x.astype(f32), w.astype(f32), precision=jax.lax.Precision.HIGHEST).astype(dtype)


@pytest.mark.parametrize("m,x_dtype,blocks", [(1, jnp.bfloat16, ROWS), (3, jnp.float32, ROWS),
                                              (3, jnp.bfloat16, DOT)])
def test_matches_einsum_on_random_data(m, x_dtype, blocks):
    depth = 200
    keys = jax.random.split(jax.random.key(m), len(WEIGHTS) + 1)
    x = jax.random.normal(keys[0], (m, depth), jnp.float32).astype(x_dtype)
    weights = [jax.random.normal(k, (n, depth), jnp.float32).astype(d) for k, (n, d) in zip(keys[1:], WEIGHTS)]
    outs = matvecs(x, weights, OUT_DTYPES, blocks=blocks)
    for out, w, dtype in zip(outs, weights, OUT_DTYPES):
        ref = _reference(x, w, dtype)
        assert out.shape == ref.shape and out.dtype == ref.dtype
        tolerance = 1e-5 if dtype == jnp.float32 else 1e-2  # summation order; one bf16 ulp
        np.testing.assert_allclose(np.float32(out), np.float32(ref), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("m,blocks", [(1, ROWS), (3, DOT)])
def test_rms_norm_inside_matches_norm_then_einsum(m, blocks):
    """``norm``: x RMS-normed in the kernel (two bf16 rows of very different scale) against
    ``rms_norm`` then the einsums."""
    depth, eps = 200, 1e-5
    keys = jax.random.split(jax.random.key(10 + m), len(WEIGHTS) + 2)
    x = jax.random.normal(keys[0], (m, depth), jnp.float32) * jnp.array([30.0, 0.01, 1.0])[:m, None]
    x = x.astype(jnp.bfloat16)
    norm_weight = (1.0 + 0.1 * jax.random.normal(keys[1], (depth,))).astype(jnp.bfloat16)
    weights = [jax.random.normal(k, (n, depth), jnp.float32).astype(d) for k, (n, d) in zip(keys[2:], WEIGHTS)]
    outs = matvecs(x, weights, OUT_DTYPES, norm=(norm_weight, eps), blocks=blocks)
    normed = rms_norm(x, norm_weight, eps)
    for out, w, dtype in zip(outs, weights, OUT_DTYPES):
        tolerance = 1e-5 if dtype == jnp.float32 else 1e-2
        np.testing.assert_allclose(np.float32(out), np.float32(_reference(normed, w, dtype)), rtol=tolerance,
                                   atol=tolerance)


@pytest.mark.parametrize("m,blocks", [(1, ROWS), (3, ROWS), (3, DOT)])
def test_addends_match_rounded_adds(m, blocks):
    """``add``: each output's addends added after its rounding, each sum rounded again, against the
    einsum then ``(y + a).astype(y.dtype)`` in turn (a bf16 and a float32 output with two and one
    addends of the products' scale; the third output none)."""
    depth = 200
    keys = jax.random.split(jax.random.key(20 + m), 7)
    x = jax.random.normal(keys[0], (m, depth), jnp.float32).astype(jnp.bfloat16)
    weights = [jax.random.normal(k, (n, depth), jnp.float32).astype(d) for k, (n, d) in zip(keys[1:4], WEIGHTS)]
    out_dtypes = (jnp.bfloat16, jnp.float32, jnp.float32)
    addend = lambda k, n, dtype: (10.0 * jax.random.normal(k, (m, n), jnp.float32)).astype(dtype)
    add = [[addend(keys[4], 5, jnp.bfloat16), addend(keys[5], 5, jnp.bfloat16)], [addend(keys[6], 20, jnp.float32)], []]
    outs = matvecs(x, weights, out_dtypes, add=add, blocks=blocks)
    for out, w, dtype, adds in zip(outs, weights, out_dtypes, add):
        want = _reference(x, w, dtype)
        for a in adds:
            want = (want + a).astype(dtype)
        tolerance = 1e-5 if dtype == jnp.float32 else 2e-2  # summation order; a bf16 ulp of the larger sums
        assert out.dtype == want.dtype
        np.testing.assert_allclose(np.float32(out), np.float32(want), rtol=tolerance, atol=tolerance)


def _lowering_prologue(name):
    """matvecs keyword arguments of each prologue, for x [3, 2048]."""
    f32, bf16 = jnp.float32, jnp.bfloat16
    return {"none": {},
            "rms_norm": dict(norm=(jnp.ones((2048,), f32), 1e-6)),
            "situ": dict(act=(situ, jnp.ones((3, 2048), bf16))),
            "read_as_norm": dict(read_as=bf16, norm=(jnp.ones((2048,), bf16), 1e-6)),
            "add": dict(add=[[jnp.ones((3, 100), f32)], [jnp.ones((3, 16), bf16)] * 2])}[name]


@pytest.mark.parametrize("blocks,prologue", [(MatvecBlocks(), "none"), (MatvecBlocks(bn=16, dot=True), "rms_norm"),
                                             (MatvecBlocks(), "situ"), (MatvecBlocks(bk=512), "read_as_norm"),
                                             (MatvecBlocks(bn=16, dot=True), "add")])
def test_lowers_for_cuda_through_triton(blocks, prologue):
    """Pallas' Triton lowering of the kernel (masked row and column tiles, two dtypes, each prologue;
    a whole-row norm wider than bk takes its pass over x first; addends), on the CPU."""
    args = [jax.ShapeDtypeStruct(s, d) for s, d in
            [((3, 2000), jnp.bfloat16), ((100, 2000), jnp.float32), ((16, 2000), jnp.bfloat16)]]
    if prologue not in ("none", "add"):
        args[0] = jax.ShapeDtypeStruct((3, 2048), jnp.float32 if prologue == "read_as_norm" else jnp.bfloat16)
        args[1:] = [jax.ShapeDtypeStruct((n, 2048), d) for _, n, d in ((0, 100, jnp.float32), (0, 16, jnp.bfloat16))]
    kwargs = _lowering_prologue(prologue)
    fn = lambda x, *w: matvecs(x, w, (jnp.float32, jnp.bfloat16), blocks=blocks, interpret=False, **kwargs)
    assert "xla.gpu.triton" in jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _prologue_case(name, key):
    """(x, matvecs keyword arguments, blocks, x as the prologue should make it) on random data."""
    f32, bf16 = jnp.float32, jnp.bfloat16
    k = jax.random.split(key, 4)
    normal = lambda i, shape, dtype, scale=1.0: (scale * jax.random.normal(k[i], shape, f32)).astype(dtype)
    if name in ("situ", "situ_dot", "swiglu"):  # bf16 SwiGLU rounds twice, which XLA may skip: float32
        m, dtype, act = {"situ": (1, bf16, situ), "situ_dot": (3, bf16, situ), "swiglu": (3, f32, swiglu)}[name]
        gate, up = normal(0, (m, 72), dtype, 4.0), normal(1, (m, 72), dtype, 4.0)
        return gate, dict(act=(act, up)), DOT if name == "situ_dot" else ROWS, act(gate, up)
    depth = {"read_as_row_norm": 72, "read_as_row_norm_one_tile": 40}[name]  # wider than bk / not
    x = normal(0, (2, depth), f32, 5.0)
    weight = (1.0 + 0.1 * normal(1, (depth,), f32)).astype(bf16)
    return x, dict(read_as=bf16, norm=(weight, 1e-5)), ROWS, rms_norm(x.astype(bf16), weight, 1e-5)


@pytest.mark.parametrize("name", ["situ", "situ_dot", "swiglu", "read_as_row_norm", "read_as_row_norm_one_tile"])
def test_prologue_matches_its_jnp_reference(name):
    """Each prologue against the jnp functions it stands for: an identity weight returns the
    prologue's x itself, equal to the reference up to one ulp of its dtype (the norm's float32 sums
    in another order); the random weights (ragged) return that x's products."""
    x, kwargs, blocks, want = _prologue_case(name, jax.random.key(len(name)))
    depth = x.shape[1]
    keys = jax.random.split(jax.random.key(7), 2)
    weights = [jnp.eye(depth, dtype=jnp.float32)] + [jax.random.normal(k, (n, depth), jnp.float32).astype(d)
                                                     for k, (n, d) in zip(keys, WEIGHTS[:2])]
    out_dtypes = (jnp.bfloat16, jnp.float32)
    outs = matvecs(x, weights, (jnp.float32, *out_dtypes), blocks=blocks, **kwargs)
    ulp = 2.0**-7 if want.dtype == jnp.bfloat16 else 1e-6
    np.testing.assert_allclose(np.float32(outs[0]), np.float32(want), rtol=ulp, atol=1e-6)
    for out, w, dtype in zip(outs[1:], weights[1:], out_dtypes):
        tolerance = 1e-5 if dtype == jnp.float32 else 1e-2
        np.testing.assert_allclose(np.float32(out), np.float32(_reference(outs[0].astype(want.dtype), w, dtype)),
                                   rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("m", [1, 3])
def test_short_conv_epilogue_equals_the_conv_kernel(m):
    """``conv``: the first two outputs (20 and 13 rows: a partial block of 8 and a ragged last one) through
    the short convs and SiLU in the kernel, the state updated in place, bitwise as the plain products then
    ``conv_silu_step`` (itself tested against ``causal_conv``); the outputs after them untouched."""
    depth, width = 200, 4
    keys = jax.random.split(jax.random.key(30 + m), 8)
    x = jax.random.normal(keys[0], (m, depth), jnp.float32).astype(jnp.bfloat16)
    shapes = [(20, jnp.bfloat16), (13, jnp.bfloat16), (16, jnp.bfloat16), (5, jnp.float32)]
    weights = [jax.random.normal(k, (n, depth), jnp.float32).astype(d) for k, (n, d) in zip(keys[1:5], shapes)]
    out_dtypes = (jnp.bfloat16, jnp.bfloat16, jnp.float32, jnp.float32)
    taps = [jax.random.normal(k, (w.shape[0], width), jnp.float32) for k, w in zip(keys[6:8], weights)]
    state = jax.random.normal(keys[0], (m, width - 1, 20 + 13), jnp.float32)
    *outs, new_state = matvecs(x, weights, out_dtypes, conv=(taps, state), blocks=ROWS)
    plain = matvecs(x, weights, out_dtypes, blocks=ROWS)
    # conv_silu_step takes inputs of one width: each output's channels in a state of their own
    for i, (lo, hi) in enumerate([(0, 20), (20, 33)]):
        (want,), want_state = conv_silu_step([plain[i]], [taps[i]], state[..., lo:hi])
        assert outs[i].dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(outs[i]), np.asarray(want))
        np.testing.assert_array_equal(np.asarray(new_state[..., lo:hi]), np.asarray(want_state))
    for got, want in zip(outs[2:], plain[2:]):
        np.testing.assert_array_equal(np.float32(got), np.float32(want))


def test_short_conv_epilogue_refuses_bad_operands():
    x, w = jnp.zeros((1, 64), jnp.bfloat16), jnp.zeros((8, 64), jnp.bfloat16)
    taps, state = jnp.zeros((8, 4), jnp.float32), jnp.zeros((1, 3, 8), jnp.float32)
    with pytest.raises(ValueError, match="conv taps 0 must be float32"):
        matvecs(x, [w], conv=([taps.astype(jnp.bfloat16)], state))
    with pytest.raises(ValueError, match=r"conv state must be float32 \[M, W-1, channels\] = \[1, 3, 8\]"):
        matvecs(x, [w], conv=([taps], state[..., :4]))
    with pytest.raises(ValueError, match="both a conv and addends"):
        matvecs(x, [w], conv=([taps], state), add=[[jnp.zeros((1, 8), jnp.bfloat16)]])
    with pytest.raises(ValueError, match="rows form"):
        matvecs(x, [jnp.zeros((16, 64), jnp.bfloat16)], conv=([jnp.zeros((16, 4))], jnp.zeros((1, 3, 16))), blocks=DOT)
    with pytest.raises(ValueError, match="taps for 1 to 1 outputs"):
        matvecs(x, [w], conv=([taps, taps], state))


def test_bad_inputs_are_refused():
    x = jnp.zeros((2, 64), jnp.bfloat16)
    w = jnp.zeros((8, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="1 <= M"):
        matvecs(jnp.zeros((MAX_ROWS + 1, 64), jnp.bfloat16), [w])
    with pytest.raises(ValueError, match="D = 64"):
        matvecs(x, [w, jnp.zeros((8, 32), jnp.bfloat16)])
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        matvecs(x, [w.astype(jnp.float16)])
    with pytest.raises(ValueError, match="out_dtypes"):
        matvecs(x, [w, w], [jnp.float32])
    with pytest.raises(ValueError, match="norm weight"):
        matvecs(x, [w], norm=(jnp.ones((48,)), 1e-6))
    with pytest.raises(ValueError, match="second input must have x's shape"):
        matvecs(x, [w], act=(swiglu, jnp.zeros((2, 32), jnp.bfloat16)))
    with pytest.raises(ValueError, match="read_as must be bfloat16 or float32"):
        matvecs(x, [w], read_as=jnp.float16)
    with pytest.raises(ValueError, match="at least one"):
        matvecs(x, [])
    with pytest.raises(ValueError, match="one sequence of addends per weight"):
        matvecs(x, [w, w], add=[[]])
    with pytest.raises(ValueError, match=r"addends of output 0 must be \[M, N\]"):
        matvecs(x, [w], add=[[jnp.zeros((2, 8), jnp.float32)]])
    with pytest.raises(ValueError, match="power of two"):
        MatvecBlocks(bn=12)
    with pytest.raises(ValueError, match="bn and bk >= 16"):
        MatvecBlocks(bn=8, dot=True)
