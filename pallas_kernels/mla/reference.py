"""The oracle and CPU fallback of the MLA kernels: ``k3jax.functional.mla`` (the latent cache write, the
absorbed attention over the cache, the expanded causal attention)."""

from k3jax.functional.mla import cached_attention, latent_causal_attention, mla_expand, write_latents

__all__ = ["cached_attention", "latent_causal_attention", "mla_expand", "write_latents"]
