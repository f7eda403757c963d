"""Block-scaled (MXFP4 weight, optional MXFP8 activation) matmuls by lowering, beside their float32
references. ``ops`` is the entry; README.md has the maths, layout and tiling."""

from pallas_kernels.mx_matmul.ops import default_blocks, grouped_mx_matmul, mx_matmul
from pallas_kernels.mx_matmul.reference import grouped_mx_matmul_reference, mx_matmul_reference
from pallas_kernels.mx_matmul.triton import MXBlocks

__all__ = ["MXBlocks", "default_blocks", "grouped_mx_matmul", "grouped_mx_matmul_reference", "mx_matmul",
           "mx_matmul_reference"]
