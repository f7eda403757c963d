"""The oracle and CPU fallback of the AttnRes mix + norm kernel: ``k3jax.functional.attn_res`` (the
softmax over depth) and ``k3jax.functional.norms.rms_norm``."""

from k3jax.functional.attn_res import DepthMix, attn_res_mix
from k3jax.functional.norms import rms_norm


def mix_norm(mix: DepthMix, norm: tuple | None = None):
    """The mix's value (rounded to the partial's dtype), RMS-normed by ``norm`` = (weight, eps) when given."""
    x = mix.value()
    return x if norm is None else rms_norm(x, *norm)


__all__ = ["attn_res_mix", "mix_norm"]
