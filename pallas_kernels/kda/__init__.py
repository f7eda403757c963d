"""Pallas kernels for Kimi Delta Attention: chunked prefill (bounded gate, 16-token sub-tiles), a
fused-input variant and the decode step. See README.md for the maths and the tiling."""

from pallas_kernels.kda.kernel import KDABlocks
from pallas_kernels.kda.ops import DEFAULT_BLOCKS, chunk_kda, chunk_kda_fused, step_kda, step_kda_fused

__all__ = ["KDABlocks", "DEFAULT_BLOCKS", "chunk_kda", "chunk_kda_fused", "step_kda", "step_kda_fused"]
