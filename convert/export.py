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

from convert.integrity import CheckpointParams
from k3jax.json_schema import Fields, parse_json
from convert.manifest import check_layout
from convert.names import (
    Param, Released, a_log_to_released, expert_row, nbytes, param_table, prefix_for, released_specs,
)
from convert.partial import ConversionError
from convert.progress import Progress
from convert.safetensors_io import (
    DTYPES, FLOATS, INDEX_FILE, SINGLE_FILE, CheckpointError, TensorInfo, write_safetensors,
)
from k3jax.config import from_hf_config

Params = Mapping[str, Any]  # canonical path -> array [shape] or MXTensor


def model_params(model: nnx.Module) -> dict[str, Any]:
    """A model's parameters as canonical path -> value (array or ``MXTensor``)."""
    return {".".join(map(str, k)): v.get_value() for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def default_layout(table: tuple[Param, ...], prefix: str, mx: bool, shard_bytes: int,
                   dtype: str | None = None) -> list[dict]:
    """Shards of about ``shard_bytes`` in parameter order: [{"file", "metadata", "tensors": [[name, dtype, shape]]}].
    ``dtype`` ("BF16", "F16", "F32"; default the released dtypes) is every float tensor's, as HF
    saves a model held in that dtype."""
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
    kind = lambda s: dtype if dtype and s.dtype in FLOATS else s.dtype
    return [{"file": f, "metadata": {"format": "pt"}, "tensors": [[s.name, kind(s), list(s.shape)] for s in g]}
            for f, g in zip(names, groups)]


def _value(params: Params, spec: Released, dtype: str, kinds: Mapping[str, str],
           tails: Mapping[str, list[str]]) -> np.ndarray:
    """The released tensor ``spec`` in safetensors ``dtype``, from the canonical ``params``."""
    value = params[spec.param]
    if spec.expert is not None:
        return expert_row(value, spec).astype(DTYPES[dtype], copy=False)
    if kinds[spec.param] == "a_log":
        tail = np.array([float.fromhex(h) for h in tails.get(spec.name, [])], np.float32)
        return a_log_to_released(np.asarray(value, np.float32), spec.shape, tail).astype(DTYPES[dtype], copy=False)
    return np.asarray(value).astype(DTYPES[dtype], copy=False)


def export(
    params: Params, hf_config: Mapping[str, Any], out: str | Path, *, layout: Mapping[str, Any] | None = None,
    shard_bytes: int = 5 << 30, dtype: str | None = None, quiet: bool = True, config_text: str | None = None,
) -> Path:
    """Write ``params`` as a released-layout checkpoint folder ``out`` (config.json, shards, index).

    ``layout`` is a manifest's ``source`` section (shards, prefix, A_log padding) for a
    bit-identical round trip; default: ``default_layout`` (float tensors in ``dtype``, default the
    released dtypes). Everything is checked before a byte is written (the layout's file names are
    plain names, every tensor's parameter is present). Shards are written one tensor at a time
    into ``<out>.partial/``, renamed to ``out`` at the end; on any failure that folder is removed
    (export does not resume) and ``ConversionError`` (writing) or ``CheckpointError`` (reading)
    says so. ``config_text`` (the source's config.json bytes) is written verbatim.
    """
    out = Path(out)
    if out.exists():
        raise CheckpointError(f"{out}: already exists; remove it or choose another output path")
    cfg = from_hf_config(hf_config)
    table = param_table(cfg)
    if layout is not None:
        check_layout(Fields(layout, "export layout", CheckpointError))
    prefix = layout["prefix"] if layout else prefix_for(hf_config)
    shards = list(layout["shards"]) if layout else default_layout(table, prefix, cfg.mx_experts, shard_bytes, dtype)
    tails = layout.get("a_log_tails", {}) if layout else {}
    present = {n: TensorInfo(n, d, tuple(s), Path("layout"), 0, 0) for sh in shards for n, d, s in sh["tensors"]}
    mx = any(n.endswith(".weight_packed") for n in present)
    specs, missing = released_specs(table, prefix, mx, present)
    if missing:
        raise CheckpointError(f"export: the layout lacks {len(missing)} tensor(s) the config needs, e.g. {missing[0]}")
    by_name = {s.name: s for s in specs}
    unplaced = [n for n in present if n not in by_name]
    absent = sorted({s.param for s in specs if s.param not in params})
    if unplaced or absent:
        raise CheckpointError(f"export: {len(unplaced)} layout tensor(s) have no k3jax parameter (e.g. {unplaced[:1]}) "
                              f"and {len(absent)} parameter(s) are missing from the params (e.g. {absent[:1]})")
    kinds = {p.path: p.kind for p in table}
    total = sum(nbytes(tuple(s), d) for sh in shards for _, d, s in sh["tensors"])
    bar = Progress(total, f"export {out.name}", quiet=quiet)
    partial = out.with_name(out.name + ".partial")
    try:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        for sh in shards:
            entries = [(n, d, tuple(s)) for n, d, s in sh["tensors"]]
            dtypes = {n: d for n, d, _ in entries}
            get = lambda name: _advanced(bar, _value(params, by_name[name], dtypes[name], kinds, tails))
            write_safetensors(partial / sh["file"], entries, get, sh.get("metadata") or None)
        bar.close()
        if len(shards) > 1 or shards[0]["file"] != SINGLE_FILE:
            weight_map = {n: sh["file"] for sh in shards for n, _, _ in sh["tensors"]}
            (partial / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                         indent=2))
        (partial / "config.json").write_text(config_text if config_text is not None else json.dumps(hf_config, indent=2))
        partial.rename(out)
    except OSError as e:
        shutil.rmtree(partial, ignore_errors=True)
        raise ConversionError(f"{e.filename or partial}: writing failed ({e.strerror or e}); {partial} was removed, "
                              f"nothing was exported") from e
    except CheckpointError as e:  # a damaged part of the checkpoint being exported, found as it is read
        shutil.rmtree(partial, ignore_errors=True)
        raise CheckpointError(f"{e}; {partial} was removed, nothing was exported") from None
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return out


def _advanced(bar: Progress, array: np.ndarray) -> np.ndarray:
    bar.advance(array.nbytes)
    return array


def read_params(ckpt: str | Path) -> dict[str, Any]:
    """All parameters of a k3jax checkpoint in memory: numpy arrays / ``MXTensor`` of numpy arrays."""
    return dict(CheckpointParams(ckpt, cache_parts=1))


def export_checkpoint(ckpt: str | Path, out: str | Path, *, quiet: bool = True) -> Path:
    """A k3jax checkpoint folder -> released safetensors in its source's layout (bit-identical round
    trip unless converted with a ``dtype``). Streams: parameters are read part by part, each
    part's structure and CRC-32s checked, never all at once."""
    ckpt = Path(ckpt)
    params = CheckpointParams(ckpt, verify=True)
    path = ckpt / "config.json"
    try:
        text = path.read_text()
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read it ({e.strerror or e})") from None
    hf_config = Fields(parse_json(text, str(path), CheckpointError), str(path), CheckpointError).data
    return export(params, hf_config, out, layout=params.manifest["source"], quiet=quiet, config_text=text)


__all__ = ["default_layout", "export", "export_checkpoint", "model_params", "read_params"]
