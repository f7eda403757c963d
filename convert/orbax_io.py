"""One part of a k3jax checkpoint (see ``convert.manifest``) as an orbax PyTree checkpoint.

A part's tree is nested by the dotted canonical path; an MXFP4 parameter ``p`` is two leaves,
``p.codes`` uint8 [..., N, K//2] and ``p.scales`` uint8 [..., N, K//32]. Orbax's own errors
become ``OSError`` (writing) or ``CheckpointError`` (reading), one line each.
"""

from __future__ import annotations

import inspect
import json
import logging
import math
import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint._src.serialization import type_handler_registry, type_handlers

from convert.safetensors_io import CheckpointError


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
    arrays it no longer touches), so a part costs its own bytes in memory, not twice. An orbax
    without that option (the GPU machine's, with JAX 0.11.2) copies: a part costs twice there."""
    no_copy = "deepcopy_host_arrays" in inspect.signature(type_handlers.NumpyHandler).parameters
    registry = type_handler_registry.create_type_handler_registry(
        (np.ndarray, type_handlers.NumpyHandler(**({"deepcopy_host_arrays": False} if no_copy else {})))
    )
    handler = ocp.PyTreeCheckpointHandler(use_compression=False, use_ocdbt=False, type_handler_registry=registry)
    return ocp.Checkpointer(handler)


class _QuietOrbax(logging.Filter):
    """Drops orbax's log records that our writer settings trigger on purpose (numpy leaves only, no
    OCDBT) and the tracebacks its worker threads log for a failed write, which ``write_part``
    raises once as an ``OSError`` instead (a full disk would print one per array in flight)."""

    _EXPECTED = ("No jax.Array in TypeHandlerRegistry", "Skipping merge of OCDBT checkpoints", "raised an exception")

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(m in record.getMessage() for m in self._EXPECTED)


def _os_error(error: Exception, directory: Path) -> Exception:
    """Orbax (tensorstore) reports a failed file write as a ValueError carrying the errno as
    ``[os_error_code='28']``: that becomes ``OSError(errno, strerror, directory)``; others stay."""
    found = re.search(r"os_error_code='(\d+)'", str(error))
    if isinstance(error, OSError) or not found:
        return error
    code = int(found.group(1))
    return OSError(code, os.strerror(code), str(directory))


def _drop_closed_loop_reports() -> None:
    """After a failed save, tensorstore's threads finish the other arrays' writes and report each
    "Event loop is closed" (orbax closed the loop they call back into) as an unraisable exception,
    a traceback each on stderr. This process-wide hook drops those reports and passes on others."""
    previous = sys.unraisablehook
    if getattr(previous, "drops_closed_loop", False):
        return

    def hook(report: Any) -> None:
        if not (isinstance(report.exc_value, RuntimeError) and str(report.exc_value) == "Event loop is closed"):
            previous(report)

    hook.drops_closed_loop = True
    sys.unraisablehook = hook


def write_part(directory: Path, leaves: Mapping[str, np.ndarray]) -> None:
    """Save ``leaves`` (dotted key -> array) as one orbax PyTree checkpoint; orbax writes to a
    temporary folder and renames it, so ``directory`` appears only complete. A failed file write
    raises ``OSError`` (errno, strerror, ``directory``)."""
    _drop_closed_loop_reports()
    quiet = _QuietOrbax()
    logging.getLogger("absl").addFilter(quiet)
    checkpointer = None
    try:
        checkpointer = _writer()
        checkpointer.save(Path(directory).absolute(), args=ocp.args.PyTreeSave(_nest(leaves)))
    except Exception as e:
        raise _os_error(e, directory) from e
    finally:
        if checkpointer is not None:
            checkpointer.close()
        logging.getLogger("absl").removeFilter(quiet)


def read_part(directory: Path) -> dict[str, np.ndarray]:
    """Restore one part -> dotted key -> numpy array. Anything orbax raises on a damaged part (a
    file unreadable, metadata not JSON, a chunk cut short) becomes ``CheckpointError`` naming it."""
    checkpointer = ocp.PyTreeCheckpointer()
    try:
        tree = checkpointer.restore(Path(directory).absolute())
    except Exception as e:
        first = str(_os_error(e, directory)).strip().splitlines() or [type(e).__name__]
        raise CheckpointError(f"{directory}: orbax cannot restore this part ({first[0][:300]})") from None
    finally:
        checkpointer.close()
    return {k: np.asarray(v) for k, v in _flatten(tree).items()}


class StoredArray:
    """An array stored as raw C-order bytes in ``path``, read when indexed: ``a[index]`` reads only the
    rows (range of the first dim) the index covers, ``np.asarray(a)`` all of it."""

    def __init__(self, path: Path, dtype: np.dtype, shape: tuple[int, ...]):
        self.path, self.dtype, self.shape = Path(path), np.dtype(dtype), tuple(shape)

    def _rows(self, start: int, stop: int) -> np.ndarray:
        out = np.empty((stop - start, *self.shape[1:]), self.dtype)
        buffer = memoryview(out.reshape(-1).view(np.uint8))
        with open(self.path, "rb", buffering=0) as f:  # unbuffered: reads exactly these bytes
            f.seek(start * self.dtype.itemsize * math.prod(self.shape[1:]))
            done = 0
            while done < len(buffer):
                n = f.readinto(buffer[done:])
                if not n:
                    raise CheckpointError(f"{self.path}: cut short (rows {start}..{stop} of {list(self.shape)} "
                                          f"{self.dtype} asked for); the checkpoint is damaged")
                done += n
        return out

    def __getitem__(self, index: Any) -> np.ndarray:
        index = index if isinstance(index, tuple) else (index,)
        if not (index and isinstance(index[0], slice) and index[0].step in (None, 1)):
            return np.asarray(self)[index]
        start, stop, _ = index[0].indices(self.shape[0])
        return self._rows(start, max(start, stop))[(slice(None), *index[1:])]

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        whole = self._rows(0, self.shape[0])
        return whole if dtype is None else whole.astype(dtype)


def map_part(directory: Path) -> dict[str, StoredArray] | None:
    """Every array of a part as a ``StoredArray`` over its file (dotted key -> array), read only where
    indexed (so each process of a mesh reads the rows its own shards cover). This needs the layout
    ``write_part`` gives: zarr v2, one uncompressed C-order chunk per array, whose file is the raw
    array. None when any array is stored otherwise (a part written by other orbax settings):
    ``read_part`` reads those whole."""
    out = {}
    for meta in sorted(Path(directory).glob("*/.zarray")):
        try:
            z = json.loads(meta.read_text())
            dtype = np.dtype(z["dtype"])
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{meta}: cannot read this array's zarr metadata ({e})") from None
        except (TypeError, KeyError):  # not a zarr v2 dtype: let orbax read it
            return None
        shape = tuple(z.get("shape", ()))
        plain = (z.get("zarr_format") == 2 and z.get("compressor") is None and not z.get("filters")
                 and z.get("order") == "C" and tuple(z.get("chunks", ())) == shape and len(shape) > 0)
        chunk = meta.parent / z.get("dimension_separator", ".").join("0" * len(shape))
        if not (plain and chunk.is_file()):
            return None
        if chunk.stat().st_size != dtype.itemsize * math.prod(shape):
            raise CheckpointError(f"{chunk}: {chunk.stat().st_size} bytes but its .zarray says {dtype} {list(shape)}; "
                                  f"the checkpoint is damaged")
        out[meta.parent.name] = StoredArray(chunk, dtype, shape)
    return out


def part_is_complete(directory: Path) -> bool:
    """True once orbax has finalized the part (its metadata file is present)."""
    return (Path(directory) / "_CHECKPOINT_METADATA").is_file()


def write_json(path: Path, data: Mapping[str, Any]) -> None:
    """Write JSON via a temporary file and rename, so a reader never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


__all__ = [
    "StoredArray",
    "map_part",
    "part_is_complete",
    "read_part",
    "write_json",
    "write_part",
]
