"""k3jax parameters -> safetensors in the released layout (MXFP4 experts re-packed), streamed.

The layout (shard files, tensor order, aliases, A_log padding) is the source's, read from a k3jax
checkpoint's manifest, so converting and exporting back is bit-identical; without one, the
default layout is used: released names, shards of about ``shard_bytes`` in parameter order,
``model-0000i-of-0000n.safetensors`` plus ``model.safetensors.index.json``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Mapping

import numpy as np
from flax import nnx

from convert.names import (
    Param, Released, a_log_to_released, expert_row, nbytes, param_table, prefix_for, released_specs,
)
from convert.orbax_io import CheckpointParams
from convert.progress import Progress
from convert.safetensors_io import DTYPES, INDEX_FILE, CheckpointError, TensorInfo, write_safetensors
from k3jax.config import from_hf_config

Params = Mapping[str, Any]  # canonical path -> array [shape] or MXTensor


def model_params(model: nnx.Module) -> dict[str, Any]:
    """A model's parameters as canonical path -> value (array or ``MXTensor``)."""
    return {".".join(map(str, k)): v.get_value() for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def default_layout(table: tuple[Param, ...], prefix: str, mx: bool, shard_bytes: int) -> list[dict]:
    """Shards of about ``shard_bytes`` in parameter order: [{"file", "metadata", "tensors": [[name, dtype, shape]]}]."""
    specs, _ = released_specs(table, prefix, mx)
    groups: list[list[Released]] = [[]]
    size = 0
    for s in specs:
        n = nbytes(s.shape, s.dtype)
        if groups[-1] and size + n > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(s)
        size += n
    count = len(groups)
    names = ["model.safetensors"] if count == 1 else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
    return [{"file": f, "metadata": {"format": "pt"}, "tensors": [[s.name, s.dtype, list(s.shape)] for s in g]}
            for f, g in zip(names, groups)]


def _value(params: Params, spec: Released, kinds: Mapping[str, str], tails: Mapping[str, list[str]]) -> np.ndarray:
    if spec.param not in params:
        raise CheckpointError(f"export: parameter {spec.param} (for tensor {spec.name!r}) is missing from the params")
    value = params[spec.param]
    if spec.expert is not None:
        return expert_row(value, spec)
    if kinds[spec.param] == "a_log":
        tail = np.array([float.fromhex(h) for h in tails.get(spec.name, [])], np.float32)
        return a_log_to_released(np.asarray(value, np.float32), spec.shape, tail)
    return np.asarray(value).astype(DTYPES[spec.dtype], copy=False)


def export(
    params: Params, hf_config: Mapping[str, Any], out: str | Path, *, layout: Mapping[str, Any] | None = None,
    shard_bytes: int = 5 << 30, quiet: bool = True, config_text: str | None = None,
) -> Path:
    """Write ``params`` as a released-layout checkpoint folder ``out`` (config.json, shards, index).

    ``layout`` is a manifest's ``source`` section (shards, prefix, A_log padding) for a
    bit-identical round trip; default: ``default_layout``. Shards are written one tensor at a
    time into ``<out>.partial/``, renamed to ``out`` at the end. ``config_text`` (the source's
    config.json bytes) is written verbatim instead of ``hf_config`` re-serialized.
    """
    out = Path(out)
    if out.exists():
        raise CheckpointError(f"{out}: already exists; remove it or choose another output path")
    cfg = from_hf_config(hf_config)
    table = param_table(cfg)
    prefix = layout["prefix"] if layout else prefix_for(hf_config)
    shards = list(layout["shards"]) if layout else default_layout(table, prefix, cfg.mx_experts, shard_bytes)
    tails = layout.get("a_log_tails", {}) if layout else {}
    present = {n: TensorInfo(n, d, tuple(s), Path("layout"), 0, 0) for sh in shards for n, d, s in sh["tensors"]}
    mx = any(n.endswith(".weight_packed") for n in present)
    specs, missing = released_specs(table, prefix, mx, present)
    if missing:
        raise CheckpointError(f"export: the layout lacks {len(missing)} tensor(s) the config needs, e.g. {missing[0]}")
    by_name = {s.name: s for s in specs}
    kinds = {p.path: p.kind for p in table}
    partial = out.with_name(out.name + ".partial")
    if partial.exists():
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    bar = Progress(sum(nbytes(tuple(s), d) for sh in shards for _, d, s in sh["tensors"]), f"export {out.name}",
                   quiet=quiet)

    def get(name: str) -> np.ndarray:
        a = _value(params, by_name[name], kinds, tails)
        bar.advance(a.nbytes)
        return a

    for sh in shards:
        entries = [(n, d, tuple(s)) for n, d, s in sh["tensors"]]
        write_safetensors(partial / sh["file"], entries, get, sh.get("metadata") or None)
    bar.close()
    if len(shards) > 1 or shards[0]["file"] != "model.safetensors":
        weight_map = {n: sh["file"] for sh in shards for n, _, _ in sh["tensors"]}
        total = sum(nbytes(tuple(s), d) for sh in shards for _, d, s in sh["tensors"])
        (partial / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                     indent=2))
    (partial / "config.json").write_text(config_text if config_text is not None else json.dumps(hf_config, indent=2))
    partial.rename(out)
    return out


def read_params(ckpt: str | Path) -> dict[str, Any]:
    """All parameters of a k3jax checkpoint in memory: numpy arrays / ``MXTensor`` of numpy arrays."""
    return dict(CheckpointParams(ckpt, cache_parts=1))


def export_checkpoint(ckpt: str | Path, out: str | Path, *, quiet: bool = True) -> Path:
    """A k3jax checkpoint folder -> released safetensors in its source's layout (bit-identical round
    trip). Streams: parameters are read part by part (``CheckpointParams``), never all at once."""
    params = CheckpointParams(ckpt)
    text = (Path(ckpt) / "config.json").read_text()
    return export(params, json.loads(text), out, layout=params.manifest["source"], quiet=quiet, config_text=text)


__all__ = ["default_layout", "export", "export_checkpoint", "model_params", "read_params"]
