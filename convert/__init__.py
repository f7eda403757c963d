"""Released safetensors checkpoints (Kimi-K3 MXFP4, Kimi-Linear bf16) <-> k3jax checkpoints.

- ``convert(src, out)``: streaming, validated, resumable conversion to orbax parts + manifest.
- ``export(params, hf_config, out)`` / ``export_checkpoint(ckpt, out)``: back to the released layout.
- ``write_synthetic(out, preset)``: small or multi-GB synthetic checkpoints in the released layouts.
- ``k3jax.checkpoint.load(path)``: either kind of folder -> a ready ``K3Model``.
"""

from convert.conversion import ConversionError, convert
from convert.export import export, export_checkpoint, model_params, read_params
from convert.safetensors_io import CheckpointError
from convert.synthetic import RandomParams, synthetic_params, write_synthetic

__all__ = [
    "CheckpointError",
    "ConversionError",
    "RandomParams",
    "convert",
    "export",
    "export_checkpoint",
    "model_params",
    "read_params",
    "synthetic_params",
    "write_synthetic",
]
