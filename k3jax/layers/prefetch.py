"""The L2 prefetch plan of a batch-1 decode step (Pallas path, off TPU).

Each sub-block of a layer (attention, feed-forward) starts with one matvec kernel that reads its input
projections' weights (``input_weights()`` of KDA, MLA, MoE and DenseMLP, through ``project``). At one
token those weights stream from DRAM while the small kernels between the matvecs leave DRAM idle. So,
while a step is traced under ``l2_prefetch(groups)`` (the model does this for an unrolled one-token
step), the matvec of group k (recognized by its first weight array) starts a prefetch of group k + 1
(``pallas_kernels.prefetch``) after the sub-block's residual input, and the matvec of group k + 1 waits
for that prefetch's token. The step's values do not change: the prefetch only reads.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence

import jax

from k3jax.typing import Array

ENABLED: bool | None = None  # None: on a GPU only; tests force True to run the plan in interpret mode

_PLAN: contextvars.ContextVar["_Plan | None"] = contextvars.ContextVar("l2_prefetch_plan", default=None)


class _Plan:
    def __init__(self, groups: Sequence[Sequence[Array]]):
        self.groups = [tuple(g) for g in groups]
        self.tokens: dict[int, Array] = {}

    def index(self, weights: Sequence[Array]) -> int | None:
        first = weights[0]
        return next((k for k, group in enumerate(self.groups) if group[0] is first), None)


def enabled() -> bool:
    return jax.default_backend() == "gpu" if ENABLED is None else ENABLED


@contextlib.contextmanager
def l2_prefetch(groups: Sequence[Sequence[Array]]) -> Iterator[None]:
    """Trace a one-token step with this plan: ``groups``, the sub-blocks' input weights in the order
    the step reads them."""
    token = _PLAN.set(_Plan(groups))
    try:
        yield
    finally:
        _PLAN.reset(token)


def prefetch_next(weights: Sequence[Array], residual: Array) -> tuple[Array, ...]:
    """For ``project``'s matvec kernel over ``weights``: when they are group k of the plan, start the
    prefetch of group k + 1 after ``residual`` (the sub-block's residual input), and return the
    token of group k - 1's prefetch (as the matvec's ``after``: what keeps that prefetch in the step
    without making group k's own matvec wait for its prefetch), or () where there is none."""
    plan = _PLAN.get()
    k = None if plan is None else plan.index(weights)
    if k is None:
        return ()
    if k + 1 < len(plan.groups):
        from pallas_kernels.prefetch import prefetch_l2

        plan.tokens[k + 1] = prefetch_l2(plan.groups[k + 1], after=(residual,))
    token = plan.tokens.pop(k - 1, None)
    return () if token is None else (token,)


__all__ = ["ENABLED", "enabled", "l2_prefetch", "prefetch_next"]
