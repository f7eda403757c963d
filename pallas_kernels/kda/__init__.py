"""Kimi Delta Attention: the chunked prefill (bounded gate, 16-token sub-tiles), the decode step and the
short convs, by lowering. ``ops`` is the entry; README.md has the maths and the tiling."""

from pallas_kernels.kda.ops import (DEFAULT_BLOCKS, KDABlocks, chunk_kda, chunk_kda_fused, gated_kda, short_convs,
                                    step_kda, step_kda_fused)

__all__ = ["DEFAULT_BLOCKS", "KDABlocks", "chunk_kda", "chunk_kda_fused", "gated_kda", "short_convs", "step_kda",
           "step_kda_fused"]
