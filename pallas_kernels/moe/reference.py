"""The oracle and CPU fallback of the MoE kernels: ``k3jax.functional.moe`` (the sigmoid router's
selection, the sorted and dense dispatches over stored expert stacks) and the expert-parallel form of
``k3jax.sharding``."""

from k3jax.functional.moe import moe_dense, moe_sorted, routed_experts, select_experts, stored_grouped_matmul
from k3jax.sharding import moe_expert_parallel

__all__ = ["moe_dense", "moe_expert_parallel", "moe_sorted", "routed_experts", "select_experts",
           "stored_grouped_matmul"]
