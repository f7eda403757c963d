"""Gated MLA: the latent cache write and the prefill flash attention over expanded latents. ``ops`` is
the entry."""

from pallas_kernels.mla.ops import cached_attention, latent_causal_attention, write_latents

__all__ = ["cached_attention", "latent_causal_attention", "write_latents"]
