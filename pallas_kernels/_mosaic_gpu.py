"""What the Mosaic GPU kernels (KDA, MX matmul) share across JAX versions."""

from __future__ import annotations

from jax.experimental.pallas import mosaic_gpu as plgpu


def interpret_params():
    """Mosaic GPU's interpret mode parameters (CPU): ``plgpu.InterpretGPUParams`` in JAX 0.11; JAX
    0.10 has the class only under ``jax._src``."""
    if hasattr(plgpu, "InterpretGPUParams"):
        return plgpu.InterpretGPUParams()
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams()


def interpret_argument(interpret: bool):
    """The Mosaic GPU kernels' ``interpret`` argument: ``interpret_params()`` in interpret mode, else False."""
    return interpret_params() if interpret else False
