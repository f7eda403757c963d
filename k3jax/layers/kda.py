"""The KDA layer (Kimi Delta Attention, spec section 3) as a Flax NNX module."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax.config import KDAConfig
from k3jax.functional import kda as F
from k3jax.functional.conv import causal_conv, last_inputs
from k3jax.functional.norms import gated_rms_norm
from k3jax.implementation import get_implementation, triton_kernels
from k3jax.layers.basic import Linear, RMSNorm, Rngs, normal, project, takes_matvec_kernel
from k3jax.typing import Array


class KDAState(NamedTuple):
    """What a sequence carries between calls: the short convs' last W-1 inputs [B, W-1, 3*H*K] (q, k,
    v channels side by side: one buffer, so a decode step updates it in one kernel) and the state
    [B, H, K, V]."""

    conv: Array
    recurrent: Array


def _kda_core(q, k, v, g, beta, state, bounded: bool):
    """Chunked form for prompts, the one-step recurrence for T = 1; Pallas when the switch says so
    (the chunked kernel needs the bounded gate; an unbounded one runs the reference)."""
    pallas = get_implementation() == "pallas"
    if pallas:
        from pallas_kernels import kda as kernels
    if q.shape[1] == 1:
        if pallas:
            o, state = kernels.step_kda(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state)
            return o[:, None], state
        return F.recurrent_kda(q, k, v, g, beta, state)
    if pallas:
        return kernels.chunk_kda(q, k, v, g, beta, state, safe_gate=bounded)
    return F.chunk_kda(q, k, v, g, beta, state)


def _kda_core_fused(q, k, v, z, a_log, dt_bias, beta_logits, state, lower_bound: float):
    """The Pallas kernels that take the raw inputs (q/k L2 norms, bounded gate, beta sigmoid inside):
    the chunked kernel for prompts, the decode kernel for T = 1. Padding is masked by the caller
    (z and beta_logits at -inf give g = 0 and beta = 0)."""
    from pallas_kernels import kda as kernels

    if q.shape[1] == 1:
        o, state = kernels.step_kda_fused(q[:, 0], k[:, 0], v[:, 0], z[:, 0], a_log, dt_bias, beta_logits[:, 0],
                                          state, lower_bound)
        return o[:, None], state
    return kernels.chunk_kda_fused(q, k, v, z, a_log, dt_bias, beta_logits, lower_bound, state)


# Whether a batch-1 decode step's short convs and SiLU run inside the matvec kernel of the layer's input maps
# (``project``'s ``conv``), the conv kernel and its launch off the step's chain: on the H200 the `mini` step took
# 0.897 against 0.910 ms (medians of 25 rounds; best 0.868 against 0.878; medians tied in a second run of 15), the
# logits bitwise equal (benchmarks/RESULTS.md, issue 4, twenty-first session). "conv kernel" in
# benchmarks/decode_variants.py turns it off. Read at the call.
CONV_IN_MAPS = True
# Whether the Pallas path off TPU runs a prefill chunk's short convs and SiLU in one kernel (``pallas_kernels.
# short_conv.conv_silu_chunk``), not XLA's fusion: at a 2048-token `mini` chunk on the H200 the kernel took 44-45 us a
# KDA layer against 48-77 for the fusion (410 against 553 us a chunk), and an 8K prompt in one chunk 53.8 against 57.1
# ms (best of five rounds; the rounds spread over 54-69) (benchmarks/RESULTS.md, issue 4, thirtieth and thirty-first
# sessions). "short convs by XLA" in benchmarks/prefill_variants.py turns it off. Read when traced.
CONV_KERNEL_AT_PREFILL = True


def _input_states(xs, state) -> list:
    """Each input's channels of the conv state [B, W - 1, n F] (the inputs' channels side by side)."""
    ends = np.cumsum([x.shape[-1] for x in xs])
    return [state[..., end - x.shape[-1]:end] for x, end in zip(xs, ends)]


def _short_convs_xla(xs, taps, state, lengths):
    """silu of the causal short convs of q, k, v [B, T, F] (``causal_conv`` on each, with its channels
    of the state [B, W - 1, 3 F]; no concatenated copy of the inputs) and the new conv state."""
    ys, states = [], []
    for x, w, s in zip(xs, taps, _input_states(xs, state)):
        y, s = causal_conv(x, w, s, lengths)
        ys.append(jax.nn.silu(y))
        states.append(s)
    return (*ys, jnp.concatenate(states, axis=-1))


def _short_convs(xs, taps, state, lengths):
    """``_short_convs_xla``, or on the Pallas path off TPU: for a decode step (T = 1, no padding) one kernel that
    also updates the state in place; for a prefill chunk (``CONV_KERNEL_AT_PREFILL``) one kernel for the convs
    and their SiLU, the state after them by XLA (``pallas_kernels.short_conv``)."""
    if not triton_kernels():
        return _short_convs_xla(xs, taps, state, lengths)
    from pallas_kernels.short_conv import conv_silu_chunk, conv_silu_step

    if xs[0].shape[1] == 1 and lengths is None:
        ys, state = conv_silu_step([x[:, 0] for x in xs], taps, state)
        return (*(y[:, None] for y in ys), state)
    if not CONV_KERNEL_AT_PREFILL:
        return _short_convs_xla(xs, taps, state, lengths)
    states = [last_inputs(x.astype(jnp.float32), s, lengths) for x, s in zip(xs, _input_states(xs, state))]
    return (*conv_silu_chunk(xs, taps, state), jnp.concatenate(states, axis=-1))


class ShortConv(nnx.Module):
    """A causal depthwise conv's weight over W taps, [F, 1, W] float32 as released. The KDA layer runs
    its three (q, k, v) as one conv over the channels side by side (``causal_conv``)."""

    def __init__(self, width: int, taps: int, *, rngs: Rngs):
        self.weight = nnx.Param(normal(rngs, (width, 1, taps), taps**-0.5))


class KDA(nnx.Module):
    """x [B, T, D] -> [B, T, D]. Parameter names follow the released ``self_attn.*`` tensors."""

    def __init__(self, dim: int, cfg: KDAConfig, eps: float, *, rngs: Rngs, param_dtype=jnp.float32):
        H, K, W = cfg.num_heads, cfg.head_dim, cfg.conv_size
        width = H * K
        self.num_heads, self.head_dim, self.eps = H, K, eps
        self.lower_bound = cfg.gate_lower_bound
        lin = lambda i, o: Linear(i, o, rngs=rngs, param_dtype=param_dtype)
        self.q_proj, self.k_proj, self.v_proj = lin(dim, width), lin(dim, width), lin(dim, width)
        conv = lambda: ShortConv(width, W, rngs=rngs)
        self.q_conv1d, self.k_conv1d, self.v_conv1d = conv(), conv(), conv()
        self.f_a_proj, self.f_b_proj = lin(dim, K), lin(K, width)
        self.b_proj = lin(dim, H)
        self.A_log = nnx.Param(jnp.log(1.0 + 15.0 * jax.nn.sigmoid(normal(rngs, (H,), 1.0))))
        self.dt_bias = nnx.Param(normal(rngs, (width,), 1.0))
        if cfg.full_rank_gate:
            self.g_proj = lin(dim, width)
        else:
            self.g_a_proj, self.g_b_proj = lin(dim, K), lin(K, width)
        self.o_norm = RMSNorm(K, eps, param_dtype=param_dtype)
        self.o_proj = lin(width, dim)

    def initial_state(self, batch: int) -> KDAState:
        width = self.num_heads * self.head_dim
        conv = jnp.zeros((batch, self.q_conv1d.weight.shape[-1] - 1, 3 * width), jnp.float32)
        rec = jnp.zeros((batch, self.num_heads, self.head_dim, self.head_dim), jnp.float32)
        return KDAState(conv, rec)

    def __call__(
        self, x: Array, state: KDAState | None = None, valid: Array | None = None, norm: RMSNorm | None = None,
        residual: Array | None = None,
    ) -> tuple[Array, KDAState]:
        """x [B, T, D] (RMS-normed by ``norm`` first, when given) -> (out [B, T, D], plus ``residual`` when
        given; state after the tokens). ``valid`` [B, T] marks real tokens (a prefix of each row; the rest
        is right padding that leaves the state untouched)."""
        B, T, _ = x.shape
        H, K = self.num_heads, self.head_dim
        state = self.initial_state(B) if state is None else state
        lengths = None if valid is None else jnp.sum(valid, axis=1, dtype=jnp.int32)
        heads = lambda a: a.reshape(B, T, H, K)
        gate_in = self.g_proj if hasattr(self, "g_proj") else self.g_a_proj
        maps = (self.q_proj, self.k_proj, self.v_proj, self.f_a_proj, self.b_proj, gate_in)
        weights = [m.weight[...] for m in maps]
        taps = [c.weight[...][:, 0].astype(jnp.float32) for c in (self.q_conv1d, self.k_conv1d, self.v_conv1d)]
        if CONV_IN_MAPS and lengths is None and T == 1 and takes_matvec_kernel(x, weights):
            q, k, v, f_a, beta_logits, gate, conv = project(x, weights, norm=norm, conv=(taps, state.conv))
        else:
            q, k, v, f_a, beta_logits, gate = project(x, weights, norm=norm)
            q, k, v, conv = _short_convs((q, k, v), taps, state.conv, lengths)
        q, k, v = (heads(a) for a in (q, k, v))
        z = heads(self.f_b_proj(f_a))
        a_log, dt_bias = self.A_log[...], self.dt_bias[...].reshape(H, K)
        if self.lower_bound is not None and get_implementation() == "pallas":
            if valid is not None:  # padding neither decays nor writes the state: g = 0, beta = 0
                z = jnp.where(valid[:, :, None, None], z, -jnp.inf)
                beta_logits = jnp.where(valid[:, :, None], beta_logits, -jnp.inf)
            o, rec = _kda_core_fused(q, k, v, z, a_log, dt_bias, beta_logits, state.recurrent, self.lower_bound)
        else:
            o, rec = self._gates_then_core(q, k, v, z, a_log, dt_bias, beta_logits, state.recurrent, valid)
        gate = gate if hasattr(self, "g_proj") else self.g_b_proj(gate)
        o = gated_rms_norm(o, heads(gate), self.o_norm.weight[...], self.eps).astype(x.dtype)
        add = () if residual is None else (residual,)
        return project(o.reshape(B, T, H * K), [self.o_proj.weight[...]], add=add)[0], KDAState(conv, rec)

    def _gates_then_core(self, q, k, v, z, a_log, dt_bias, beta_logits, state, valid):
        """Norms and gates in plain JAX, then the plain (q, k, v, g, beta) contract."""
        q, k = F.l2_normalize(q), F.l2_normalize(k)
        if self.lower_bound is None:
            g = F.softplus_gate(z, a_log, dt_bias)
        else:
            g = F.bounded_gate(z, a_log, dt_bias, self.lower_bound)
        beta = jax.nn.sigmoid(beta_logits.astype(jnp.float32))
        if valid is not None:  # padding neither decays nor writes the state
            g = jnp.where(valid[:, :, None, None], g, 0.0)
            beta = jnp.where(valid[:, :, None], beta, 0.0)
        return _kda_core(q, k, v, g, beta, state, bounded=self.lower_bound is not None)


__all__ = ["KDA", "KDAState", "ShortConv"]
