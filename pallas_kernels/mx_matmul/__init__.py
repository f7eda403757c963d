"""Block-scaled (MXFP4 weight, optional MXFP8 activation) matmuls: Pallas kernels beside their
float32 references. See README.md in this folder for the maths, layout and tiling."""

from pallas_kernels.mx_matmul.kernel import MXBlocks
from pallas_kernels.mx_matmul.moe import fused_moe_mx, fused_moe_pays
from pallas_kernels.mx_matmul.moe_split import SPLIT_MIN_TOKENS, fused_moe_mx_split, routed_moe_mx_split
from pallas_kernels.mx_matmul.moe_tiled import tiled_moe_mx
from pallas_kernels.mx_matmul.ops import default_blocks, grouped_mx_matmul, mx_matmul
from pallas_kernels.mx_matmul.reference import grouped_mx_matmul_reference, mx_matmul_reference

__all__ = [
    "MXBlocks",
    "SPLIT_MIN_TOKENS",
    "default_blocks",
    "fused_moe_mx",
    "fused_moe_mx_split",
    "fused_moe_pays",
    "grouped_mx_matmul",
    "grouped_mx_matmul_reference",
    "mx_matmul",
    "mx_matmul_reference",
    "routed_moe_mx_split",
    "tiled_moe_mx",
]
