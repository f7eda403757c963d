"""Block AttnRes: a mix site's softmax over depth and the norm after it in one kernel. ``ops`` is the entry."""

from pallas_kernels.attn_res.ops import mix_norm

__all__ = ["mix_norm"]
