"""The one implementation switch and the one kernel policy.

    with k3jax.use_implementation("pallas"):
        logits = forward(...)
    with k3jax.use_implementation("pallas", policy=KernelPolicy(tiled_moe_at_decode=False)):
        logits = forward(...)

"reference" (the default) is float32-accurate pure JAX and runs everywhere. "pallas" lets every op
entry in ``pallas_kernels`` (``pallas_kernels.<op>.ops``) take its kernels; on a CPU they run in
Pallas interpret mode, which is how CI checks them. Where an op has several kernels, or a kernel
pays only at some shapes, the choice is a field of ``KernelPolicy``; nothing else decides.

Both are read at trace time, so a function jitted under one setting keeps it; and since ``jax.jit``
caches traces by function, jitting the same function again under another setting reuses the old
trace too: jit a fresh function per setting.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Iterator, Literal, NamedTuple

Implementation = Literal["reference", "pallas"]


@dataclasses.dataclass(frozen=True)
class KernelPolicy:
    """Every choice between kernels on the Pallas path: each field's default, why, and the measurement
    behind it (device, date; the figures are in benchmarks/HISTORY.md under that date). A benchmark
    that compares variants builds policies; nothing changes a default at run time."""

    matvec_max_rows: int = 1
    """Rows (tokens) up to which the maps that read one input (a layer's projections) run as one matvec
    kernel, their input's mix, norm and activation inside. H200, 2026-11-30: at one row the kernel
    matched XLA's einsums; at eight it took twice their time."""

    activation_in_matvec_max_width: int = 1024
    """Widest gated-activation input the matvec kernel computes in its prologue (each program recomputes
    it over the whole row). H200, 2026-12-02: `mini`'s 768-wide shared expert 10.5 against 15.4 us for
    XLA's act + einsum; the 5632-wide dense MLP 14.1-16.4 against 11.0 us."""

    add_in_matvec: bool = True
    """The matvec kernel adds a layer's residual (and the shared experts' output) in its epilogue,
    rather than XLA after it: one kernel fewer on a batch-1 decode step's chain."""

    mix_kernel_any_rows: bool = True
    """A Block AttnRes mix and the norm after it run as one small kernel at any number of rows
    (prefill chunks, batched decode), not only where the matvec kernel reads it. H200, 2026-12-03:
    `mini`'s B=64 step 2.26 against 2.40 ms, B=8 1.57 against 1.65; 8K prefill tied."""

    conv_in_matvec: bool = True
    """A batch-1 decode step's KDA short convs and SiLU run in the epilogue of the layer's input maps'
    matvec kernel. H200, 2026-12-02: the `mini` step 0.897 against 0.910 ms (medians), logits bitwise
    equal."""

    conv_kernel_at_prefill: bool = True
    """A prefill chunk's KDA short convs and SiLU run as one kernel rather than XLA's fusion. H200,
    2026-12-03: 44-45 against 48-77 us a KDA layer at a 2048-token `mini` chunk; 8K prompt 53.8
    against 57.1 ms."""

    prefill_pairs_per_expert: int = 256
    """(token, expert) pairs per expert from which a MoE layer counts as prefill (below: decode);
    256 is `mini`'s 2048-token chunk."""

    expert_exchange_min_tokens: int = 256
    """Tokens in a MoE layer's call from which, on a mesh, each device sends its pairs' rows to the experts'
    devices (``k3jax.sharding.experts``: exchanged rows) rather than every expert device seeing every
    token (replicated tokens, one psum). Not measured yet (no several-GPU machine lent by 2026-12-07):
    256 keeps decode steps up to batch 255 replicated, where the exchange's two all-to-alls cost more
    than the psum of [T, R]; prefill chunks exchange."""

    tiled_moe_at_prefill: bool = True
    """MXFP4 routed experts at prefill run as the tiled Mosaic GPU MoE, not the sorted dispatch.
    H200, 2026-12-02: `mini`'s 2048-token chunk MoE 20% faster; 8K prefill 60.9 against 66.6 ms."""

    tiled_moe_at_decode: bool = True
    """MXFP4 routed experts at decode run as the tiled Mosaic GPU MoE (on a GPU). H200, 2026-12-03:
    K3's routed layer 137 against 251 us at 1 token, 3.9 against 7.0 ms at 64."""

    split_moe_max_pairs: int = 64
    """(token, expert) pairs up to which the routed experts may run as the two fused decode-MoE kernels
    (``pallas_kernels.moe``'s split form) rather than a sorted or tiled dispatch."""

    split_moe_max_hidden_programs: int = 256
    """Hidden-unit programs a token's pairs spread over (k * F / 32) up to which the split kernels pay.
    H200, 2026-11-30 (with the atomic one-kernel form then): `mini`'s 8 x 24 = 192 took the batch-1
    step from 1.50 to 1.40 ms; K3's 16 x 96 = 1536 was 1.13x slower than the sorted dispatch at one
    token."""

    split_moe_max_tokens_beside_tiled: int = 1
    """Where the tiled MoE would run, tokens up to which the split kernels run instead. H200,
    2026-12-03: `mini` at 1 token 14.6 against 40.7 us tiled; at 8 tokens 65.8 against 58.0."""

    route_in_moe_kernel: bool = True
    """At one token the split MoE's first kernel picks the experts itself (no selection kernel before
    it): one kernel fewer on a batch-1 decode step's chain."""

    split_moe_planar_h_max_tokens: int = 1
    """Tokens up to which the split MoE passes its hidden activations planar (even and odd units
    apart) rather than interleaved. H200, 2026-12-02: the batch-1 MoE chain 22.6 against 24.0 us a
    layer; 8 tokens no faster."""

    mx_mosaic_gpu_max_rows: int = 16
    """Dense MXFP4 matmul rows up to which the Mosaic GPU kernel runs (GPU, JAX >= 0.11). H200,
    2026-11-30: 49 against 71-80 us for the Triton kernels at M = 1 and 16."""

    mx_decode_then_dot_min_rows: int = 512
    """Dense MXFP4 matmul rows from which the weight is decoded once to bf16 for cuBLAS, rather than
    decoded per tile in the fused kernel. H200, 2026-11-30: 0.94x the bf16 dot at M = 4096."""

    kda_mosaic_decode_min_state_bytes: int = 256 << 20
    """KDA state bytes (read plus written) from which the decode step takes the Mosaic GPU kernel
    over the Triton one. H200, 2026-11-30: Mosaic faster at B=64, H=96 (805 MB: 3.59 against 3.52
    TB/s), slower at `mini`'s batch 1 (39 plus ~45 us of operand copies against 32 us)."""


DEFAULT_POLICY = KernelPolicy()


class Choice(NamedTuple):
    """The implementation and the kernel policy in force where a function is traced."""

    name: Implementation
    policy: KernelPolicy


_CURRENT: contextvars.ContextVar[Choice] = contextvars.ContextVar(
    "k3jax_implementation", default=Choice("reference", DEFAULT_POLICY))


def current() -> Choice:
    """The implementation and policy in force (read by the op entries while tracing)."""
    return _CURRENT.get()


def get_implementation() -> Implementation:
    return _CURRENT.get().name


def _checked(name: str, policy: KernelPolicy | None) -> Choice:
    if name not in ("reference", "pallas"):
        raise ValueError(f"implementation: {name!r}; expected 'reference' or 'pallas'")
    if policy is not None and not isinstance(policy, KernelPolicy):
        raise TypeError(f"policy: expected a KernelPolicy, got {type(policy).__name__}")
    return Choice(name, DEFAULT_POLICY if policy is None else policy)  # type: ignore[arg-type]


@contextlib.contextmanager
def scoped(switch: contextvars.ContextVar, value) -> Iterator[None]:
    """Hold a trace-time setting at ``value`` for the duration of a with-block."""
    token = switch.set(value)
    try:
        yield
    finally:
        switch.reset(token)


def use_implementation(name: Implementation, policy: KernelPolicy | None = None
                       ) -> contextlib.AbstractContextManager:
    """``with use_implementation("pallas"): ...`` traces the kernels' path inside the block, choosing
    between kernels by ``policy`` (default ``KernelPolicy()``)."""
    return scoped(_CURRENT, _checked(name, policy))


__all__ = ["DEFAULT_POLICY", "Choice", "Implementation", "KernelPolicy", "current", "get_implementation",
           "scoped", "use_implementation"]
