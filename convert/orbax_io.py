"""The k3jax checkpoint on disk: orbax parts plus one JSON manifest.

```
<ckpt>/config.json            the released config.json, copied
<ckpt>/k3jax_checkpoint.json  manifest: every canonical parameter -> part, shape, dtype; the source layout
<ckpt>/parts/part_00000/      an orbax PyTree checkpoint holding some parameters (about 1 GB a part)
```
A part's tree is nested by the dotted canonical path; an MXFP4 parameter ``p`` is two leaves,
``p.codes`` uint8 [..., N, K//2] and ``p.scales`` uint8 [..., N, K//32]. Splitting into parts is
what lets the converter stream (hold one part, never the model) and resume part by part.
"""

from __future__ import annotations

import json
import logging
import os
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint._src.serialization import type_handler_registry, type_handlers

from convert.safetensors_io import CheckpointError
from k3jax.mx import MXTensor

MANIFEST = "k3jax_checkpoint.json"
PARTS = "parts"
FORMAT = "k3jax-checkpoint"
VERSION = 1


def part_name(index: int) -> str:
    return f"part_{index:05d}"


def _nest(leaves: Mapping[str, np.ndarray]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for key, value in leaves.items():
        node = tree
        *parents, last = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return tree


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(_flatten(value, name + "."))
        else:
            out[name] = value
    return out


def _writer() -> ocp.Checkpointer:
    """Orbax PyTree writer for numpy leaves: no compression, one zarr array per leaf (no OCDBT
    database: faster here), and no defensive deep copy of the arrays (the converter hands over
    arrays it no longer touches), so a part costs its own bytes in memory, not twice."""
    registry = type_handler_registry.create_type_handler_registry(
        (np.ndarray, type_handlers.NumpyHandler(deepcopy_host_arrays=False))
    )
    handler = ocp.PyTreeCheckpointHandler(use_compression=False, use_ocdbt=False, type_handler_registry=registry)
    return ocp.Checkpointer(handler)


class _QuietOrbax(logging.Filter):
    """Drops orbax's per-save warnings that our writer settings trigger on purpose (numpy leaves
    only, no OCDBT), which would otherwise print twice per part under the progress bar."""

    _EXPECTED = ("No jax.Array in TypeHandlerRegistry", "Skipping merge of OCDBT checkpoints")

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(m in record.getMessage() for m in self._EXPECTED)


def write_part(directory: Path, leaves: Mapping[str, np.ndarray]) -> None:
    """Save ``leaves`` (dotted key -> array) as one orbax PyTree checkpoint; orbax writes to a
    temporary folder and renames it, so ``directory`` appears only complete."""
    quiet = _QuietOrbax()
    logging.getLogger("absl").addFilter(quiet)
    checkpointer = None
    try:
        checkpointer = _writer()
        checkpointer.save(Path(directory).absolute(), args=ocp.args.PyTreeSave(_nest(leaves)))
    finally:
        if checkpointer is not None:
            checkpointer.close()
        logging.getLogger("absl").removeFilter(quiet)


def read_part(directory: Path) -> dict[str, np.ndarray]:
    """Restore one part -> dotted key -> numpy array."""
    checkpointer = ocp.PyTreeCheckpointer()
    try:
        tree = checkpointer.restore(Path(directory).absolute())
    finally:
        checkpointer.close()
    return {k: np.asarray(v) for k, v in _flatten(tree).items()}


def part_is_complete(directory: Path) -> bool:
    """True once orbax has finalized the part (its metadata file is present)."""
    return (Path(directory) / "_CHECKPOINT_METADATA").is_file()


def write_json(path: Path, data: Mapping[str, Any]) -> None:
    """Write JSON via a temporary file and rename, so a reader never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def read_manifest(folder: Path) -> dict[str, Any]:
    """The manifest of a finished k3jax checkpoint; raises ``CheckpointError`` if absent or foreign."""
    path = Path(folder) / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"{path}: missing; {folder} is not a finished k3jax checkpoint")
    data = json.loads(path.read_text())
    if data.get("format") != FORMAT or data.get("version") != VERSION:
        raise CheckpointError(
            f"{path}: format {data.get('format')!r} version {data.get('version')!r}; expected {FORMAT!r} {VERSION}"
        )
    return data


def is_k3jax_checkpoint(folder: Path) -> bool:
    return (Path(folder) / MANIFEST).is_file()


class CheckpointParams(Mapping):
    """A k3jax checkpoint's parameters, read lazily: canonical path -> numpy array, or ``MXTensor``
    (codes uint8 [..., N, K//2], scales uint8 [..., N, K//32]) for MXFP4 experts. Parts are restored
    on first use and the ``cache_parts`` most recent kept, so memory stays near that many parts
    (export reads a layer's w1/w2/w3 stacks interleaved: keep at least 3). Iteration goes part by part."""

    def __init__(self, folder: str | os.PathLike, cache_parts: int = 4):
        self.folder = Path(folder)
        self.manifest = read_manifest(self.folder)
        self.params: dict[str, Any] = self.manifest["params"]
        self.cache_parts = cache_parts
        self._cache: OrderedDict[str, dict[str, np.ndarray]] = OrderedDict()

    def _part(self, name: str) -> dict[str, np.ndarray]:
        if name in self._cache:
            self._cache.move_to_end(name)
        else:
            while len(self._cache) >= self.cache_parts:
                self._cache.popitem(last=False)
            self._cache[name] = read_part(self.folder / PARTS / name)
        return self._cache[name]

    def __getitem__(self, path: str) -> Any:
        info = self.params[path]
        leaves = self._part(info["part"])
        if info["dtype"] == "MXFP4":
            return MXTensor(leaves[path + ".codes"], leaves[path + ".scales"])
        return leaves[path]

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self.params, key=lambda p: self.params[p]["part"]))

    def __len__(self) -> int:
        return len(self.params)


__all__ = [
    "CheckpointParams",
    "FORMAT",
    "MANIFEST",
    "PARTS",
    "VERSION",
    "is_k3jax_checkpoint",
    "part_is_complete",
    "part_name",
    "read_manifest",
    "read_part",
    "write_json",
    "write_part",
]
