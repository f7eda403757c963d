"""The matvec op's entry (``pallas_kernels.matvec.ops.project``): on the Pallas path at one row the kernel
(interpret mode on CPU), the input prepared in its prologue and the addends in its epilogue, against the same
call on XLA (``KernelPolicy.matvec_max_rows = 0``); the inputs it keeps on XLA; the arguments it refuses. The
kernel itself: test_triton.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.functional.attn_res import DepthMix
from k3jax.functional.linear import Activated
from k3jax.functional.moe import situ
from k3jax.implementation import KernelPolicy, use_implementation
from pallas_kernels.matvec.ops import project


def _project_site(name, key):
    """project's arguments at one row for each input the kernel prepares: a shared expert's down
    projection (SiTU), the routed experts' float32 sums read as bf16 before the latent norm."""
    f32, bf16 = jnp.float32, jnp.bfloat16
    k = jax.random.split(key, 5)
    normal = lambda i, shape, dtype, scale=1.0: (scale * jax.random.normal(k[i], shape, f32)).astype(dtype)

    def rms(width):  # an RMS norm's (weight, eps)
        return (1.0 + 0.1 * normal(4, (width,), f32)).astype(bf16), 1e-5

    if name == "shared_expert":
        return (Activated(situ, normal(0, (1, 1, 72), bf16, 4.0), normal(2, (1, 1, 72), bf16, 4.0)),
                [normal(1, (20, 72), bf16)]), {}
    if name == "residual_adds":
        return (normal(0, (1, 1, 64), bf16), [normal(1, (20, 64), bf16)]), dict(
            add=(normal(2, (1, 1, 20), bf16, 8.0), normal(3, (1, 1, 20), bf16, 8.0)))
    return (normal(0, (1, 1, 64), f32, 3.0), [normal(1, (20, 64), bf16)], None, rms(64)), dict(read_as=bf16)


@pytest.mark.parametrize("name", ["shared_expert", "latent_up", "residual_adds"])
def test_project_kernel_prologue_equals_xla(name):
    """project on the Pallas path at one row (the matvec kernel, the input prepared in its prologue,
    addends in its epilogue) against the same call on XLA (``matvec_max_rows = 0``): equal up to one bf16 ulp."""
    args, kwargs = _project_site(name, jax.random.key(len(name)))
    with use_implementation("pallas"):
        assert "pallas_call" in str(jax.make_jaxpr(lambda: project(*args, **kwargs))())
        got = project(*args, **kwargs)[0]
    with use_implementation("pallas", policy=KernelPolicy(matvec_max_rows=0)):
        assert "pallas_call" not in str(jax.make_jaxpr(lambda: project(*args, **kwargs))())
        want = project(*args, **kwargs)[0]
    assert got.shape == want.shape == (1, 1, 20) and got.dtype == want.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.float32(got), np.float32(want), rtol=1e-2, atol=1e-2)


def test_project_keeps_a_wide_activation_on_xla():
    """An ``Activated`` wider than ``KernelPolicy.activation_in_matvec_max_width`` is not computed in the
    kernel's prologue (measured slower): project traces XLA's act and einsum, no kernel."""
    width = KernelPolicy().activation_in_matvec_max_width + 32
    x = Activated(situ, jnp.ones((1, 1, width), jnp.bfloat16), jnp.ones((1, 1, width), jnp.bfloat16))
    with use_implementation("pallas"):
        jaxpr = str(jax.make_jaxpr(lambda: project(x, [jnp.ones((8, width), jnp.bfloat16)]))())
    assert "pallas_call" not in jaxpr and "dot_general" in jaxpr


def test_project_refuses_bad_inputs():
    x = jnp.zeros((2, 64), jnp.bfloat16)
    w = jnp.zeros((8, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="read_as applies to an array"):
        project(DepthMix(jnp.zeros((1, 2, 64)), 0, x, jnp.ones((64,)), jnp.ones((64,)), 1e-6), [w], read_as=jnp.float32)
    with pytest.raises(ValueError, match="add needs exactly one weight"):
        project(x, [w, w], add=(jnp.zeros((2, 8), jnp.bfloat16),))
