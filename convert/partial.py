"""The ``<out>.partial`` folder a conversion writes into: created whole or not at all, filled part
by part (each part's CRC-32s beside it), resumed from its complete parts, renamed to ``<out>``
when done, or removed when what it holds cannot be resumed.

```
<out>.partial/plan.json                  the run's fingerprint (source files, options, parts)
<out>.partial/parts/part_00000/          orbax parts as they complete
<out>.partial/checksums/part_00000.json  {"crc32": {array key: hex}}, written after its part
```
A part counts as complete when orbax finalized it and its checksums file exists.

Several processes (one a host, sharing the folder) can write it together (``Share``): process k writes
the parts k, k + n, k + 2n, ...; process 0 prepares the folder, the others wait for it (``join``), and
process 0 finishes once every part is complete (``wait_for_parts``). Each process cleans up only its own
incomplete parts on ``--resume``.
"""

from __future__ import annotations

import re
import shutil
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from convert.integrity import checksums, part_files
from k3jax.json_schema import Fields, read_json
from convert.manifest import PARTS, part_name
from convert.orbax_io import part_is_complete, write_json, write_part

PLAN_FILE = "plan.json"
SUMS = "checksums"


class ConversionError(RuntimeError):
    """The conversion stopped (disk full, interrupted, verification failed); says how to continue."""


@dataclass(frozen=True)
class Share:
    """Process ``index`` of ``count`` converting together: it owns parts ``index``, ``index + count``, ..."""

    index: int = 0
    count: int = 1

    def __post_init__(self):
        if not 0 <= self.index < self.count:
            raise ValueError(f"process_index {self.index} / process_count {self.count}: expected "
                             f"0 <= process_index < process_count")

    def owns(self, part: int | None) -> bool:
        """Whether this process writes (and cleans up) part ``part``; None (a foreign entry): process 0."""
        return (part or 0) % self.count == self.index


def partial_of(out: Path) -> Path:
    """The folder a conversion into ``out`` writes until it is complete."""
    return out.with_name(out.name + ".partial")


def _sums(partial: Path, name: str) -> Path:
    return partial / SUMS / f"{name}.json"


def is_done(partial: Path, index: int) -> bool:
    name = part_name(index)
    return part_is_complete(partial / PARTS / name) and _sums(partial, name).is_file()


def prepare(partial: Path, fingerprint: dict[str, Any], resume: bool, share: Share = Share()) -> None:
    """Create ``partial`` (through a temporary name, so it appears whole or not at all), or with
    ``resume`` check that it was made by the same plan and drop the incomplete parts ``share`` owns."""
    try:
        if partial.exists():
            _resume(partial, fingerprint, resume, share)
        else:
            _create(partial, fingerprint)
    except OSError as e:
        raise ConversionError(f"{partial}: cannot prepare it ({e.strerror or e}); nothing was written") from e


def _resume(partial: Path, fingerprint: dict[str, Any], resume: bool, share: Share) -> None:
    if not resume:
        raise ConversionError(f"{partial}: left by an interrupted conversion; pass --resume to continue it, "
                              f"or delete it to start over")
    try:
        old = read_json(partial / PLAN_FILE, ConversionError)
    except ConversionError as e:
        raise ConversionError(f"{e}; {partial} cannot be resumed: delete it to start over") from None
    if old != fingerprint:
        raise ConversionError(f"{partial}: made from a different source, options or code version; "
                              f"delete it to start over")
    _drop_incomplete(partial, share)


def _drop_incomplete(partial: Path, share: Share) -> None:
    """Remove the incomplete parts (and orbax's temporary folders, stray checksums) that ``share`` owns."""
    for folder, suffix in ((PARTS, ""), (SUMS, ".json")):
        for entry in (partial / folder).iterdir():
            name = entry.name.removesuffix(suffix)
            found = re.match(r"part_(\d+)", name)
            if not share.owns(int(found.group(1)) if found else None):
                continue
            if not (part_is_complete(partial / PARTS / name) and _sums(partial, name).is_file()):
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry)
                else:
                    entry.unlink()


def _create(partial: Path, fingerprint: dict[str, Any]) -> None:
    fresh = partial.with_name(partial.name + ".new")
    try:
        shutil.rmtree(fresh, ignore_errors=True)
        (fresh / PARTS).mkdir(parents=True)
        (fresh / SUMS).mkdir()
        write_json(fresh / PLAN_FILE, fingerprint)
        fresh.rename(partial)
    except OSError as e:
        shutil.rmtree(fresh, ignore_errors=True)
        raise ConversionError(f"{partial}: cannot create it ({e.strerror or e}); nothing was written") from e


def _write_one(partial: Path, index: int, count: int, leaves: dict[str, np.ndarray]) -> None:
    name = part_name(index)
    target = partial / PARTS / name
    try:
        write_part(target, leaves)
        write_json(_sums(partial, name), {"crc32": checksums(leaves)})
    except OSError as e:
        out = partial.name.removesuffix(".partial")
        raise ConversionError(
            f"{e.filename or target}: writing failed ({e.strerror or e}); {out} was not created and {partial} is "
            f"kept: fix the cause (e.g. free disk space) and rerun with --resume to continue from part {index} of {count}"
        ) from e


def write_parts(partial: Path, count: int, todo: Iterable[tuple[int, int, Callable[[], dict[str, np.ndarray]]]],
                budget: int) -> None:
    """Assemble parts on this thread (``todo`` yields index, bytes, assemble) while one writer thread
    saves earlier ones and their checksums. A part is started only while the parts in flight plus
    it fit in ``budget`` bytes (or nothing is in flight), so memory stays near max(budget, largest
    part). On a failure, parts not yet started are dropped."""
    pending: deque[tuple[Future, int]] = deque()
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="k3jax-convert-write") as pool:
        try:
            for index, nbytes, assemble in todo:
                while pending and sum(b for _, b in pending) + nbytes > budget:
                    pending.popleft()[0].result()
                leaves = assemble()
                pending.append((pool.submit(_write_one, partial, index, count, leaves), nbytes))
                del leaves
            while pending:
                pending.popleft()[0].result()
        except BaseException:
            for future, _ in pending:
                future.cancel()
            raise


def part_entries(partial: Path, count: int) -> dict[str, dict[str, Any]]:
    """The manifest's ``parts``: each part's files with sizes and its arrays' CRC-32s."""
    out = {}
    for i in range(count):
        name = part_name(i)
        sums = Fields(read_json(_sums(partial, name), ConversionError), str(_sums(partial, name)), ConversionError)
        out[name] = {"files": part_files(partial / PARTS / name), "crc32": sums.str_map("crc32")}
    return out


def drop_part(partial: Path, index: int) -> None:
    """Remove one part and its checksums, so that ``--resume`` writes it again."""
    name = part_name(index)
    shutil.rmtree(partial / PARTS / name, ignore_errors=True)
    _sums(partial, name).unlink(missing_ok=True)


def finish(partial: Path, out: Path) -> None:
    """Rename the complete ``partial`` to ``out`` and remove the bookkeeping files."""
    partial.rename(out)
    (out / PLAN_FILE).unlink()
    shutil.rmtree(out / SUMS)


def discard(partial: Path) -> None:
    shutil.rmtree(partial, ignore_errors=True)


def join(partial: Path, fingerprint: dict[str, Any], share: Share, wait_s: float) -> None:
    """Process ``share.index`` > 0: wait (up to ``wait_s``) for the folder process 0 prepares, check that
    it was made by the same plan, and drop the incomplete parts this process owns."""
    deadline = time.monotonic() + wait_s
    while not (partial / PLAN_FILE).is_file():
        if time.monotonic() > deadline:
            raise ConversionError(f"{partial}: process 0 did not create it within {wait_s:.0f} s; start process 0 "
                                  f"of this conversion (same SRC, OUT and options), which prepares it")
        time.sleep(min(1.0, wait_s / 20))
    if read_json(partial / PLAN_FILE, ConversionError) != fingerprint:
        raise ConversionError(f"{partial}: made from a different source, options or code version than process "
                              f"{share.index}'s; give every process the same SRC, OUT and options")
    _drop_incomplete(partial, share)


def wait_for_parts(partial: Path, count: int, wait_s: float) -> None:
    """Process 0: return once all ``count`` parts are complete; ``ConversionError`` when none completed for
    ``wait_s`` seconds (naming the missing parts) or when the folder was removed (another process failed)."""
    missing, since = count + 1, time.monotonic()
    while True:
        if not (partial / PLAN_FILE).is_file():
            raise ConversionError(f"{partial}: removed while process 0 waited for the other processes' parts "
                                  f"(one failed: see its error)")
        todo = [part_name(i) for i in range(count) if not is_done(partial, i)]
        if not todo:
            return
        if len(todo) < missing:
            missing, since = len(todo), time.monotonic()
        elif time.monotonic() - since > wait_s:
            raise ConversionError(f"{partial}: {len(todo)} part(s) written by other processes are not complete "
                                  f"(none completed for {wait_s:.0f} s), e.g. {todo[0]}; rerun those processes with "
                                  f"--resume, or finish in one process with k3jax convert SRC OUT --resume")
        time.sleep(min(1.0, wait_s / 20))


def iter_todo(partial: Path, count: int, on_skip: Callable[[int], None], share: Share = Share()) -> Iterator[int]:
    """Indices of the parts ``share`` owns still to write; ``on_skip(i)`` for each one already complete."""
    for i in filter(share.owns, range(count)):
        if is_done(partial, i):
            on_skip(i)
        else:
            yield i


__all__ = ["ConversionError", "PLAN_FILE", "SUMS", "Share", "discard", "drop_part", "finish", "is_done", "iter_todo",
           "join", "part_entries", "partial_of", "prepare", "wait_for_parts", "write_parts"]
