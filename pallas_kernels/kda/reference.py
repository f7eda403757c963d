"""The oracle and CPU fallback for the KDA kernels: ``k3jax.functional.kda`` and ``k3jax.functional.conv``
(the short convs), plus the fused-input contract composed from the same functions.

Fused inputs (what the KDA layer has before its gates): raw q, k [B, T, H, K] (not normalized), v
[B, T, H, V], z [B, T, H, K] (the f_b_proj output), a_log [H], dt_bias [H, K], beta logits [B, T, H].
"""

from __future__ import annotations

from k3jax.functional.conv import short_convs
from k3jax.functional.kda import chunk_kda, gated_kda, gates, recurrent_kda, step_kda


def fused_inputs(q, k, z, a_log, dt_bias, beta_logits, lower_bound):
    """(q, k, g, beta) of the plain contract from the fused inputs: L2 norms, K3's bounded gate,
    sigmoid of beta. All float32."""
    return gates(q, k, z, a_log, dt_bias, beta_logits, lower_bound)


def chunk_kda_fused(q, k, v, z, a_log, dt_bias, beta_logits, lower_bound=-5.0,
                    initial_state=None, scale=None):
    """Chunked KDA from fused inputs. Returns (o float32 [B, T, H, V], state float32 [B, H, K, V])."""
    q, k, g, beta = fused_inputs(q, k, z, a_log, dt_bias, beta_logits, lower_bound)
    return chunk_kda(q, k, v, g, beta, initial_state, scale)


__all__ = ["gated_kda", "gates", "short_convs", "chunk_kda", "recurrent_kda", "step_kda", "fused_inputs", "chunk_kda_fused"]
