"""Streaming converter: a released safetensors folder -> a k3jax checkpoint (orbax parts + manifest).

Everything is validated from the headers before a byte is written (missing, unknown, wrong shape
or dtype tensors; config against tensors). Then parameters are assembled one at a time from
memory-mapped reads (routed experts: one stacked tensor per layer and weight) and saved in parts
of about ``part_bytes``; peak memory is about max(``inflight_bytes``, largest single tensor) plus
fixed overhead. Output goes to
``<out>.partial/`` and is renamed to ``<out>`` only when complete (and verified, if asked);
``resume=True`` continues an interrupted run, skipping finished parts. Reading the next part
overlaps writing earlier ones (one writer thread; at most ``inflight_bytes`` in flight).
"""

from __future__ import annotations

import json
import shutil
import sys
import warnings
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Literal

import jax.numpy as jnp
import numpy as np

from convert.names import (
    Param, Released, a_log_to_canonical, check_tensor, is_skipped, param_table, prefix_for,
    released_specs,
)
from convert.orbax_io import FORMAT, MANIFEST, PARTS, VERSION, part_is_complete, part_name, read_part, write_json, write_part
from convert.progress import Progress
from convert.safetensors_io import CheckpointError, SourceCheckpoint, TensorInfo, open_checkpoint, read_tensor
from k3jax.config import ConfigError, K3Config, from_hf_config
from k3jax.mx import MXTensor, check_scales, decode_compiled

Dequantize = Literal["bf16"] | None
PLAN_FILE = "plan.json"


class ConversionError(RuntimeError):
    """The conversion stopped (disk full, interrupted, verification failed); says how to continue."""


@dataclass(frozen=True)
class Job:
    """One canonical parameter and the released tensors it is assembled from (in spec order)."""

    param: Param
    specs: tuple[Released, ...]
    sources: tuple[TensorInfo, ...]

    @property
    def read_bytes(self) -> int:
        return sum(s.nbytes for s in self.sources)


@dataclass(frozen=True)
class Plan:
    """A validated conversion: config, name prefix, jobs in source-file order, skipped/unknown names."""

    source: SourceCheckpoint
    cfg: K3Config
    prefix: str
    jobs: tuple[Job, ...]
    skipped: tuple[str, ...]
    unknown: tuple[str, ...]


def model_config(src: SourceCheckpoint) -> K3Config:
    """``from_hf_config`` of the folder's config.json; a ConfigError becomes a CheckpointError naming the file."""
    try:
        return from_hf_config(src.config, name=src.folder.name)
    except ConfigError as e:
        raise CheckpointError(f"{src.folder / 'config.json'}: {e}") from None


def _mx_mismatch(src: SourceCheckpoint, cfg: K3Config, prefix: str, params: list[Param]) -> None:
    experts = next((p for p in params if p.kind == "experts"), None)
    if experts is None:
        return
    base = prefix + experts.names[0].format(e=0)
    have, tensors = (".weight_packed", ".weight") if cfg.mx_experts else (".weight", ".weight_packed"), src.tensors
    if base + have[1] in tensors and base + have[0] not in tensors:
        said = "MXFP4 routed experts (quantization_config)" if cfg.mx_experts else "bf16 routed experts (no quantization_config)"
        raise CheckpointError(
            f"{src.folder / 'config.json'}: says {said}, but {tensors[base + have[1]].file} holds "
            f"{base + have[1]!r}; the config does not match the tensors"
        )


def plan(src: SourceCheckpoint, *, cfg: K3Config | None = None, allow_unknown: bool = False) -> Plan:
    """Match every parameter the config implies to released tensors and check dtypes and shapes.

    Missing tensors, wrong shapes/dtypes and a config that contradicts the tensors raise
    ``CheckpointError``. Unknown tensors (not vision, not in the table) raise too, unless
    ``allow_unknown`` (then a warning lists them and they are skipped). ``cfg`` overrides the
    folder's config.json.
    """
    cfg = cfg or model_config(src)
    prefix = prefix_for(src.config)
    params = param_table(cfg)
    tensors = src.tensors
    _mx_mismatch(src, cfg, prefix, params)
    specs, missing = released_specs(params, prefix, cfg.mx_experts, tensors)
    if missing:
        raise CheckpointError(
            f"{src.folder}: {len(missing)} tensor(s) required by config.json ({cfg.num_layers} layers) are in no "
            f"shard, e.g. {', '.join(missing[:3])}; the checkpoint is incomplete or the config does not match it"
        )
    for spec in specs:
        check_tensor(spec, tensors[spec.name])
    wanted = {s.name for s in specs}
    skipped = tuple(n for n in tensors if n not in wanted and is_skipped(n, prefix))
    unknown = tuple(n for n in tensors if n not in wanted and not is_skipped(n, prefix))
    if unknown:
        msg = (f"{tensors[unknown[0]].file}: {len(unknown)} tensor(s) have no k3jax parameter, e.g. "
               f"{', '.join(repr(n) for n in unknown[:3])} (config.json has {cfg.num_layers} layers)")
        if not allow_unknown:
            raise CheckpointError(msg + "; pass allow_unknown / --allow-unknown to skip them")
        warnings.warn(msg + "; skipped", stacklevel=2)
    by_param: dict[str, list[Released]] = {}
    for s in specs:
        by_param.setdefault(s.param, []).append(s)
    order = {s.file: i for i, s in enumerate(src.shards)}
    jobs = [Job(p, tuple(by_param[p.path]), tuple(tensors[s.name] for s in by_param[p.path])) for p in params]
    jobs.sort(key=lambda j: (order[j.sources[0].file.name], j.sources[0].start))
    return Plan(src, cfg, prefix, tuple(jobs), skipped, unknown)


def out_bytes(job: Job, dequantize: Dequantize) -> int:
    """Bytes the job's canonical value occupies (experts dequantized to bf16: 2 bytes an element)."""
    if job.param.kind == "experts" and dequantize and job.specs[0].field != "weight":
        return 2 * int(np.prod(job.param.shape))
    return job.read_bytes


def assemble(job: Job, dequantize: Dequantize = None) -> dict[str, np.ndarray]:
    """Read one parameter's released tensors -> its canonical leaves (dotted key -> array).

    copy: the tensor as is; a_log: float32 [H]; experts: stacked [E, N, K] (bf16), or MXFP4
    ``<path>.codes`` uint8 [E, N, K//2] and ``<path>.scales`` uint8 [E, N, K//32], or (``dequantize``)
    bf16 [E, N, K] decoded one expert at a time.
    """
    p, src = job.param, job.sources
    if p.kind == "copy":
        return {p.path: np.array(read_tensor(src[0]))}
    if p.kind == "a_log":
        return {p.path: a_log_to_canonical(read_tensor(src[0]), p.shape[0])[0]}
    if job.specs[0].field == "weight":
        out = np.empty(p.shape, src[0].np_dtype)
        for e, info in enumerate(src):
            out[e] = read_tensor(info)
        return {p.path: out}
    packed, scales = src[0::2], src[1::2]
    for info in scales:
        try:
            check_scales(read_tensor(info), info.name)
        except ValueError as e:
            raise CheckpointError(f"{info.file}: {e}") from None
    if dequantize:
        out = np.empty(p.shape, np.dtype(jnp.bfloat16))
        for e, (c, s) in enumerate(zip(packed, scales)):
            out[e] = np.asarray(decode_compiled(MXTensor(jnp.asarray(read_tensor(c)), jnp.asarray(read_tensor(s))), jnp.bfloat16))
        return {p.path: out}
    codes = np.empty((len(packed), *packed[0].shape), np.uint8)
    scale = np.empty((len(scales), *scales[0].shape), np.uint8)
    for e, (c, s) in enumerate(zip(packed, scales)):
        codes[e] = read_tensor(c)
        scale[e] = read_tensor(s)
    return {p.path + ".codes": codes, p.path + ".scales": scale}


def split_parts(jobs: tuple[Job, ...], part_bytes: int, dequantize: Dequantize) -> list[list[Job]]:
    """Consecutive jobs grouped into parts of at most ``part_bytes`` (a larger single job stands alone)."""
    parts: list[list[Job]] = [[]]
    size = 0
    for job in jobs:
        n = out_bytes(job, dequantize)
        if parts[-1] and size + n > part_bytes:
            parts.append([])
            size = 0
        parts[-1].append(job)
        size += n
    return [p for p in parts if p]


def _fingerprint(pl: Plan, parts: list[list[Job]], dequantize: Dequantize) -> dict:
    files = [{"file": s.file, "bytes": (pl.source.folder / s.file).stat().st_size,
              "mtime_ns": (pl.source.folder / s.file).stat().st_mtime_ns} for s in pl.source.shards]
    return {"source": str(pl.source.folder.absolute()), "files": files, "dequantize": dequantize,
            "parts": [[j.param.path for j in p] for p in parts]}


def _a_log_tails(pl: Plan) -> dict[str, list[str]]:
    """Non-zero padding of K3's A_log (kept so an export is bit-identical), as float hex strings."""
    out = {}
    for job in pl.jobs:
        if job.param.kind == "a_log":
            _, tail = a_log_to_canonical(read_tensor(job.sources[0]), job.param.shape[0])
            if np.any(tail.view(np.uint32)):
                out[job.sources[0].name] = [float(x).hex() for x in tail]
    return out


def manifest(pl: Plan, parts: list[list[Job]], dequantize: Dequantize) -> dict:
    """The manifest: params (path -> part, shape, dtype) and the source layout for export."""
    params = {}
    for i, jobs in enumerate(parts):
        for job in jobs:
            mx = job.param.kind == "experts" and job.specs[0].field != "weight" and not dequantize
            params[job.param.path] = {"part": part_name(i), "shape": list(job.param.shape),
                                      "dtype": "MXFP4" if mx else job.param.dtype}
    wanted = {s.name for j in pl.jobs for s in j.specs}
    shards = [{"file": s.file, "metadata": dict(s.metadata),
               "tensors": [[t.name, t.dtype, list(t.shape)] for t in s.tensors if t.name in wanted]}
              for s in pl.source.shards]
    return {"format": FORMAT, "version": VERSION, "dequantize": dequantize, "params": params,
            "source": {"prefix": pl.prefix, "shards": [s for s in shards if s["tensors"]],
                       "skipped": list(pl.skipped), "unknown": list(pl.unknown), "a_log_tails": _a_log_tails(pl)}}


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a.view(np.uint8), b.view(np.uint8))


def verify_parts(folder: Path, parts: list[list[Job]], dequantize: Dequantize, *, quiet: bool = True) -> None:
    """Re-read every part and compare it bit for bit with freshly assembled source tensors."""
    bar = Progress(sum(j.read_bytes for p in parts for j in p), "verify", quiet=quiet)
    for i, jobs in enumerate(parts):
        got = read_part(folder / PARTS / part_name(i))
        for job in jobs:
            for key, want in assemble(job, dequantize).items():
                if key not in got or not _same(np.asarray(got[key]), want):
                    raise ConversionError(
                        f"{folder / PARTS / part_name(i)}: {key} differs from {job.sources[0].file} "
                        f"tensor {job.sources[0].name!r} on re-read; the output is not trustworthy"
                    )
            bar.advance(job.read_bytes)
    bar.close()


def _iter_todo(partial: Path, parts: list[list[Job]], bar: Progress) -> Iterator[tuple[int, list[Job]]]:
    for i, jobs in enumerate(parts):
        if part_is_complete(partial / PARTS / part_name(i)):
            bar.advance(sum(j.read_bytes for j in jobs), skipped=True)
        else:
            yield i, jobs


def _write(target: Path, leaves: dict[str, np.ndarray], index: int, count: int) -> None:
    try:
        write_part(target, leaves)
    except OSError as e:
        out = target.parent.parent.name.removesuffix(".partial")
        raise ConversionError(
            f"{target}: writing failed ({e}); {out} was not created. Fix the cause (e.g. free disk space) "
            f"and rerun with --resume to continue from part {index} of {count}"
        ) from e


def _write_parts(partial: Path, parts: list[list[Job]], todo: Iterator[tuple[int, list[Job]]],
                 dequantize: Dequantize, bar: Progress, budget: int) -> None:
    """Assemble parts on this thread while one writer thread saves earlier ones. A part is started
    only while the parts in flight plus it fit in ``budget`` bytes (or nothing is in flight), so
    memory stays near max(budget, largest part). On a failure, parts not yet started are dropped."""
    pending: deque[tuple[Future, int]] = deque()

    def finish_oldest() -> None:
        future, _ = pending.popleft()
        try:
            future.result()
        except BaseException:
            for f, _ in pending:
                f.cancel()
            raise

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="k3jax-convert-write") as pool:
        for i, jobs in todo:
            n = sum(out_bytes(j, dequantize) for j in jobs)
            while pending and sum(b for _, b in pending) + n > budget:
                finish_oldest()
            leaves: dict[str, np.ndarray] = {}
            for job in jobs:
                leaves.update(assemble(job, dequantize))
                bar.advance(job.read_bytes)
            pending.append((pool.submit(_write, partial / PARTS / part_name(i), leaves, i, len(parts)), n))
            del leaves
        while pending:
            finish_oldest()


def _prepare(partial: Path, fingerprint: dict, resume: bool) -> None:
    plan_file = partial / PLAN_FILE
    if partial.exists():
        if not resume:
            raise ConversionError(f"{partial}: left by an interrupted conversion; pass --resume to continue it, "
                                  f"or delete it to start over")
        old = json.loads(plan_file.read_text()) if plan_file.is_file() else None
        if old != fingerprint:
            raise ConversionError(f"{partial}: made from a different source, options or code version; "
                                  f"delete it to start over")
        for stale in (partial / PARTS).iterdir():
            if not part_is_complete(stale):
                shutil.rmtree(stale)
        return
    (partial / PARTS).mkdir(parents=True)
    write_json(plan_file, fingerprint)


def convert(
    source: str | Path, out: str | Path, *, dequantize: Dequantize = None, resume: bool = False,
    verify: bool = False, quiet: bool = False, allow_unknown: bool = False, part_bytes: int = 128 << 20,
    inflight_bytes: int = 768 << 20,
) -> Path:
    """Convert the released checkpoint folder ``source`` into the k3jax checkpoint ``out``.

    ``dequantize="bf16"`` stores MXFP4 experts as bf16 [E, N, K]; ``resume`` continues from
    ``<out>.partial``; ``verify`` re-reads the output and compares it bit for bit before the final
    rename. ``part_bytes`` sizes the orbax parts (the unit of resuming); ``inflight_bytes`` bounds
    the parts being assembled or written at once (memory). Returns ``out``. Raises
    ``CheckpointError`` (bad input, nothing written) or ``ConversionError`` (write failed or
    interrupted; ``<out>.partial`` remains, ``out`` does not exist).
    """
    source, out = Path(source), Path(out)
    if dequantize not in (None, "bf16"):
        raise ValueError(f"dequantize: {dequantize!r}; expected None or 'bf16'")
    if out.exists():
        raise ConversionError(f"{out}: already exists; remove it or choose another output path")
    partial = out.with_name(out.name + ".partial")
    pl = plan(open_checkpoint(source), allow_unknown=allow_unknown)
    parts = split_parts(pl.jobs, part_bytes, dequantize)
    _prepare(partial, _fingerprint(pl, parts, dequantize), resume)
    bar = Progress(sum(j.read_bytes for j in pl.jobs), f"convert {source.name}", quiet=quiet)
    _write_parts(partial, parts, _iter_todo(partial, parts, bar), dequantize, bar, inflight_bytes)
    bar.close()
    shutil.copyfile(source / "config.json", partial / "config.json")
    write_json(partial / MANIFEST, manifest(pl, parts, dequantize))
    if verify:
        verify_parts(partial, parts, dequantize, quiet=quiet)
    partial.rename(out)
    (out / PLAN_FILE).unlink()
    if not quiet and pl.skipped:
        print(f"note: skipped {len(pl.skipped)} tensor(s) outside the text model (vision tower, projector)",
              file=sys.stderr)
    return out


__all__ = ["ConversionError", "Job", "Plan", "assemble", "convert", "manifest", "model_config", "plan",
           "split_parts", "verify_parts"]
