"""Released safetensors checkpoints (Kimi-K3 MXFP4, Kimi-Linear bf16/f16/f32) <-> k3jax checkpoints.

- ``convert(src, out)``: streaming, validated, resumable conversion to orbax parts + manifest
  (with a CRC-32 per array).
- ``export(params, hf_config, out)`` / ``export_checkpoint(ckpt, out)``: back to the released layout.
- ``verify_checkpoint(ckpt)``: a converted checkpoint's files and checksums.
- ``write_synthetic(out, preset)``: small or multi-GB synthetic checkpoints in the released layouts.
- ``k3jax.checkpoint.load(path)``: either kind of folder -> a ready ``K3Model``.

Names are imported on first use: ``import convert`` alone loads neither JAX, orbax nor the model.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "CheckpointError": "convert.safetensors_io",
    "ConversionError": "convert.conversion",
    "convert": "convert.conversion",
    "export": "convert.export",
    "export_checkpoint": "convert.export",
    "model_params": "convert.export",
    "read_params": "convert.export",
    "RandomParams": "convert.synthetic",
    "synthetic_params": "convert.synthetic",
    "write_synthetic": "convert.synthetic",
    "verify_checkpoint": "convert.integrity",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'convert' has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)
