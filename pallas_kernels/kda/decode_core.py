"""A KDA layer's decode step between its two projections, as one Triton kernel.

At one token per sequence the KDA layer runs, between its input maps and o_proj, four kernels: the short
convs with SiLU (``pallas_kernels.short_conv``), z = f_b_proj(f_a) (an XLA einsum), the recurrent step
(``decode_step``) and the gated output norm (an XLA fusion). ``decode_core`` does all four in one kernel,
one program per (sequence, head) holding the head's K key and V value channels:

1. the causal short convs of its q, k and v channels with SiLU, the conv state moved up one token in place
   (``pallas_kernels.short_conv``'s ``load_conv_channels`` and ``conv_silu_update``, the conv kernel's own
   code; each channel has one owner program);
2. z of its K gate channels = f_b's K rows times f_a, summed in float32, rounded to f_a's dtype (as the
   layer's ``Linear`` einsum returns it);
3. the step of ``decode_step`` with the fused gate (q, k L2 norms, the bounded gate from z, sigmoid of
   beta's logit), its state block [K, V] updated in place;
4. ``gated_rms_norm(o, gate, weight, eps)`` over the head's V outputs, rounded to ``out_dtype``.

So a KDA layer's decode step is four kernels (the AttnRes mix and norm, the input maps, this, o_proj)
instead of seven. A candidate of issue 4 (the batch-1 step has ~190 kernels, each boundary 1.1-1.4 us):
``k3jax.layers.kda.DECODE_CORE_KERNEL``, timed by ``benchmarks/decode_variants.py``. Interpret mode on CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from k3jax.implementation import pallas_interpret
from k3jax.typing import Array
from pallas_kernels._triton import triton_params
from pallas_kernels.kda.kernel import _decode_update, _sigmoid
from pallas_kernels.short_conv import conv_silu_update, load_conv_channels

_F32 = jnp.float32
DEFAULT_WARPS = 16  # the eighth session's fastest form of step + z + norm in one program per head (RESULTS)


def _core_kernel(q_ref, k_ref, v_ref, q_taps, k_taps, v_taps, f_a_ref, f_b_ref, beta_ref, gate_ref, a_ref, dtb_ref,
                 weight_ref, conv_in, state_in, o_ref, conv_ref, state_ref, *, scale: float, lower_bound: float,
                 eps: float):
    """Program (sequence b, head h). conv_in / state_in are conv_ref / state_ref's buffers (aliased): the
    state is read and written through the output refs, so loads and stores keep their program order."""
    del conv_in, state_in
    b, h = pl.program_id(0), pl.program_id(1)
    K, V = q_ref.shape[0], v_ref.shape[0]
    F = q_taps.shape[0]
    # Every load first: a load written after a reduction (z's, the L2 norms') waits for its barrier, so the
    # state's and f_b's DRAM reads would otherwise start only when the convs and z are done.
    state, f_b, f_a = state_ref[...], f_b_ref[...], f_a_ref[...]
    beta, gate, gates, weight = beta_ref[...], gate_ref[...], (a_ref[...], dtb_ref[...]), weight_ref[...]
    convs = [(x_ref[...], load_conv_channels(taps, conv_ref, b, first, h * n, n), first, n)
             for x_ref, taps, first, n in ((q_ref, q_taps, 0, K), (k_ref, k_taps, F, K), (v_ref, v_taps, 2 * F, V))]
    q, k, v = (conv_silu_update(x.astype(_F32), loaded, conv_ref, b, first, h * n, n) for x, loaded, first, n in convs)
    z = jnp.sum(f_b.astype(_F32) * f_a.astype(_F32)[None, :], axis=1)
    z = z.astype(f_a.dtype).astype(_F32)
    o, state_ref[...] = _decode_update(q, k, v, z, beta, state, gates, scale=scale, lower_bound=lower_bound)
    normed = o * jax.lax.rsqrt(jnp.mean(o * o) + eps) * weight.astype(_F32)
    o_ref[...] = (normed * _sigmoid(gate.astype(_F32))).astype(o_ref.dtype)


def decode_core(q: Array, k: Array, v: Array, taps: tuple[Array, Array, Array], conv: Array, f_a: Array, f_b: Array,
                beta_logits: Array, gate: Array, a_log: Array, dt_bias: Array, norm_weight: Array, state: Array, *,
                eps: float, lower_bound: float, out_dtype, scale: float | None = None,
                warps: int = DEFAULT_WARPS, interpret: bool | None = None) -> tuple[Array, Array, Array]:
    """One token per sequence, from the input maps' outputs to o_proj's input.

    q, k [B, H K] and v [B, H V] (before the convs; any float dtype); taps: the q, k, v convs' float32
    [H K or H V, W]; conv float32 [B, W - 1, 2 H K + H V] (the three inputs' last W - 1 tokens side by
    side); f_a [B, R] and f_b [H K, R] (f_b_proj's weight, in f_a's dtype); beta_logits [B, H]; gate
    [B, H V] (the output gate before its sigmoid); a_log [H]; dt_bias [H, K]; norm_weight [V]; state
    float32 [B, H, K, V]. Returns (o [B, H V] in out_dtype, conv, state); conv and state are written over
    their buffers (donate them). ``interpret``: None runs interpret mode where no GPU is present.
    """
    B, HK = q.shape
    H, K = dt_bias.shape
    V = state.shape[-1]
    W = taps[0].shape[1]
    R = f_a.shape[1]
    expected = {"q": (q.shape, (B, H * K)), "k": (k.shape, (B, H * K)), "v": (v.shape, (B, H * V)),
                "q taps": (taps[0].shape, (H * K, W)), "k taps": (taps[1].shape, (H * K, W)),
                "v taps": (taps[2].shape, (H * V, W)), "conv": (conv.shape, (B, W - 1, 2 * H * K + H * V)),
                "f_a": (f_a.shape, (B, R)), "f_b": (f_b.shape, (H * K, R)), "beta_logits": (beta_logits.shape, (B, H)),
                "gate": (gate.shape, (B, H * V)), "a_log": (a_log.shape, (H,)), "norm_weight": (norm_weight.shape, (V,)),
                "state": (state.shape, (B, H, K, V))}
    wrong = {name: got for name, (got, want) in expected.items() if tuple(got) != want}
    if wrong:
        raise ValueError(f"decode_core: shapes disagree with B={B}, H={H}, K={K}, V={V}, W={W}, R={R} "
                         f"(from q, dt_bias, state, taps, f_a): {wrong}")
    if conv.dtype != _F32 or state.dtype != _F32:
        raise ValueError(f"decode_core: conv and state must be float32, got {conv.dtype} and {state.dtype}")
    scale = K ** -0.5 if scale is None else scale
    interpret = pallas_interpret() if interpret is None else interpret
    per_head = lambda n: pl.BlockSpec((None, n), lambda b, h: (b, h))
    whole = pl.BlockSpec()
    in_specs = [
        per_head(K), per_head(K), per_head(V), whole, whole, whole,
        pl.BlockSpec((None, R), lambda b, h: (b, 0)), pl.BlockSpec((K, R), lambda b, h: (h, 0)),
        pl.BlockSpec((None, None, 1), lambda b, h: (b, h, 0)), per_head(V),
        pl.BlockSpec((None, 1), lambda b, h: (h, 0)), pl.BlockSpec((None, K), lambda b, h: (h, 0)),
        pl.BlockSpec((V,), lambda b, h: (0,)), whole, pl.BlockSpec((None, None, K, V), lambda b, h: (b, h, 0, 0)),
    ]
    out_specs = [per_head(V), whole, pl.BlockSpec((None, None, K, V), lambda b, h: (b, h, 0, 0))]
    kernel = functools.partial(_core_kernel, scale=float(scale), lower_bound=float(lower_bound), eps=float(eps))
    args = [q, k, v, *(t.astype(_F32) for t in taps), f_a, f_b, beta_logits[..., None], gate,
            a_log.reshape(H, 1), dt_bias, norm_weight, conv, state]
    return tuple(pl.pallas_call(
        kernel, grid=(B, H), in_specs=in_specs, out_specs=out_specs,
        out_shape=[jax.ShapeDtypeStruct((B, H * V), out_dtype), jax.ShapeDtypeStruct(conv.shape, _F32),
                   jax.ShapeDtypeStruct(state.shape, _F32)],
        input_output_aliases={len(args) - 2: 1, len(args) - 1: 2},
        compiler_params=triton_params(warps, 1, interpret), interpret=interpret, name="kda_decode_core",
    )(*args))


__all__ = ["DEFAULT_WARPS", "decode_core"]
