"""What inference needs in memory: weights (as stored), the KDA states (fixed per sequence) and the
MLA latent cache (growing with context)."""

from __future__ import annotations

from typing import NamedTuple

from k3jax.arguments import integer
from k3jax.config import K3Config
from k3jax.param_count import count_params

MXFP4_BYTES = 0.5 + 1 / 32  # a 4-bit code per element plus one E8M0 byte per 32-element block


class MemoryEstimate(NamedTuple):
    weights: float  # bytes, routed experts in MXFP4 (if the config says so), the rest bf16
    kda_state_per_seq: float  # float32 [H, K, V] state + 3 short-conv inputs per channel, all KDA layers
    mla_cache_per_token: float  # c_kv + k_pe per token, all MLA layers, in cache_bytes per value
    context: int
    batch: int

    @property
    def per_sequence(self) -> float:
        return self.kda_state_per_seq + self.mla_cache_per_token * self.context

    @property
    def total(self) -> float:
        return self.weights + self.batch * self.per_sequence


def estimate(cfg: K3Config, context: int, batch: int = 1, cache_bytes: int = 2) -> MemoryEstimate:
    """Bytes for ``batch`` sequences of ``context`` tokens, MLA latents stored in ``cache_bytes`` per value; each of
    the three a positive integer (TypeError or ValueError naming it otherwise)."""
    context, batch = integer("context", context, minimum=1), integer("batch", batch, minimum=1)
    cache_bytes = integer("cache_bytes", cache_bytes, minimum=1)
    counts = count_params(cfg)
    expert_bytes = MXFP4_BYTES if cfg.mx_experts else 2
    weights = (counts.total - counts.routed_experts) * 2 + counts.routed_experts * expert_bytes
    n_kda, n_mla = cfg.layer_types.count("kda"), cfg.layer_types.count("mla")
    k = cfg.kda
    width = k.num_heads * k.head_dim
    kda_state = n_kda * 4 * (k.num_heads * k.head_dim * k.head_dim + 3 * (k.conv_size - 1) * width)
    mla_token = n_mla * cache_bytes * (cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim)
    return MemoryEstimate(weights, kda_state, mla_token, context, batch)


def _gib(n: float) -> str:
    return f"{n / 2**30:,.2f} GiB"


def report(cfg: K3Config, context: int, batch: int = 1, cache_bytes: int = 2) -> str:
    """``estimate``'s numbers as a table in GiB, one line each."""
    m = estimate(cfg, context, batch, cache_bytes)
    return "\n".join([
        f"{cfg.name}: context {context:,} tokens, batch {batch}",
        f"  weights                  {_gib(m.weights)}  (routed experts {'MXFP4' if cfg.mx_experts else 'bf16'}, rest bf16)",
        f"  KDA state per sequence   {_gib(m.kda_state_per_seq)}  (fixed: float32 state + conv inputs)",
        f"  MLA cache per sequence   {_gib(m.mla_cache_per_token * context)}  "
        f"({m.mla_cache_per_token:,.0f} bytes per token, grows with context)",
        f"  caches per sequence      {_gib(m.per_sequence)}",
        f"  caches for the batch     {_gib(batch * m.per_sequence)}",
        f"  total                    {_gib(m.total)}",
        "  (Block AttnRes keeps nothing across tokens: it mixes over depth, per token.)",
    ])


__all__ = ["MemoryEstimate", "estimate", "report"]
