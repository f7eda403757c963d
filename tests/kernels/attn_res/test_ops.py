"""The AttnRes mix + RMSNorm kernel (pallas_kernels/attn_res/triton.py, interpret mode on CPU) against
``attn_res_mix`` rounded to the partial's dtype, then ``rms_norm``; the op's choice of it for many rows
(``KernelPolicy.mix_kernel_any_rows``); a layer reading a ``DepthMix``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax.config import MoEConfig
from k3jax.functional.attn_res import DepthMix, attn_res_mix
from k3jax.functional.norms import rms_norm
from k3jax.implementation import KernelPolicy, use_implementation
from k3jax.layers.basic import RMSNorm, norm_params
from k3jax.layers.mlp import activation
from k3jax.layers.moe import MoE
from pallas_kernels.attn_res.triton import mix_norm
from pallas_kernels.matvec.ops import project

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
def test_mix_norm_matches_mix_then_norm(m, count, dtype, norm):
    """Blocks past ``count`` hold random values the mix must ignore."""
    blocks, partial, site_norm, site_proj, norm_weight = _inputs(m, dtype, seed=m + count)
    rms = (norm_weight, EPS) if norm else None
    out = mix_norm(partial, blocks, count, site_norm, site_proj, MIX_EPS, rms)
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


def test_project_mixes_many_rows_in_the_kernel():
    """On the Pallas path a ``DepthMix`` of many rows (a prefill chunk's) reaches ``project`` as one mix + norm
    kernel (``KernelPolicy.mix_kernel_any_rows``), whose maps equal XLA's mix, norm and einsum; off, XLA mixes."""
    blocks, partial, site_norm, site_proj, norm_weight = _inputs(12, jnp.float32, seed=9)
    new_mix = lambda: DepthMix(blocks.reshape(3, 2, 6, DEPTH), 2, partial.reshape(2, 6, DEPTH), site_norm, site_proj,
                               MIX_EPS)  # one per trace: a mix keeps its value once computed
    norm = RMSNorm(DEPTH, EPS)
    norm.weight.set_value(norm_weight)
    w = jax.random.normal(jax.random.key(4), (40, DEPTH)) * DEPTH**-0.5
    outs, kernels = {}, {}
    for on in (True, False):
        with use_implementation("pallas", policy=KernelPolicy(mix_kernel_any_rows=on)):
            # a fresh function below: the policy is read when traced
            f = lambda w: project(new_mix(), [w], norm=norm_params(norm))[0]
            kernels[on] = str(jax.make_jaxpr(f)(w)).count("name=mix_norm")
            outs[on] = jax.jit(f)(w)
    assert (kernels[True], kernels[False]) == (1, 0)
    want = jnp.einsum("btd,od->bto", rms_norm(new_mix().value(), norm_weight, EPS), w, precision="highest")
    for on in (True, False):
        np.testing.assert_allclose(np.asarray(outs[on]), np.asarray(want), rtol=1e-5, atol=1e-5)
