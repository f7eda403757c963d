"""Synthetic checkpoints in the exact released layouts, from a preset.

- ``synthetic_params(hf_config, seed)``: random parameters with ``K3Model``'s paths, shapes and
  released dtypes (bf16 weights; float32 A_log, dt_bias, conv weights, router bias), no tensor
  constant, so a wrong mapping shows. With MXFP4 experts (K3) the routed experts are
  ``MXTensor.quantize``d: these are the in-memory values a conversion must reproduce bit for bit.
  (Drawn with numpy: ``K3Model``'s own initializer takes half a minute eagerly on a CI core.)
- ``RandomParams``: the same parameters drawn lazily per tensor from numpy (no model is built),
  for multi-GB benchmark checkpoints that must not sit in memory.
- ``write_synthetic(out, preset, ...)``: writes either through ``export`` (config.json with K3's
  ``text_config`` and ``language_model.`` prefixes, several shards and an index for K3; bf16
  experts for Kimi-Linear).
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Iterator

import jax.numpy as jnp
import numpy as np

from convert.export import export
from convert.names import Param, param_table
from k3jax.config import from_hf_config
from k3jax.mx import BLOCK, MXTensor, quantize_compiled
from k3jax.presets import preset_hf_config

_BF16 = np.dtype(jnp.bfloat16)


def synthetic_params(hf_config: Mapping[str, Any], seed: int = 0) -> dict[str, Any]:
    """Random parameters of the ``K3Model`` that ``hf_config`` describes: canonical path -> numpy
    array (released dtypes), or ``MXTensor`` [E, N, K] for routed experts when the config has
    MXFP4 ``quantization_config`` (normal weights encoded with ``MXTensor.quantize``)."""
    cfg = from_hf_config(hf_config)
    draw = RandomParams(hf_config, seed, mx_codes=False)
    out: dict[str, Any] = {}
    for path, p in draw.table.items():
        value = draw[path]
        if cfg.mx_experts and p.kind == "experts":
            q = quantize_compiled(jnp.asarray(value, jnp.float32))
            value = MXTensor(np.asarray(q.codes), np.asarray(q.scales))
        out[path] = value
    return out


class RandomParams(Mapping):
    """Lazy random parameters for ``export``, shaped like ``K3Model``'s: each tensor is drawn from
    numpy when asked for (the last one is cached, since experts are read row by row). Weights are
    N(0, 1/in) for [out, in] matrices; norm scales 1 + N(0, 0.01); AttnRes queries and router
    biases N(0, 0.01); conv weights N(0, 0.25); A_log and dt_bias N(0, 1). With ``mx_codes`` and a MXFP4 config,
    routed experts are random codes with scale bytes in [118, 124]."""

    def __init__(self, hf_config: Mapping[str, Any], seed: int = 0, *, mx_codes: bool = True):
        self.cfg = from_hf_config(hf_config)
        self.table = {p.path: p for p in param_table(self.cfg)}
        self.seed = seed
        self.mx_codes = mx_codes and self.cfg.mx_experts
        self._cache: tuple[str, Any] | None = None

    def __getitem__(self, path: str) -> Any:
        if self._cache is None or self._cache[0] != path:
            self._cache = (path, self._draw(self.table[path]))
        return self._cache[1]

    def __contains__(self, path: object) -> bool:  # nothing drawn
        return path in self.table

    def __iter__(self) -> Iterator[str]:
        return iter(self.table)

    def __len__(self) -> int:
        return len(self.table)

    def _draw(self, p: Param) -> Any:
        rng = np.random.default_rng([self.seed, zlib.crc32(p.path.encode())])
        if p.kind == "experts" and self.mx_codes:
            *lead, k = p.shape
            codes = rng.integers(0, 256, (*lead, k // 2), np.uint8)
            scales = rng.integers(118, 125, (*lead, k // BLOCK), np.uint8)
            return MXTensor(codes, scales)
        x = rng.standard_normal(p.shape, np.float32)
        if p.path.endswith("norm.weight"):
            x = 1.0 + 0.1 * x
        elif p.path.endswith(("_res.proj.weight", "e_score_correction_bias")):
            x *= 0.1
        elif p.path.endswith("conv1d.weight"):
            x *= 0.5
        elif len(p.shape) > 1:
            x *= p.shape[-1] ** -0.5
        return x if p.dtype == "F32" else x.astype(_BF16)


def write_synthetic(
    out: str | Path, preset: str | Mapping[str, Any] = "tiny", *, seed: int = 0, shard_bytes: int | None = None,
    lazy: bool = False, quiet: bool = True, dtype: str | None = None,
) -> tuple[dict[str, Any], Mapping[str, Any]]:
    """Write a synthetic released-layout checkpoint folder -> (hf_config, params written).

    ``preset`` is a preset name or a config.json dict. ``shard_bytes`` defaults to a quarter of the
    model so K3-style checkpoints have several shards. ``lazy`` draws ``RandomParams`` (no model,
    streaming) instead of ``synthetic_params``. ``dtype`` ("BF16", "F16", "F32") saves every float
    tensor in that dtype, as HF saves a model held in it (the params returned are as drawn: bf16
    weights, float32 A_log, dt_bias, conv weights and router bias; the file holds them cast).
    """
    hf_config = preset_hf_config(preset) if isinstance(preset, str) else dict(preset)
    params = RandomParams(hf_config, seed) if lazy else synthetic_params(hf_config, seed)
    if shard_bytes is None:
        total = sum(np.dtype(_BF16).itemsize * int(np.prod(p.shape)) for p in param_table(from_hf_config(hf_config)))
        shard_bytes = max(total // 4, 1)
    export(params, hf_config, out, shard_bytes=shard_bytes, dtype=dtype, quiet=quiet)
    return hf_config, params


__all__ = ["RandomParams", "synthetic_params", "write_synthetic"]
