"""Reading a k3jax checkpoint with its structure checked, and its contents on request.

Structure (always, cheap): the manifest's types (``convert.manifest``), every part folder present,
a part's files and their sizes before orbax restores it, the restored arrays' names, shapes and
dtypes after. Contents (``verify=True``): each array's CRC-32 (zlib's; computed from the arrays
as they were written) against the manifest's, several arrays at once on threads. Every mismatch
raises ``CheckpointError`` naming the part or file and what was expected.
"""

from __future__ import annotations

import os
import time
import zlib
from collections import OrderedDict
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from k3jax.json_schema import inside
from convert.manifest import MANIFEST, PARTS, read_manifest
from convert.orbax_io import map_part, read_part
from convert.progress import Progress
from convert.safetensors_io import CheckpointError, dtype_name
from k3jax.mx import BLOCK, MXTensor


def crc32(array: np.ndarray) -> str:
    """CRC-32 of an array's bytes in C order, as 8 lowercase hex digits."""
    return f"{zlib.crc32(np.ascontiguousarray(array).reshape(-1).view(np.uint8)):08x}"


def checksums(leaves: Mapping[str, np.ndarray]) -> dict[str, str]:
    """``crc32`` of every array (key -> hex), computed on up to 8 threads (zlib releases the GIL)."""
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        return dict(zip(leaves, pool.map(crc32, leaves.values())))


def part_files(directory: Path) -> dict[str, int]:
    """Every file below ``directory``: '/'-separated relative path -> size in bytes, sorted."""
    out = {}
    for root, _, files in os.walk(directory):
        for f in files:
            path = Path(root, f)
            out[path.relative_to(directory).as_posix()] = path.stat().st_size
    return dict(sorted(out.items()))


def _check_files(directory: Path, files: Mapping[str, int]) -> None:
    try:
        found = part_files(directory)
    except OSError as e:
        raise CheckpointError(f"{e.filename or directory}: cannot read it ({e.strerror or e})") from None
    missing = [f for f in files if f not in found]
    if missing:
        raise CheckpointError(f"{directory}: {len(missing)} file(s) of this part are missing, e.g. {missing[0]}; "
                              f"the checkpoint is damaged")
    for f, size in files.items():
        if found[f] != size:
            raise CheckpointError(f"{directory / f}: {found[f]} bytes but the manifest says {size} (truncated or "
                                  f"replaced); the checkpoint is damaged")


def _expected(path: str, info: Mapping[str, Any]) -> dict[str, tuple[tuple[int, ...], str]]:
    """The arrays a manifest parameter is stored as: key -> (shape, safetensors dtype)."""
    shape = tuple(info["shape"])
    if info["dtype"] != "MXFP4":
        return {path: (shape, info["dtype"])}
    *lead, k = shape
    return {path + ".codes": ((*lead, k // 2), "U8"), path + ".scales": ((*lead, k // BLOCK), "U8")}


def read_checked_part(folder: Path, name: str, manifest: Mapping[str, Any], params: list[str], *,
                      verify: bool, mapped: bool = False) -> dict[str, np.ndarray]:
    """Restore part ``name`` holding the manifest's ``params`` -> array key -> numpy array, after
    checking its files and, once restored, its arrays (and their CRC-32 with ``verify``). With
    ``mapped`` (and not ``verify``) the arrays are ``StoredArray``s where the part's layout allows
    (``map_part``): only their sizes are checked now, and each is read where it is indexed."""
    directory = folder / PARTS / name
    entry = manifest["parts"][name]
    _check_files(directory, entry["files"])
    leaves = map_part(directory) if mapped and not verify else None
    leaves = read_part(directory) if leaves is None else leaves
    expected = {k: v for p in params for k, v in _expected(p, manifest["params"][p]).items()}
    if set(leaves) != set(expected):
        odd = sorted(set(leaves) ^ set(expected))[:3]
        raise CheckpointError(f"{directory}: holds other arrays than the manifest lists (differing: {odd}); "
                              f"the checkpoint is damaged")
    for key, (shape, dtype) in expected.items():
        got = leaves[key]
        if got.shape != shape or dtype_name(got.dtype) != dtype:
            raise CheckpointError(f"{directory}: array {key} is {dtype_name(got.dtype)} {list(got.shape)} but the "
                                  f"manifest says {dtype} {list(shape)}; the checkpoint is damaged")
    if verify:
        for key, crc in checksums(leaves).items():
            if crc != entry["crc32"][key]:
                raise CheckpointError(f"{directory}: array {key} fails its CRC-32 check (read {crc}, written "
                                      f"{entry['crc32'][key]}); the checkpoint is damaged")
    return leaves


class CheckpointParams(Mapping):
    """A k3jax checkpoint's parameters, read lazily: canonical path -> numpy array, or ``MXTensor``
    (codes uint8 [..., N, K//2], scales uint8 [..., N, K//32]) for MXFP4 experts. Parts are restored
    on first use and the ``cache_parts`` most recent kept, so memory stays near that many parts
    (export reads a layer's w1/w2/w3 stacks interleaved: keep at least 3). Iteration goes part by
    part. Structure is checked as parts are read (every part folder's presence at once); contents
    with ``verify``. ``mapped``: arrays are read only where indexed (``read_checked_part``)."""

    def __init__(self, folder: str | os.PathLike, cache_parts: int = 4, *, verify: bool = False,
                 mapped: bool = False):
        self.folder = Path(folder)
        self.manifest = read_manifest(self.folder)
        self.params: dict[str, Any] = self.manifest["params"]
        self.cache_parts, self.verify, self.mapped = cache_parts, verify, mapped
        self.by_part: dict[str, list[str]] = {name: [] for name in self.manifest["parts"]}
        for path, info in self.params.items():
            self.by_part[info["part"]].append(path)
        self._cache: OrderedDict[str, dict[str, np.ndarray]] = OrderedDict()
        for name in self.by_part:
            if not inside(self.folder / PARTS, name, str(self.folder / MANIFEST), CheckpointError).is_dir():
                raise CheckpointError(f"{self.folder / PARTS / name}: missing; the manifest lists this part "
                                      f"(the checkpoint is incomplete: convert it again)")

    def part(self, name: str) -> dict[str, np.ndarray]:
        """Part ``name``'s arrays (array key -> numpy array), checked, from the cache when there."""
        if name in self._cache:
            self._cache.move_to_end(name)
        else:
            while len(self._cache) >= self.cache_parts:
                self._cache.popitem(last=False)
            self._cache[name] = read_checked_part(self.folder, name, self.manifest, self.by_part[name],
                                                  verify=self.verify, mapped=self.mapped)
        return self._cache[name]

    def __getitem__(self, path: str) -> Any:
        info = self.params[path]
        leaves = self.part(info["part"])
        if info["dtype"] == "MXFP4":
            return MXTensor(leaves[path + ".codes"], leaves[path + ".scales"])
        return leaves[path]

    def __contains__(self, path: object) -> bool:  # from the manifest: no part is read
        return path in self.params

    def __iter__(self) -> Iterator[str]:
        return (p for paths in self.by_part.values() for p in paths)

    def __len__(self) -> int:
        return len(self.params)


@dataclass(frozen=True)
class Verified:
    """What ``verify_checkpoint`` read: arrays, parts, bytes on disk and wall-clock seconds."""

    arrays: int
    parts: int
    nbytes: int
    seconds: float


def verify_checkpoint(folder: str | os.PathLike, *, quiet: bool = True) -> Verified:
    """Read every part of a k3jax checkpoint, checking structure and each array's CRC-32."""
    start = time.perf_counter()
    params = CheckpointParams(folder, cache_parts=1, verify=True)
    sizes = {name: sum(p["files"].values()) for name, p in params.manifest["parts"].items()}
    bar = Progress(sum(sizes.values()), f"verify {Path(folder).name}", quiet=quiet)
    arrays = 0
    for name in params.by_part:
        arrays += len(params.part(name))
        bar.advance(sizes[name])
    bar.close()
    return Verified(arrays, len(sizes), sum(sizes.values()), time.perf_counter() - start)


__all__ = ["CheckpointParams", "Verified", "checksums", "crc32", "part_files", "read_checked_part",
           "verify_checkpoint"]
