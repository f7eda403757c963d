"""Safetensors without torch: validated headers, memory-mapped tensor reads, a streaming writer.

File format: 8-byte little-endian header length N, N bytes of JSON
(``{"__metadata__": {...}, name: {"dtype": "BF16", "shape": [...], "data_offsets": [a, b]}}``),
then the data region; ``data_offsets`` are relative to the start of the data region.
Headers, the index and config.json are read with typed getters (``k3jax.json_schema``); a shard
named by the index must be a file name inside the checkpoint folder. Every check raises
``CheckpointError`` naming the file (and tensor or key) and what was expected.
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

from k3jax.json_schema import Fields, inside, parse_json, read_json, safe_name

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
FLOATS = ("BF16", "F16", "F32")  # the weight dtypes a checkpoint may be saved in (HF: the model's dtype)


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

    Checks: the length prefix fits the file, the JSON parses (no key twice), ``__metadata__`` is an
    object of strings, each entry has a known dtype, a shape of non-negative ints, offsets matching
    shape x itemsize, the tensors tile the data region without overlaps or holes, and the file is
    exactly as long as the header says (a shorter file is reported as truncated).
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            prefix = f.read(8)
            n = int.from_bytes(prefix, "little")
            raw = f.read(n) if len(prefix) == 8 and n <= MAX_HEADER_BYTES and 8 + n <= size else b""
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read it ({e.strerror or e})") from None
    if len(prefix) < 8:
        raise CheckpointError(f"{path}: corrupt header: file has {size} bytes, fewer than the 8-byte length prefix")
    if n > MAX_HEADER_BYTES or 8 + n > size:
        raise CheckpointError(f"{path}: corrupt header: length prefix says {n} header bytes but the file has {size} bytes")
    header = Fields(parse_json(raw, f"{path}: corrupt header", CheckpointError), str(path), CheckpointError)
    meta = header.str_map("__metadata__", {})
    base = 8 + n
    infos = [_entry(header.fields(name), name, base) for name in header if name != "__metadata__"]
    end, last = base, None
    for t in sorted(infos, key=lambda t: (t.start, t.end)):
        if t.start < end:
            raise CheckpointError(f"{path}: corrupt header: tensors {last!r} and {t.name!r} overlap")
        if t.start > end:
            raise CheckpointError(f"{path}: corrupt header: {t.start - end} unused bytes before tensor {t.name!r}")
        end, last = t.end, t.name
    if end > size:
        raise CheckpointError(f"{path}: truncated: the header says the data ends at byte {end} but the file has "
                              f"{size} bytes")
    if end < size:
        raise CheckpointError(
            f"{path}: corrupt: {size - end} unexpected trailing bytes after the last tensor (ends at {end})"
        )
    return infos, meta


def _entry(entry: Fields, name: str, base: int) -> TensorInfo:
    dtype = entry.str("dtype", choices=tuple(DTYPES))
    shape = entry.int_list("shape", minimum=0)
    offsets = entry.int_list("data_offsets", minimum=0)
    if len(offsets) != 2:
        raise entry.fail("data_offsets", "[begin, end]", offsets)
    a, b = offsets
    want = math.prod(shape) * DTYPES[dtype].itemsize
    if b - a != want:
        raise CheckpointError(
            f"{entry.source}: tensor {name!r}: data_offsets {offsets} span {b - a} bytes but {dtype} {tuple(shape)} "
            f"needs {want}"
        )
    return TensorInfo(name, dtype, tuple(shape), Path(entry.source), base + a, base + b)


def read_tensor(info: TensorInfo) -> np.ndarray:
    """A read-only memory-mapped view dtype[shape] of one tensor (no copy; pages load on access)."""
    if info.nbytes == 0:
        return np.zeros(info.shape, info.np_dtype)
    try:
        return np.memmap(info.file, dtype=info.np_dtype, mode="r", offset=info.start, shape=info.shape)
    except (OSError, ValueError) as e:  # ValueError: the file shrank since its header was read
        cause = getattr(e, "strerror", None) or e
        raise CheckpointError(f"{info.file}: cannot read tensor {info.name!r} ({cause})") from None


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
    """``folder/config.json`` as a dict (``CheckpointError`` if missing, unreadable, not JSON or not an object)."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path}: missing; a checkpoint folder needs its config.json")
    return Fields(read_json(path, CheckpointError), str(path), CheckpointError).data


def read_index(path: Path) -> dict[str, str]:
    """The ``weight_map`` (tensor name -> shard file name) of a safetensors index file."""
    index = Fields(read_json(path, CheckpointError), str(path), CheckpointError)
    weight_map = index.str_map("weight_map")
    for name, file in weight_map.items():
        safe_name(file, str(path), f"weight_map[{name!r}]", CheckpointError)
    return weight_map


def open_checkpoint(folder: str | os.PathLike) -> SourceCheckpoint:
    """Read and cross-check ``config.json``, the index (or the single ``model.safetensors``) and
    every shard header. Shards keep the index's order of first appearance; a shard must be a file
    name inside ``folder`` (no path, no link out of it)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: not a folder; expected a checkpoint folder (config.json and safetensors)")
    config = read_config(folder)
    index_path = folder / INDEX_FILE
    if index_path.is_file():
        weight_map = read_index(index_path)
        files = list(dict.fromkeys(weight_map.values()))
    elif (folder / SINGLE_FILE).is_file():
        weight_map, files = None, [SINGLE_FILE]
    else:
        raise CheckpointError(f"{folder}: no {INDEX_FILE} and no {SINGLE_FILE}")
    shards, seen = [], {}
    for name in files:
        path = inside(folder, name, str(index_path), CheckpointError)
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
    "FLOATS",
    "TensorInfo",
    "read_index",
    "dtype_name",
    "header_bytes",
    "read_header",
    "read_tensor",
    "write_safetensors",
]
