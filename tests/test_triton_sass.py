"""benchmarks/triton_sass.py's capture of the Pallas Triton kernels a function lowers to (the part that needs
no triton package: each kernel's Triton IR and launch options, read from JAX's CUDA lowering on the CPU)."""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from triton_sass import lowered_kernels  # noqa: E402


def test_lowered_kernels_carry_their_ir_and_launch_options():
    from pallas_kernels.matvec import MatvecBlocks, matvecs

    blocks = MatvecBlocks(bn=8, bk=256, num_warps=2, num_stages=4)
    fn = lambda x, w: matvecs(x, [w], [jnp.float32], blocks=blocks, interpret=False)
    x, w = jax.ShapeDtypeStruct((1, 512), jnp.bfloat16), jax.ShapeDtypeStruct((64, 512), jnp.bfloat16)
    (kernel,) = lowered_kernels(fn, x, w)
    assert kernel.name == "matvecs" and (kernel.num_warps, kernel.num_stages) == (2, 4)
    assert kernel.ir.startswith("module") and "tt.func" in kernel.ir and "tt.load" in kernel.ir
    (again,) = lowered_kernels(fn, x, w)  # lowered anew, not taken from JAX's caches unseen
    assert again.ir == kernel.ir


def test_a_function_without_pallas_kernels_is_refused():
    with pytest.raises(ValueError, match="no Pallas Triton kernel"):
        lowered_kernels(lambda x: x * 2, jax.ShapeDtypeStruct((4,), jnp.float32))


def test_each_pallas_call_is_one_kernel():
    from pallas_kernels.mx_matmul import fused_moe_mx_split
    from k3jax.functional.moe import situ
    from k3jax.mx import MXTensor

    E, F, R, k = 4, 64, 256, 2
    w1, w2 = MXTensor.quantize(jnp.ones((E, F, R))), MXTensor.quantize(jnp.ones((E, R, F)))
    fn = lambda x, weights, experts: fused_moe_mx_split(x, w1, w1, w2, weights, experts, situ, interpret=False)
    args = [jax.ShapeDtypeStruct((1, R), jnp.bfloat16), jax.ShapeDtypeStruct((1, k), jnp.float32),
            jax.ShapeDtypeStruct((1, k), jnp.int32)]
    assert [kernel.name for kernel in lowered_kernels(fn, *args)] == ["fused_moe_hidden", "fused_moe_down"]
