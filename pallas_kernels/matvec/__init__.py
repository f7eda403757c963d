"""A layer's maps of one input as one kernel (decode-step projections). ``ops`` is the entry; README.md
has the prologue and epilogue forms."""

from pallas_kernels.matvec.ops import project

__all__ = ["project"]
