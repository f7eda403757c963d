"""The fused decode MoE with the expert selection inside (``routed_moe_mx``, interpret mode on CPU)
against the reference selection (k3jax.functional.moe.select_experts) then ``fused_moe_mx``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.functional.moe import moe_dense, select_experts, situ
from k3jax.mx import MXTensor
from pallas_kernels.mx_matmul import fused_moe_mx
from pallas_kernels.mx_matmul.moe import routed_moe_mx
from reference_numpy import rel_err

E, F, R, K = 12, 64, 64, 3  # E pads to 16 in the kernel; F: two programs of 32 hidden units
TIED = jnp.array([2, 5, 7, 9])  # token 2's four equal best scores: top 3 are the lower indices 2, 5, 7


@pytest.fixture(scope="module")
def stacks():
    keys = jax.random.split(jax.random.key(30), 3)
    w1, w3 = (MXTensor.quantize(jax.random.normal(kk, (E, F, R)) * R**-0.5) for kk in keys[:2])
    return w1, w3, MXTensor.quantize(jax.random.normal(keys[2], (E, R, F)) * F**-0.5)


@pytest.fixture(scope="module")
def router():
    """Logits [3, E]: two random tokens, and a third whose experts TIED tie (equal logits, zero bias)."""
    kl, kb = jax.random.split(jax.random.key(31))
    logits = 2.0 * jax.random.normal(kl, (3, E), jnp.float32)
    logits = logits.at[2].set(jnp.where(jnp.isin(jnp.arange(E), TIED), 3.0, -3.0))
    bias = (0.3 * jax.random.normal(kb, (E,), jnp.float32)).at[TIED].set(0.0)
    return logits, bias


@pytest.mark.parametrize("renormalize", [True, False])
def test_routed_equals_select_then_fused(stacks, router, renormalize):
    """Same experts (ties included), weights equal to float32 rounding, so the same sums; and both
    equal every expert on every token combined by the reference weights (float32, decoded weights)."""
    logits, bias = router
    x = jax.random.normal(jax.random.key(32), (3, R), jnp.float32).astype(jnp.bfloat16).astype(jnp.float32)
    weights, experts = select_experts(logits, bias, K, renormalize, 2.5)
    np.testing.assert_array_equal(experts[2], TIED[:K])
    out = routed_moe_mx(x, *stacks, logits, bias, K, renormalize, 2.5, situ)
    ref = fused_moe_mx(x, *stacks, weights, experts, situ)
    assert out.shape == (3, R) and out.dtype == jnp.float32
    assert rel_err(out, ref) < 1e-6
    dense = moe_dense(x, *(w.decode(jnp.float32) for w in stacks), weights, experts, situ)
    assert rel_err(out, dense) < 1e-5


def test_x_is_rounded_to_bf16_inside(stacks, router):
    """float32 x that bf16 does not hold gives what its bf16 rounding (held in float32) gives."""
    logits, bias = router
    x = jax.random.normal(jax.random.key(33), (3, R), jnp.float32)
    rounded = x.astype(jnp.bfloat16).astype(jnp.float32)
    assert not jnp.array_equal(x, rounded)
    run = lambda x: routed_moe_mx(x, *stacks, logits, bias, K, True, 2.5, situ)
    np.testing.assert_array_equal(run(x), run(rounded))


def test_routed_lowers_for_cuda_through_triton(stacks):
    """Pallas' Triton lowering of the routed entry (selection over 16 padded lanes), on the CPU."""
    fn = lambda x, logits, bias: routed_moe_mx(x, *stacks, logits, bias, K, True, 2.5, situ, interpret=False)
    args = [jax.ShapeDtypeStruct((1, R), jnp.bfloat16), jax.ShapeDtypeStruct((1, E), jnp.float32),
            jax.ShapeDtypeStruct((E,), jnp.float32)]
    assert "xla.gpu.triton" in jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_bad_router_is_refused(stacks, router):
    logits, bias = router
    with pytest.raises(ValueError, match="must be"):
        routed_moe_mx(jnp.ones((2, R)), *stacks, logits, bias, K, True, 1.0, situ)
    with pytest.raises(ValueError, match="k = 13"):
        routed_moe_mx(jnp.ones((3, R)), *stacks, logits, bias, 13, True, 1.0, situ)
