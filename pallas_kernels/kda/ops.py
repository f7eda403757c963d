"""The KDA op's one entry for the layer (``gated_kda``, ``short_convs``: the signatures of
``k3jax.functional``), which picks reference or kernel, and the kernel entries behind it.

    gated_kda(q, k, v, z, a_log, dt_bias, beta_logits, state, lower_bound, valid) -> (o, state)
    short_convs(xs, taps, state, lengths)                                         -> (*ys, state)
    chunk_kda(q, k, v, g, beta, initial_state=None, scale=None)                   -> (o, final_state)
    chunk_kda_fused(q, k, v, z, a_log, dt_bias, beta_logits, lower_bound, initial_state, scale)
    step_kda(q, k, v, g, beta, state, scale=None)                                 -> (o, state)
    step_kda_fused(q, k, v, z, a_log, dt_bias, beta_logits, state, lower_bound, scale)

q, k [B, T, H, K] (bf16 or float32), v [B, T, H, V], g [B, T, H, K] float32 log decay, beta [B, T, H]
float32 after the sigmoid, state [B, H, K, V] float32; o is float32 [B, T, H, V]. K, V and the block
sizes are powers of two; T is any length. Gradients (``pallas_kernels._autodiff.with_reference_gradient``,
a ``jax.custom_vjp``) are the reference's autodiff: forward by the kernels, backward by ``jax.vjp`` of the
pure-JAX form recomputed from the saved inputs, for ``gated_kda``, ``short_convs``, ``chunk_kda`` and
``chunk_kda_fused`` (``step_kda`` and ``step_kda_fused`` have none: ``gated_kda`` gives its decode step one).

The chunked kernels need the bounded gate: every g >= -10 (K3's gate has g > lower_bound = -5).
Sixteen such steps stay inside float32's exponent range when factored around the sub-tile midpoint.
Unbounded gates (Kimi Linear's softplus gate) take the reference's chunked form.

Lowering (``KDABlocks.lowering``, ``resolve_lowering``): "auto" picks Mosaic TPU on a TPU, Mosaic GPU
(``mosaic_gpu.py``'s state walk after the Triton intra kernel; ``mosaic_gpu_decode.py`` for the decode
step) on a GPU under JAX >= 0.11 when K and V are multiples of 64, else the Triton bodies of
``triton.py`` (JAX 0.10 and 0.11 both select Pallas' Triton lowering by its compiler parameters). On a
CPU each runs in its interpret mode.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from k3jax.functional.conv import input_states, last_inputs
from k3jax.implementation import current
from pallas_kernels._autodiff import with_reference_gradient
from pallas_kernels._mosaic_gpu import interpret_argument
from pallas_kernels._platform import interpret, jax_at_least, on_tpu
from pallas_kernels.kda import mosaic_gpu, mosaic_gpu_decode, reference, tpu
from pallas_kernels.kda.triton import LOWERINGS, KDABlocks, decode_step, intra_chunk, state_walk
from pallas_kernels.kda.triton_short_conv import conv_silu_chunk, conv_silu_step

DEFAULT_BLOCKS = KDABlocks()
FLOAT32_BLOCKS = KDABlocks(lowering="triton", inter_dtype="float32")
MIN_LOWER_BOUND = -10.0  # most negative per-step gate whose 16-token span fits float32 (midpoint)


def resolve_lowering(name: str, key_dim: int, value_dim: int) -> str:
    """The lowering "auto" stands for here (see the module docstring); others are returned as given."""
    if name not in LOWERINGS:
        raise ValueError(f"lowering {name!r}; expected one of {LOWERINGS}")
    if name != "auto":
        return name
    if on_tpu():
        return "mosaic_tpu"
    fits = key_dim % mosaic_gpu.WGMMA_ROWS == 0 and value_dim % mosaic_gpu.BLOCK_V == 0
    if jax.default_backend() == "gpu" and jax_at_least(0, 11) and fits:
        return "mosaic_gpu"
    return "triton"


def resolve_decode_lowering(name: str, key_dim: int, value_dim: int, state_bytes: int) -> str:
    """The decode step's lowering: as ``resolve_lowering``, except that "auto" keeps the Triton decode
    for states under ``KernelPolicy.kda_mosaic_decode_min_state_bytes``."""
    lowering = resolve_lowering(name, key_dim, value_dim)
    if name == "auto" and lowering == "mosaic_gpu" and state_bytes < current().policy.kda_mosaic_decode_min_state_bytes:
        return "triton"
    return lowering


def gated_kda(q, k, v, z, a_log, dt_bias, beta_logits, state, lower_bound: float | None, valid=None):
    """``k3jax.functional.kda.gated_kda``: the reference, or on the Pallas path the kernels. With K3's
    bounded gate the kernels take the raw inputs (norms, gate and sigmoid inside; padding masked by
    z = beta_logits = -inf, which give g = 0 and beta = 0); without it the gates are computed here
    and the decode kernel (any gate works there) or the reference's chunked form runs. Where kernels
    run, the gradient is the reference's (``with_reference_gradient``)."""
    if current().name == "reference" or (lower_bound is None and q.shape[1] > 1):
        return reference.gated_kda(q, k, v, z, a_log, dt_bias, beta_logits, state, lower_bound, valid)
    return with_reference_gradient(_gated_kda_kernels, reference.gated_kda)(
        q, k, v, z, a_log, dt_bias, beta_logits, state, lower_bound, valid)


def _gated_kda_kernels(q, k, v, z, a_log, dt_bias, beta_logits, state, lower_bound: float | None, valid):
    """``gated_kda``'s kernels (the Pallas path, where it does not run the reference)."""
    if lower_bound is not None:
        if valid is not None:
            z = jnp.where(valid[:, :, None, None], z, -jnp.inf)
            beta_logits = jnp.where(valid[:, :, None], beta_logits, -jnp.inf)
        if q.shape[1] == 1:
            o, state = step_kda_fused(q[:, 0], k[:, 0], v[:, 0], z[:, 0], a_log, dt_bias, beta_logits[:, 0], state,
                                      lower_bound)
            return o[:, None], state
        return chunk_kda_fused(q, k, v, z, a_log, dt_bias, beta_logits, lower_bound, state)
    q, k, g, beta = reference.gates(q, k, z, a_log, dt_bias, beta_logits, None, valid)
    o, state = step_kda(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state)
    return o[:, None], state


def short_convs(xs, taps, state, lengths=None):
    """``k3jax.functional.conv.short_convs``: the reference, or on the Pallas path off TPU one kernel for
    a decode step (T = 1, no padding; the state updated in place) and, by
    ``KernelPolicy.conv_kernel_at_prefill``, one kernel for a prefill chunk's convs and SiLU (the state
    after them by XLA). The kernels' gradient is the reference's (``with_reference_gradient``)."""
    choice = current()
    if choice.name == "reference" or on_tpu():
        return reference.short_convs(xs, taps, state, lengths)
    step = xs[0].shape[1] == 1 and lengths is None
    if not step and not choice.policy.conv_kernel_at_prefill:
        return reference.short_convs(xs, taps, state, lengths)
    kernel = _short_convs_step if step else _short_convs_chunk
    return with_reference_gradient(kernel, reference.short_convs)(list(xs), list(taps), state, lengths)


def _short_convs_step(xs, taps, state, lengths):
    """``short_convs`` at one token (``lengths`` None) by the decode kernel."""
    ys, state = conv_silu_step([x[:, 0] for x in xs], taps, state)
    return (*(y[:, None] for y in ys), state)


def _short_convs_chunk(xs, taps, state, lengths):
    """``short_convs`` over a prefill chunk: the convs and SiLU by the kernel, the state after them by XLA."""
    states = [last_inputs(x.astype(jnp.float32), s, lengths) for x, s in zip(xs, input_states(xs, state))]
    return (*conv_silu_chunk(xs, taps, state), jnp.concatenate(states, axis=-1))


def _pad_tokens(arrays, chunk):
    T = arrays[0].shape[1]
    pad = -T % chunk
    if pad == 0:
        return arrays
    return [jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2)) for a in arrays]


def _forward(q, k, v, g, beta, gate_params, initial_state, scale, lower_bound, blocks):
    B, T, H, K = q.shape
    scale = K**-0.5 if scale is None else scale
    kw = dict(seq_len=T, scale=scale, lower_bound=lower_bound)
    lowering = resolve_lowering(blocks.lowering, K, v.shape[-1])
    if lowering == "mosaic_tpu":
        padded = _pad_tokens([q, k, v, g, beta], tpu.DEFAULT_CHUNK)
        o, state = tpu.forward(*padded, gate_params, initial_state, chunk=tpu.DEFAULT_CHUNK,
                               interpret=_tpu_interpret(), **kw)
    elif lowering == "mosaic_gpu":
        padded = _pad_tokens([q, k, v, g, beta], mosaic_gpu.CHUNK)
        o, state = mosaic_gpu.forward(*padded, gate_params, initial_state,
                                      interpret=interpret_argument(interpret()), **kw)
    else:
        padded = _pad_tokens([q, k, v, g, beta], blocks.chunk)
        inter = intra_chunk(*padded, gate_params, blocks=blocks, **kw)
        o, state = state_walk(*inter, initial_state, blocks=blocks)
    return o[:, :T], state


def _tpu_interpret():
    """False on a TPU; Pallas' TPU interpret mode elsewhere."""
    if jax.default_backend() == "tpu":
        return False
    from jax.experimental.pallas import tpu as pltpu

    return pltpu.InterpretParams()


def _decode(q, k, v, g, beta, state, gate, *, scale, blocks, lower_bound=0.0):
    """gate: None, or the raw (A_log [H], dt_bias [H, K]), which the Triton kernel reads as they are
    (and beta in its dtype); the Mosaic kernels take ``_gate_params`` and a float32 beta."""
    lowering = resolve_decode_lowering(blocks.lowering, q.shape[-1], v.shape[-1], 2 * state.size * 4)
    if lowering == "triton":
        return decode_step(q, k, v, g, beta, state, gate, scale=scale, blocks=blocks, lower_bound=lower_bound)
    gate_params = None if gate is None else _gate_params(*gate, q.shape[-1])
    beta = beta.astype(jnp.float32)
    if lowering == "mosaic_tpu":
        return tpu.decode_step(q, k, v, g, beta, state, gate_params, scale=scale, lower_bound=lower_bound,
                               interpret=_tpu_interpret())
    return mosaic_gpu_decode.decode_step(q, k, v, g, beta, state, gate_params, scale=scale, lower_bound=lower_bound,
                                         interpret=interpret_argument(interpret()))


def _precise(q) -> bool:
    """Whether the inputs ask for float32 arithmetic, which the kernels keep only in their Triton form."""
    return jnp.dtype(q.dtype) == jnp.float32


def _blocks_for(q, blocks: KDABlocks | None) -> KDABlocks:
    """The blocks given, else by the inputs' dtype: float32 inputs keep float32 intermediates between the
    Triton kernels (``FLOAT32_BLOCKS``: the float32 maths, to its rounding), narrower ones take bf16
    intermediates and the fastest lowering (``DEFAULT_BLOCKS``)."""
    if blocks is not None:
        return blocks
    return FLOAT32_BLOCKS if _precise(q) else DEFAULT_BLOCKS


def chunk_kda(q, k, v, g, beta, initial_state=None, scale=None, *,
              blocks: KDABlocks | None = None, safe_gate: bool = True):
    """Chunked KDA by the Pallas kernels. Same contract as ``k3jax.functional.kda.chunk_kda``:
    returns (o float32 [B, T, H, V], final_state float32 [B, H, K, V]). Needs g >= -10 per step;
    ``safe_gate=False`` (unbounded gates) runs the reference instead. ``blocks`` default: by the inputs'
    dtype (``_blocks_for``); float32 inputs on a TPU, whose kernel multiplies in bf16, take the reference."""
    if not safe_gate or (blocks is None and _precise(q) and on_tpu()):
        return reference.chunk_kda(q, k, v, g, beta, initial_state, scale)
    blocks = _blocks_for(q, blocks)
    if initial_state is None:
        initial_state = jnp.zeros((q.shape[0], q.shape[2], q.shape[3], v.shape[3]), jnp.float32)
    kernel = lambda q, k, v, g, beta, h: _forward(q, k, v, g, beta, None, h, scale, 0.0, blocks)
    gradient = lambda q, k, v, g, beta, h: reference.chunk_kda(q, k, v, g, beta, h, scale)
    return with_reference_gradient(kernel, gradient)(q, k, v, g, beta, initial_state)


def _gate_params(a_log, dt_bias, K):
    """(exp(A_log) broadcast to [H, K], dt_bias [H, K]) in float32: what the fused kernels read."""
    a_exp = jnp.broadcast_to(jnp.exp(a_log.astype(jnp.float32))[:, None], (a_log.shape[0], K))
    return a_exp, dt_bias.astype(jnp.float32).reshape(a_log.shape[0], K)


def chunk_kda_fused(q, k, v, z, a_log, dt_bias, beta_logits, lower_bound: float = -5.0,
                    initial_state=None, scale=None, *, blocks: KDABlocks | None = None):
    """Chunked KDA from the layer's raw inputs, with K3's bounded gate, the q/k L2 norms and the beta
    sigmoid computed inside the kernel. q, k [B, T, H, K] un-normalized; v [B, T, H, V]; z [B, T, H, K]
    (f_b_proj output); a_log [H]; dt_bias [H, K]; beta_logits [B, T, H]. Returns (o, final_state) as
    ``chunk_kda``, ``blocks`` by the inputs' dtype as there. Raises ValueError when lower_bound < -10
    (outside the kernel's float32 range)."""
    if lower_bound < MIN_LOWER_BOUND:
        raise ValueError(f"lower_bound {lower_bound} < {MIN_LOWER_BOUND}: use reference.chunk_kda_fused")
    if blocks is None and _precise(q) and on_tpu():
        return reference.chunk_kda_fused(q, k, v, z, a_log, dt_bias, beta_logits, lower_bound, initial_state, scale)
    blocks = _blocks_for(q, blocks)
    if initial_state is None:
        initial_state = jnp.zeros((q.shape[0], q.shape[2], q.shape[3], v.shape[3]), jnp.float32)
    lower_bound = float(lower_bound)

    def kernel(q, k, v, z, a_log, dt_bias, beta_logits, h):
        gate_params = _gate_params(a_log, dt_bias, q.shape[-1])
        return _forward(q, k, v, z, beta_logits, gate_params, h, scale, lower_bound, blocks)

    def gradient(q, k, v, z, a_log, dt_bias, beta_logits, h):
        return reference.chunk_kda_fused(q, k, v, z, a_log, dt_bias, beta_logits, lower_bound, h, scale)

    return with_reference_gradient(kernel, gradient)(q, k, v, z, a_log, dt_bias, beta_logits.astype(jnp.float32),
                                                     initial_state)


def step_kda(q, k, v, g, beta, state, scale=None, *, blocks: KDABlocks = DEFAULT_BLOCKS):
    """One decode step for a batch of sequences, same contract as ``k3jax.functional.kda.step_kda``:
    q, k, g [B, H, K], v [B, H, V], beta [B, H], state [B, H, K, V] float32 -> (o float32 [B, H, V],
    state). Any gate works here (no factorization). Not differentiable."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _decode(q, k, v, g, beta, state, None, scale=scale, blocks=blocks)


def step_kda_fused(q, k, v, z, a_log, dt_bias, beta_logits, state, lower_bound: float = -5.0, scale=None, *,
                   blocks: KDABlocks = DEFAULT_BLOCKS):
    """One decode step from the layer's raw inputs (as ``chunk_kda_fused``, one token): q, k, z [B, H, K]
    un-normalized, v [B, H, V], a_log [H], dt_bias [H, K], beta_logits [B, H], state [B, H, K, V] f32.
    The q/k L2 norms, K3's bounded gate and the beta sigmoid run inside the kernel. Returns
    (o float32 [B, H, V], state). Not differentiable."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    H, K = q.shape[-2:]
    return _decode(q, k, v, z, beta_logits, state, (a_log.reshape(H), dt_bias.reshape(H, K)), scale=scale,
                   blocks=blocks, lower_bound=float(lower_bound))


__all__ = ["DEFAULT_BLOCKS", "FLOAT32_BLOCKS", "MIN_LOWER_BOUND", "KDABlocks", "chunk_kda", "chunk_kda_fused",
           "gated_kda",
           "resolve_decode_lowering", "resolve_lowering", "short_convs", "step_kda", "step_kda_fused"]
