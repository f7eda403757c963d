"""The k3jax checkpoint on disk and its manifest, read with every type checked.

```
<ckpt>/config.json            the released config.json, copied
<ckpt>/k3jax_checkpoint.json  the manifest (below)
<ckpt>/parts/part_00000/      an orbax PyTree checkpoint holding some parameters (``convert.orbax_io``)
```
Manifest (version 2):
- ``format``, ``version``; ``dtype``: null (weights kept as stored) or the "BF16" / "F16" / "F32"
  they were cast to; ``dequantize``: null or "bf16" (MXFP4 experts decoded);
- ``params``: canonical path -> ``{"part", "shape", "dtype"}`` (dtype BF16, F16, F32 or MXFP4);
- ``parts``: part name -> ``{"files": {path inside the part: bytes}, "crc32": {array key: 8 hex
  digits}}`` (an MXFP4 parameter ``p`` is the arrays ``p.codes`` and ``p.scales``);
- ``source``: the released layout for export: ``prefix``, ``shards`` (``file``, ``metadata``,
  ``tensors`` as [name, dtype, shape]), ``skipped``, ``unknown``, ``a_log_tails``.
Every file name read from a manifest is a name inside its folder (``k3jax.json_schema.safe_name``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from k3jax.json_schema import Fields, read_json, relative_file, safe_name
from convert.safetensors_io import DTYPES, FLOATS, CheckpointError

MANIFEST = "k3jax_checkpoint.json"
PARTS = "parts"
FORMAT = "k3jax-checkpoint"
VERSION = 2
PARAM_DTYPES = (*FLOATS, "MXFP4")
_CRC = re.compile(r"[0-9a-f]{8}")


def part_name(index: int) -> str:
    return f"part_{index:05d}"


def leaf_keys(path: str, dtype: str) -> tuple[str, ...]:
    """The arrays a parameter is stored as: itself, or its MXFP4 codes and scales."""
    return (path + ".codes", path + ".scales") if dtype == "MXFP4" else (path,)


def is_k3jax_checkpoint(folder: Path) -> bool:
    return (Path(folder) / MANIFEST).is_file()


def read_manifest(folder: Path) -> dict[str, Any]:
    """The validated manifest of a finished k3jax checkpoint (a dict as written). Raises
    ``CheckpointError`` naming the file and key for a missing, cut-short, foreign or inconsistent one."""
    path = Path(folder) / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"{path}: missing; {folder} is not a finished k3jax checkpoint")
    m = Fields(read_json(path, CheckpointError), str(path), CheckpointError)
    if m.str("format") != FORMAT:
        raise m.fail("format", repr(FORMAT), m.data["format"])
    if m.int("version") != VERSION:
        raise m.fail("version", f"{VERSION} (this converter's; convert the released checkpoint again)",
                     m.data["version"])
    m.str("dtype", None, choices=FLOATS)
    m.str("dequantize", None, choices=("bf16",))
    parts = m.fields("parts")
    arrays: dict[str, set[str]] = {}
    for name in parts:
        safe_name(name, m.source, "parts", CheckpointError)
        part = parts.fields(name)
        for rel in part.int_map("files", minimum=0):
            relative_file(rel, m.source, part.key("files"), CheckpointError)
        bad = {k: v for k, v in part.str_map("crc32").items() if not _CRC.fullmatch(v)}
        if bad:
            raise part.fail("crc32", "8 lowercase hex digits per array", bad)
        arrays[name] = set()
    params = m.fields("params")
    for key in params:
        entry = params.fields(key)
        part = entry.str("part", choices=tuple(parts))
        entry.int_list("shape", minimum=0)
        arrays[part].update(leaf_keys(key, entry.str("dtype", choices=PARAM_DTYPES)))
    for name, keys in arrays.items():
        listed = set(parts.data[name]["crc32"])
        if listed != keys:
            odd = sorted(listed ^ keys)[:3]
            raise CheckpointError(f"{path}: parts.{name}.crc32 does not list the part's arrays from params "
                                  f"(differing: {odd}); the manifest is inconsistent")
    check_layout(m.fields("source"))
    return m.data


def check_layout(source: Fields) -> None:
    """Validate a released layout (a manifest's ``source``): shard files are plain names, tensors
    are [name, dtype, shape], A_log tails lists of float hex strings."""
    source.str("prefix")
    files: set[str] = set()
    for i, shard in enumerate(source.list("shards")):
        sh = Fields(shard, source.source, source.error, source.key(f"shards[{i}]"))
        file = safe_name(sh.str("file"), sh.source, sh.key("file"), CheckpointError)
        if file in files:
            raise sh.fail("file", "a file no other shard names", file)
        files.add(file)
        sh.str_map("metadata", {})
        for j, t in enumerate(sh.list("tensors")):
            if not (isinstance(t, list) and len(t) == 3 and isinstance(t[0], str) and t[1] in DTYPES
                    and isinstance(t[2], list) and all(type(n) is int and n >= 0 for n in t[2])):
                raise sh.fail(f"tensors[{j}]", "[name, safetensors dtype, shape]", t)
    source.str_list("skipped", [])
    source.str_list("unknown", [])
    tails = source.fields("a_log_tails", {})
    for name in tails:
        values = tails.str_list(name)
        try:
            [float.fromhex(v) for v in values]
        except ValueError:
            raise tails.fail(name, "float hex strings", values) from None


__all__ = [
    "FORMAT", "MANIFEST", "PARAM_DTYPES", "PARTS", "VERSION", "check_layout", "is_k3jax_checkpoint", "leaf_keys",
    "part_name", "read_manifest",
]
