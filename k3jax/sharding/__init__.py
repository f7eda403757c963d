"""The model on a mesh of devices (axes data, expert, tensor): the rules table (``rules``), the mesh and
placement (``mesh``), and the MoE's expert parallelism (``experts``)."""

from k3jax.sharding.experts import expert_sharding, local_pairs, moe_expert_parallel
from k3jax.sharding.mesh import (ShardingError, current_mesh, make_mesh, on_mesh, param_shardings, parse_mesh, place,
                                 place_batch)
from k3jax.sharding.rules import DATA, EXPERT, MESH_AXES, RULES, TENSOR, param_spec

__all__ = ["DATA", "EXPERT", "MESH_AXES", "RULES", "ShardingError", "TENSOR", "current_mesh",
           "expert_sharding", "local_pairs", "make_mesh", "moe_expert_parallel", "on_mesh", "param_shardings",
           "param_spec", "parse_mesh", "place", "place_batch"]
