"""Routed experts: the router's selection and the expert products (split, tiled, sorted), by lowering.
``ops`` is the entry; README.md has the forms and where each runs."""

from pallas_kernels.moe.ops import routed_experts, select_experts

__all__ = ["routed_experts", "select_experts"]
