"""Helpers for the converter tests and benchmark: small configs with every feature, folder surgery."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

import numpy as np

from convert.safetensors_io import INDEX_FILE, dtype_name, open_checkpoint, read_tensor, write_safetensors
from k3jax.presets import preset_hf_config


def k3_config() -> dict:
    """Preset 'tiny' cut to 5 layers (KDA x3, MLA, MLA), AttnRes blocks of 2, MXFP4 experts."""
    hf = preset_hf_config("tiny")
    tc = hf["text_config"]
    tc.update(num_hidden_layers=5, attn_res_block_size=2)
    tc["linear_attn_config"].update(full_attn_layers=[4, 5], kda_layers=[1, 2, 3])
    return hf


def linear_config() -> dict:
    """Preset 'tiny_linear' cut to 3 layers (KDA, KDA, MLA), bf16 experts."""
    hf = preset_hf_config("tiny_linear")
    hf.update(num_hidden_layers=3)
    hf["linear_attn_config"].update(full_attn_layers=[3], kda_layers=[1, 2])
    return hf


def copy_folder(src: Path, dst: Path) -> Path:
    """A copy of a checkpoint folder to mutate."""
    shutil.copytree(src, dst)
    return dst


def edit_tensors(folder: Path, edit: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]], shard: int = 0) -> None:
    """Rewrite one shard with ``edit(name -> array)`` applied, and rewrite the index to match
    (shard by shard, as ``export`` writes it)."""
    src = open_checkpoint(folder)
    sh = src.shards[shard]
    tensors = edit({t.name: np.array(read_tensor(t)) for t in sh.tensors})
    entries = [(n, dtype_name(a.dtype), a.shape) for n, a in tensors.items()]
    tmp = folder / (sh.file + ".new")
    write_safetensors(tmp, entries, tensors.__getitem__, sh.metadata)
    tmp.replace(folder / sh.file)
    index = folder / INDEX_FILE
    if index.is_file():
        data = json.loads(index.read_text())
        names = {s.file: [t.name for t in s.tensors] for s in src.shards}
        names[sh.file] = list(tensors)
        data["weight_map"] = {n: f for f, ns in names.items() for n in ns}
        index.write_text(json.dumps(data, indent=2))


def same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal dtype, shape and bytes (NaN-safe, -0.0-aware)."""
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


__all__ = ["copy_folder", "edit_tensors", "k3_config", "linear_config", "same_bytes"]
