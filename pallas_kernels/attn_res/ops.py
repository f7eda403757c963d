"""The Block AttnRes op's entry for the layers: a mix site's value, normed for the layer that reads it.

    mix_norm(mix, norm=None) -> [..., D]

``mix`` is a ``k3jax.functional.attn_res.DepthMix`` (stored blocks, the partial sum, the site's query);
``norm`` = (weight [D], eps) the reading layer's RMS norm. The reference mixes in float32 and norms
after; on the Pallas path off TPU one Triton kernel (``triton.py``) does both, at every number of rows
by ``KernelPolicy.mix_kernel_any_rows`` (the matvec op always takes it where its own kernel reads the mix).
The kernel's gradient is the reference's (``pallas_kernels._autodiff.with_reference_gradient``).
"""

from __future__ import annotations

from k3jax.functional.attn_res import DepthMix
from k3jax.implementation import current
from k3jax.typing import Array
from pallas_kernels import _platform
from pallas_kernels._autodiff import with_reference_gradient
from pallas_kernels.attn_res import reference
from pallas_kernels.attn_res.triton import mix_norm as mix_norm_rows


def mix_norm_kernel(mix: DepthMix, norm: tuple | None = None) -> Array:
    """``mix_norm`` by the kernel, whatever the policy: the mix's rows [M, D] in one call; the gradient the
    reference's."""
    rows = mix.reshape(-1, mix.shape[-1])
    out = with_reference_gradient(mix_norm_rows, _reference_rows)(
        rows.partial, rows.blocks, rows.n_blocks, rows.norm_weight, rows.proj_weight, rows.eps, norm)
    return out.reshape(mix.shape)


def _reference_rows(partial, blocks, n_blocks, norm_weight, proj_weight, eps, norm):
    """``reference.mix_norm`` with the kernel's arguments."""
    return reference.mix_norm(DepthMix(blocks, n_blocks, partial, norm_weight, proj_weight, eps), norm)


def mix_norm(mix: DepthMix, norm: tuple | None = None) -> Array:
    """The mix [..., D] in the partial's dtype, RMS-normed by ``norm`` when given (reference or kernel)."""
    choice = current()
    if choice.name == "pallas" and not _platform.on_tpu() and choice.policy.mix_kernel_any_rows:
        return mix_norm_kernel(mix, norm)
    return reference.mix_norm(mix, norm)


__all__ = ["mix_norm", "mix_norm_kernel"]
