"""The L2 prefetch plan of a batch-1 decode step (Pallas path, on a GPU).

Each sub-block of a layer (attention, feed-forward) starts with one matvec kernel that reads its input
projections' weights (``input_weights()`` of KDA, MLA, MoE and DenseMLP, through ``project``). At one
token those weights stream from DRAM while the small kernels between the matvecs leave DRAM idle. So,
while a step is traced under ``l2_prefetch(groups)`` (the model does this for an unrolled one-token
step), the input matvec of group k (recognized by its first weight array) waits for its own prefetch's
token and starts the TMA prefetch of group k + 1 (``pallas_kernels.prefetch``): after its own output
(``START = "output"``: the prefetch overlaps the rest of the sub-block, not this matvec's stream), or
after its residual input (``"input"``: beside this matvec too). The step's values do not change: a
prefetch is a hint.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence

import jax

from k3jax.typing import Array

ENABLED: bool | None = None  # None: on a GPU only; tests force True to trace the plan on a CPU
START = "output"  # when group k + 1's prefetch starts: after group k's matvec ("output") or before it ("input")

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


def _group(weights: Sequence[Array]) -> tuple["_Plan | None", int | None]:
    plan = _PLAN.get()
    return plan, None if plan is None else plan.index(weights)


def _start_next(plan: _Plan, k: int, after: Array) -> None:
    if k + 1 < len(plan.groups):
        from pallas_kernels.prefetch import prefetch_l2

        plan.tokens[k + 1] = prefetch_l2(plan.groups[k + 1], after=(after,))


def before_matvec(weights: Sequence[Array], residual: Array) -> tuple[Array, ...]:
    """For ``project``'s matvec kernel over ``weights``, before it: when they are group k of the plan,
    the token of group k's prefetch (the matvec's ``after``), or () where there is none; with
    ``START == "input"``, start group k + 1's prefetch after ``residual`` (the sub-block's input)."""
    plan, k = _group(weights)
    if k is None:
        return ()
    if START == "input":
        _start_next(plan, k, residual)
    token = plan.tokens.pop(k, None)
    return () if token is None else (token,)


def after_matvec(weights: Sequence[Array], out: Array) -> None:
    """For ``project``'s matvec kernel over ``weights``, after it: when they are group k of the plan and
    ``START == "output"``, start group k + 1's prefetch after ``out`` (one of the matvec's outputs)."""
    plan, k = _group(weights)
    if k is not None and START == "output":
        _start_next(plan, k, out)


__all__ = ["ENABLED", "START", "after_matvec", "before_matvec", "enabled", "l2_prefetch"]
