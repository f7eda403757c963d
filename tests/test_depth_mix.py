"""The AttnRes mix + RMSNorm kernel (pallas_kernels/depth_mix.py, interpret mode on CPU) against
``attn_res_mix`` rounded to the partial's dtype, then ``rms_norm``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax.config import MoEConfig
from k3jax.functional.attn_res import DepthMix, attn_res_mix
from k3jax.functional.norms import rms_norm
from k3jax.layers.basic import RMSNorm
from k3jax.layers.mlp import activation
from k3jax.layers.moe import MoE
from pallas_kernels.depth_mix import mix_norm

DEPTH, EPS, MIX_EPS = 200, 1e-5, 1e-6  # D not a power of two: the padded columns are masked


def _inputs(m: int, dtype, seed: int):
    """Three stored blocks and a partial of different scales (the softmax over depth far from
    uniform), the mix site's weights and a norm weight."""
    keys = jax.random.split(jax.random.key(seed), 4)
    scales = jnp.array([3.0, 0.2, 1.0, 5.0])[:, None, None]
    sources = (jax.random.normal(keys[0], (4, m, DEPTH)) * scales).astype(dtype)
    site_norm, norm_weight = (1.0 + 0.3 * jax.random.normal(k, (DEPTH,)) for k in keys[1:3])
    site_proj = 0.2 * jax.random.normal(keys[3], (DEPTH,))
    return sources[:3], sources[3], site_norm, site_proj, norm_weight.astype(dtype)


@pytest.mark.parametrize("m,count,dtype,norm", [(1, 2, jnp.bfloat16, True), (3, 0, jnp.float32, True),
                                                (3, 3, jnp.bfloat16, False)])
@pytest.mark.parametrize("form", ["stack", "sequence"])
def test_mix_norm_matches_mix_then_norm(m, count, dtype, norm, form):
    """Blocks past ``count`` hold random values the mix must ignore (the stack, masked); or the valid blocks handed
    as a sequence, operands of their own."""
    blocks, partial, site_norm, site_proj, norm_weight = _inputs(m, dtype, seed=m + count)
    rms = (norm_weight, EPS) if norm else None
    given = (blocks, jnp.asarray(count)) if form == "stack" else (list(blocks[:count]), None)
    out = jax.jit(lambda p, b, n: mix_norm(p, b, n, site_norm, site_proj, MIX_EPS, rms))(partial, *given)
    mixed, weights = attn_res_mix(blocks[:, :, None], count, partial[:, None], site_norm, site_proj, MIX_EPS)
    assert float(jnp.max(weights)) > 0.5  # one source dominates: the scores matter
    ref = mixed[:, 0].astype(dtype)
    ref = rms_norm(ref, norm_weight, EPS) if norm else ref
    assert out.shape == ref.shape and out.dtype == ref.dtype
    tolerance = 1e-5 if dtype == jnp.float32 else 1e-2  # summation order; one bf16 ulp
    np.testing.assert_allclose(np.float32(out), np.float32(ref), rtol=tolerance, atol=tolerance)


def test_lowers_for_cuda_through_triton():
    """Pallas' Triton lowering of the kernel (padded, masked row), on the CPU."""
    f = lambda p, b, n, w: mix_norm(p, b, n, w, w, MIX_EPS, (w, EPS), interpret=False)
    args = [jax.ShapeDtypeStruct(s, d) for s, d in [((1, 2000), jnp.bfloat16), ((3, 1, 2000), jnp.bfloat16),
                                                    ((), jnp.int32), ((2000,), jnp.float32)]]
    assert "xla.gpu.triton" in jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_bad_inputs_are_refused():
    partial, w = jnp.zeros((2, 64)), jnp.ones((64,))
    with pytest.raises(ValueError, match=r"blocks \[N, M, D\]"):
        mix_norm(partial, jnp.zeros((3, 1, 64)), 1, w, w, MIX_EPS)
    with pytest.raises(ValueError, match="mix_proj_weight must hold D = 64"):
        mix_norm(partial, jnp.zeros((3, 2, 64)), 1, w, jnp.ones((32,)), MIX_EPS)
    with pytest.raises(ValueError, match="norm weight must hold D = 64"):
        mix_norm(partial, jnp.zeros((3, 2, 64)), 1, w, w, MIX_EPS, (jnp.ones((8,)), EPS))
    with pytest.raises(ValueError, match="count: give the number of valid blocks"):
        mix_norm(partial, jnp.zeros((3, 2, 64)), None, w, w, MIX_EPS)
    with pytest.raises(ValueError, match="give None with a sequence"):
        mix_norm(partial, [jnp.zeros((2, 64))], 1, w, w, MIX_EPS)
    with pytest.raises(ValueError, match=r"each be \[M, D\] = \(2, 64\)"):
        mix_norm(partial, [jnp.zeros((2, 64)), jnp.zeros((1, 64))], None, w, w, MIX_EPS)


@pytest.mark.parametrize("latent", [None, 16])
def test_moe_reads_a_depth_mix_as_its_value(latent):
    """A layer handed a ``DepthMix`` (what the decoder passes) computes what it computes on the mix's
    value; the MoE without a latent reads its normed input itself, so it takes the value first."""
    d = 24
    cfg = MoEConfig(num_experts=4, experts_per_token=2, num_shared_experts=1, intermediate_size=8, latent_size=latent)
    moe = MoE(d, cfg, activation("silu"), 1e-6, rngs=nnx.Rngs(0))
    keys = jax.random.split(jax.random.key(5), 4)
    mix = DepthMix(jax.random.normal(keys[0], (3, 2, 1, d)), 2, jax.random.normal(keys[1], (2, 1, d)),
                   1.0 + jax.random.normal(keys[2], (d,)), jax.random.normal(keys[3], (d,)), 1e-6)
    norm = RMSNorm(d, 1e-6)
    np.testing.assert_allclose(np.asarray(moe(mix, norm=norm)), np.asarray(moe(mix.value(), norm=norm)), rtol=1e-6,
                               atol=1e-6)


def test_project_mixes_many_rows_in_the_kernel(monkeypatch):
    """On the Pallas path a ``DepthMix`` of many rows (a prefill chunk's) reaches ``project`` as one mix + norm
    kernel (``MIX_KERNEL_ANY_ROWS``), whose maps equal XLA's mix, norm and einsum; off, XLA mixes."""
    from k3jax.implementation import use_implementation
    from k3jax.layers import basic

    blocks, partial, site_norm, site_proj, norm_weight = _inputs(12, jnp.float32, seed=9)
    new_mix = lambda: DepthMix(blocks.reshape(3, 2, 6, DEPTH), 2, partial.reshape(2, 6, DEPTH), site_norm, site_proj,
                               MIX_EPS)  # one per trace: a mix keeps its value once computed
    norm = RMSNorm(DEPTH, EPS)
    norm.weight.set_value(norm_weight)
    w = jax.random.normal(jax.random.key(4), (40, DEPTH)) * DEPTH**-0.5
    outs, kernels = {}, {}
    for on in (True, False):
        monkeypatch.setattr(basic, "MIX_KERNEL_ANY_ROWS", on)
        with use_implementation("pallas"):  # a fresh function below: the switch is read when traced
            f = lambda w: basic.project(new_mix(), [w], norm=norm)[0]
            kernels[on] = str(jax.make_jaxpr(f)(w)).count("name=mix_norm")
            outs[on] = jax.jit(f)(w)
    assert (kernels[True], kernels[False]) == (1, 0)
    want = jnp.einsum("btd,od->bto", rms_norm(new_mix().value(), norm_weight, EPS), w, precision="highest")
    for on in (True, False):
        np.testing.assert_allclose(np.asarray(outs[on]), np.asarray(want), rtol=1e-5, atol=1e-5)


def _mix_calls(jaxpr) -> list:
    """The operand shapes of every mix + norm kernel in a jaxpr, nested jaxprs (jit, scan) included."""
    calls = []
    for eqn in jaxpr.eqns:
        name = eqn.params.get("name") or getattr(eqn.params.get("name_and_src_info"), "name", "")  # JAX 0.10 / 0.11
        if eqn.primitive.name == "pallas_call" and name == "mix_norm":
            calls.append([v.aval.shape for v in eqn.invars])
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else [value]:
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    calls += _mix_calls(sub)
    return calls


@pytest.mark.parametrize("stored,scan_layers,tokens", [(True, False, 8), (True, False, 1), (False, False, 8),
                                                       (True, True, 8)])
def test_mix_kernels_read_the_stored_blocks(stored, scan_layers, tokens, monkeypatch):
    """With ``MIX_STORED_BLOCKS`` the unrolled model (a prompt, a decode step) hands every mix kernel the blocks it
    stored as [M, D] operands of their own; without it, or in a scan, each takes the stack and a count."""
    from k3jax import K3Model, model as model_module, preset, use_implementation

    monkeypatch.setattr(model_module, "MIX_STORED_BLOCKS", stored)
    cfg = preset("tiny")
    model = K3Model(cfg, rngs=nnx.Rngs(0))
    with use_implementation("pallas"):
        trace = jax.make_jaxpr(lambda t: model(t, scan_layers=scan_layers))(jnp.zeros((2, tokens), jnp.int32))
    calls = _mix_calls(trace)
    assert calls and (scan_layers or len(calls) == 2 * cfg.num_layers)  # a scanned group's body is traced once
    ranks = {max(len(shape) for shape in call) for call in calls}
    if stored and not scan_layers:
        # partial, blocks, site weights, norm weight: one operand more for each stored block
        assert ranks == {2} and max(map(len, calls)) == 4 + -(-cfg.num_layers // cfg.attn_res_block_size)
    else:
        assert ranks == {3}


def test_the_mix_kernel_takes_the_stored_blocks_where_known():
    """``_mix_blocks``: a mix that knows its stored blocks hands them over [M, D], no count; else the stack over
    [M, D] and the count."""
    from k3jax.layers.basic import _mix_blocks

    blocks, partial, site_norm, site_proj, _ = _inputs(6, jnp.float32, seed=3)
    stack = blocks.reshape(3, 2, 3, DEPTH)
    for count in (0, 2):
        stored = tuple(stack[:count])
        mix = DepthMix(stack, jnp.asarray(count), partial.reshape(2, 3, DEPTH), site_norm, site_proj, MIX_EPS, stored)
        given, none = _mix_blocks(mix.reshape(-1, DEPTH))
        assert none is None and len(given) == count
        for got, want in zip(given, blocks[:count]):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        plain = DepthMix(stack, jnp.asarray(count), mix.partial, site_norm, site_proj, MIX_EPS)
        got_stack, got_count = _mix_blocks(plain.reshape(-1, DEPTH))
        assert got_stack.shape == (3, 6, DEPTH) and int(got_count) == count


def test_the_model_hands_the_mixes_the_blocks_it_stored(monkeypatch):
    """The tiny model's logits (random mix queries) with ``MIX_STORED_BLOCKS`` equal those without, every mix going
    through ``mix_norm``'s interface (here an XLA stand-in taking a stack or a sequence, so the test runs the wiring:
    which arrays reach the kernel), the rest of the model on the reference path."""
    import pallas_kernels.depth_mix as depth_mix
    from conftest import build
    from k3jax import model as model_module
    from k3jax.layers import basic

    def stand_in(partial, blocks, count, site_norm, site_proj, mix_eps, norm):
        if count is None:  # a sequence: every block valid
            count, blocks = len(blocks), jnp.stack(list(blocks) or [jnp.zeros_like(partial)])
        mixed = attn_res_mix(blocks, count, partial, site_norm, site_proj, mix_eps)[0].astype(partial.dtype)
        return rms_norm(mixed, *norm)

    monkeypatch.setattr(depth_mix, "mix_norm", stand_in)
    monkeypatch.setattr(basic, "triton_kernels", lambda: True)
    built = build("tiny")
    tokens = jax.random.randint(jax.random.key(2), (2, 8), 0, built.cfg.vocab_size)
    logits = {}
    for stored in (True, False):
        monkeypatch.setattr(model_module, "MIX_STORED_BLOCKS", stored)
        logits[stored] = jax.jit(lambda t: built.model(t, scan_layers=False))(tokens)
    # the stand-in sums fewer sources in another order: float32 roundings, which this model amplifies to about
    # 1e-5; a wrong block (the stored partial scaled by 1.01) moves them by 3e-1
    err = float(jnp.linalg.norm(logits[True] - logits[False]) / jnp.linalg.norm(logits[False]))
    assert err < 1e-3, err
