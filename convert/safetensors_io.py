"""Safetensors without torch: validated headers, memory-mapped tensor reads, a streaming writer.

File format: 8-byte little-endian header length N, N bytes of JSON
(``{"__metadata__": {...}, name: {"dtype": "BF16", "shape": [...], "data_offsets": [a, b]}}``),
then the data region; ``data_offsets`` are relative to the start of the data region.
Every check raises ``CheckpointError`` naming the file (and tensor) and what was expected.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import ml_dtypes
import numpy as np

MAX_HEADER_BYTES = 100 << 20

DTYPES: dict[str, np.dtype] = {
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F16": np.dtype(np.float16),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
    "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8),
    "I16": np.dtype(np.int16),
    "I32": np.dtype(np.int32),
    "I64": np.dtype(np.int64),
    "BOOL": np.dtype(np.bool_),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
}
_NAMES = {v: k for k, v in DTYPES.items()}


class CheckpointError(ValueError):
    """A checkpoint that is malformed or does not match what the model needs."""


def dtype_name(dtype: Any) -> str:
    """numpy/JAX dtype -> safetensors dtype string ("BF16", "F32", "U8", ...)."""
    d = np.dtype(dtype)
    if d not in _NAMES:
        raise CheckpointError(f"dtype {d} has no safetensors name; supported: {sorted(DTYPES)}")
    return _NAMES[d]


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a safetensors file: absolute byte range [start, end) in ``file``."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: Path
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def np_dtype(self) -> np.dtype:
        return DTYPES[self.dtype]


def read_header(path: str | os.PathLike) -> tuple[list[TensorInfo], dict[str, str]]:
    """Parse and validate a safetensors header -> (tensors in header order, ``__metadata__``).

    Checks: the length prefix fits the file, the JSON parses, each entry has a known dtype, a
    shape of non-negative ints, offsets matching shape x itemsize, no overlaps, and the file is
    exactly as long as the header says (a shorter file is reported as truncated).
    """
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise CheckpointError(f"{path}: corrupt header: file has {size} bytes, fewer than the 8-byte length prefix")
        n = int.from_bytes(prefix, "little")
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise CheckpointError(
                f"{path}: corrupt header: length prefix says {n} header bytes but the file has {size} bytes"
            )
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt header: not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt header: expected a JSON object, got {type(header).__name__}")
    meta = header.pop("__metadata__", None) or {}
    base = 8 + n
    infos = [_entry(path, name, spec, base) for name, spec in header.items()]
    by_start = sorted(infos, key=lambda t: t.start)
    for a, b in zip(by_start, by_start[1:]):
        if b.start < a.end:
            raise CheckpointError(f"{path}: corrupt header: tensors {a.name!r} and {b.name!r} overlap")
    data_end = max((t.end for t in infos), default=base)
    if data_end > size:
        raise CheckpointError(
            f"{path}: truncated: the header says the data ends at byte {data_end} but the file has {size} bytes"
        )
    if data_end < size:
        raise CheckpointError(
            f"{path}: corrupt: {size - data_end} unexpected trailing bytes after the last tensor (ends at {data_end})"
        )
    return infos, dict(meta)


def _entry(path: Path, name: str, spec: Any, base: int) -> TensorInfo:
    where = f"{path}: tensor {name!r}"
    if not isinstance(spec, dict) or not {"dtype", "shape", "data_offsets"} <= spec.keys():
        raise CheckpointError(f"{where}: corrupt header entry {spec!r}; expected dtype, shape and data_offsets")
    dtype, shape, offsets = spec["dtype"], spec["shape"], spec["data_offsets"]
    if dtype not in DTYPES:
        raise CheckpointError(f"{where}: unknown dtype {dtype!r}; expected one of {sorted(DTYPES)}")
    if not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
        raise CheckpointError(f"{where}: corrupt shape {shape!r}; expected a list of non-negative ints")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
        raise CheckpointError(f"{where}: corrupt data_offsets {offsets!r}; expected [begin, end]")
    a, b = offsets
    want = math.prod(shape) * DTYPES[dtype].itemsize
    if a < 0 or b - a != want:
        raise CheckpointError(
            f"{where}: data_offsets {offsets} span {b - a} bytes but {dtype} {tuple(shape)} needs {want}"
        )
    return TensorInfo(name, dtype, tuple(shape), path, base + a, base + b)


def read_tensor(info: TensorInfo) -> np.ndarray:
    """A read-only memory-mapped view dtype[shape] of one tensor (no copy; pages load on access)."""
    if info.nbytes == 0:
        return np.zeros(info.shape, info.np_dtype)
    return np.memmap(info.file, dtype=info.np_dtype, mode="r", offset=info.start, shape=info.shape)


def header_bytes(entries: Iterable[tuple[str, str, tuple[int, ...]]], metadata: Mapping[str, str] | None) -> bytes:
    """The length prefix plus JSON header (compact, padded with spaces to 8 bytes) for tensors
    (name, dtype, shape) laid out back to back in the given order."""
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    for name, dtype, shape in entries:
        n = math.prod(shape) * DTYPES[dtype].itemsize
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw


def write_safetensors(
    path: str | os.PathLike,
    entries: list[tuple[str, str, tuple[int, ...]]],
    get: Callable[[str], np.ndarray],
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Stream a safetensors file: header first, then ``get(name)`` for each entry in order.

    ``get`` returns an array of the declared dtype and shape; only one tensor is held at a time.
    """
    with open(path, "wb") as f:
        f.write(header_bytes(entries, metadata))
        for name, dtype, shape in entries:
            a = np.ascontiguousarray(get(name))
            if a.dtype != DTYPES[dtype] or a.shape != tuple(shape):
                raise CheckpointError(
                    f"{path}: tensor {name!r} is {dtype_name(a.dtype)} {a.shape}; expected {dtype} {tuple(shape)}"
                )
            f.write(a.reshape(-1).view(np.uint8).data)


INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


@dataclass(frozen=True)
class Shard:
    """One safetensors file of a checkpoint: its name, tensors in header order and ``__metadata__``."""

    file: str
    tensors: tuple[TensorInfo, ...]
    metadata: Mapping[str, str]


@dataclass(frozen=True)
class SourceCheckpoint:
    """A released checkpoint folder: ``config.json`` and its shards, validated, nothing loaded."""

    folder: Path
    config: Mapping[str, Any]
    shards: tuple[Shard, ...]

    @property
    def tensors(self) -> dict[str, TensorInfo]:
        return {t.name: t for s in self.shards for t in s.tensors}

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for s in self.shards for t in s.tensors)


def read_config(folder: Path) -> dict[str, Any]:
    """``folder/config.json`` as a dict (raises ``CheckpointError`` if missing or not JSON)."""
    path = folder / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path}: missing; a checkpoint folder needs its config.json")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None


def open_checkpoint(folder: str | os.PathLike) -> SourceCheckpoint:
    """Read and cross-check ``config.json``, the index (or the single ``model.safetensors``) and
    every shard header. Shards keep the index's order of first appearance."""
    folder = Path(folder)
    config = read_config(folder)
    index_path = folder / INDEX_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index_path}: corrupt index, expected a JSON object with 'weight_map' ({e!r})") from None
        files = list(dict.fromkeys(weight_map.values()))
    elif (folder / SINGLE_FILE).is_file():
        weight_map, files = None, [SINGLE_FILE]
    else:
        raise CheckpointError(f"{folder}: no {INDEX_FILE} and no {SINGLE_FILE}")
    shards, seen = [], {}
    for name in files:
        path = folder / name
        if not path.is_file():
            raise CheckpointError(f"{index_path}: lists shard {name!r} but {path} does not exist")
        infos, meta = read_header(path)
        for t in infos:
            if t.name in seen:
                raise CheckpointError(f"{path}: tensor {t.name!r} is also in {seen[t.name]}")
            seen[t.name] = name
            if weight_map is not None and weight_map.get(t.name) != name:
                raise CheckpointError(
                    f"{path}: tensor {t.name!r} is in this shard but {INDEX_FILE} says {weight_map.get(t.name)!r}"
                )
        shards.append(Shard(name, tuple(infos), meta))
    if weight_map is not None:
        lost = [n for n in weight_map if n not in seen]
        if lost:
            raise CheckpointError(
                f"{index_path}: {len(lost)} indexed tensor(s) are in no shard header, e.g. {lost[0]!r} "
                f"(expected in {weight_map[lost[0]]})"
            )
    return SourceCheckpoint(folder, config, tuple(shards))


__all__ = [
    "CheckpointError",
    "INDEX_FILE",
    "SINGLE_FILE",
    "Shard",
    "SourceCheckpoint",
    "open_checkpoint",
    "read_config",
    "DTYPES",
    "TensorInfo",
    "dtype_name",
    "header_bytes",
    "read_header",
    "read_tensor",
    "write_safetensors",
]
