"""Streaming converter: a released safetensors folder -> a k3jax checkpoint (orbax parts + manifest).

Everything is validated from the headers before a byte is written (config types, missing, unknown,
wrong shape or dtype tensors; config against tensors; free disk space). Weights may be saved in
bf16, f16 or f32 (HF saves a model in its own dtype): they are kept as stored, or cast with
``dtype`` (the manifest says which). Then parameters are assembled one at a time from
memory-mapped reads (routed experts: one stacked tensor per layer and weight) and saved in parts
of about ``part_bytes`` with a CRC-32 per array; peak memory is about max(``inflight_bytes``,
largest single tensor) plus fixed overhead. Output goes to ``<out>.partial/`` (``convert.partial``)
and is renamed to ``<out>`` only when complete (and verified, if asked); ``resume=True`` continues
an interrupted run, skipping finished parts. Reading the next part overlaps writing earlier ones
(one writer thread; at most ``inflight_bytes`` in flight). Several processes (e.g. one a host) can
convert together into a shared folder, each writing every n-th part (``process_index``,
``process_count``; ``convert.partial.Share``); process 0 writes the manifest once all are complete.
"""

from __future__ import annotations

import functools
import math
import shutil
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import jax.numpy as jnp
import numpy as np

from convert.integrity import checksums, read_checked_part
from convert.manifest import FORMAT, MANIFEST, PARTS, VERSION, part_name, read_manifest
from convert.names import (
    Param, Released, a_log_to_canonical, check_tensor, is_skipped, param_table, prefix_for, released_specs,
)
from convert.orbax_io import write_json
from convert.partial import (
    ConversionError, Share, discard, drop_part, finish, iter_todo, join, part_entries, partial_of, prepare,
    wait_for_parts, write_parts,
)
from convert.progress import Progress, size
from convert.safetensors_io import DTYPES, CheckpointError, SourceCheckpoint, TensorInfo, open_checkpoint, read_tensor
from k3jax.config import ConfigError, K3Config, from_hf_config
from k3jax.mx import MXTensor, check_scales, decode_compiled

Dequantize = Literal["bf16"] | None
CastTo = Literal["bf16", "f16", "f32"] | None
CASTS = {"bf16": "BF16", "f16": "F16", "f32": "F32"}


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
        return from_hf_config(src.config, name=src.folder.name, source=str(src.folder / "config.json"))
    except ConfigError as e:
        raise CheckpointError(str(e)) from None


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


def _one_dtype_per_stack(specs: list[Released], tensors: dict[str, TensorInfo]) -> None:
    """Routed experts are stacked into one array a layer and weight: their dtypes must agree."""
    first: dict[str, TensorInfo] = {}
    for s in specs:
        info = tensors[s.name]
        seen = first.setdefault(f"{s.param}.{s.field}", info)
        if info.dtype != seen.dtype:
            raise CheckpointError(f"{info.file}: tensor {s.name!r} is {info.dtype} but {seen.name!r} is {seen.dtype}; "
                                  f"expected one dtype for the experts stacked into {s.param}")


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
    _one_dtype_per_stack(specs, tensors)
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


def out_dtype(job: Job, dequantize: Dequantize = None, dtype: CastTo = None) -> str:
    """What the job's value is stored as: "MXFP4" (packed experts) or a float safetensors dtype:
    as the source stores it, or ``dtype`` ("bf16", "f16", "f32") for the weights that follow the
    model's parameter dtype; the parameters the model keeps in float32 (A_log, dt_bias, conv
    weights, router bias) are stored as float32 when a ``dtype`` is asked for."""
    packed = job.specs[0].field != "weight"
    if packed and not dequantize:
        return "MXFP4"
    if dtype is None:
        return "BF16" if packed else job.sources[0].dtype
    return "F32" if job.param.dtype == "F32" else CASTS[dtype]


def out_bytes(job: Job, dequantize: Dequantize = None, dtype: CastTo = None) -> int:
    """Bytes the job's canonical value occupies once converted."""
    kind = out_dtype(job, dequantize, dtype)
    return job.read_bytes if kind == "MXFP4" else math.prod(job.param.shape) * DTYPES[kind].itemsize


def assemble(job: Job, dequantize: Dequantize = None, dtype: CastTo = None) -> dict[str, np.ndarray]:
    """Read one parameter's released tensors -> its canonical leaves (dotted key -> array).

    copy: the tensor as is; a_log: [H]; experts: stacked [E, N, K], or MXFP4 ``<path>.codes``
    uint8 [E, N, K//2] and ``<path>.scales`` uint8 [E, N, K//32], or (``dequantize``) bf16
    [E, N, K] decoded one expert at a time. Floats end in ``out_dtype``. A NaN scale byte raises
    ``CheckpointError`` naming the file and tensor.
    """
    p, src = job.param, job.sources
    kind = out_dtype(job, dequantize, dtype)
    if p.kind == "copy":
        return {p.path: np.asarray(read_tensor(src[0])).astype(DTYPES[kind])}
    if p.kind == "a_log":
        return {p.path: a_log_to_canonical(read_tensor(src[0]), p.shape[0])[0].astype(DTYPES[kind], copy=False)}
    if job.specs[0].field == "weight":
        out = np.empty(p.shape, DTYPES[kind])
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
        out = np.empty(p.shape, DTYPES[kind])
        for e, (c, s) in enumerate(zip(packed, scales)):
            out[e] = np.asarray(decode_compiled(MXTensor(jnp.asarray(read_tensor(c)), jnp.asarray(read_tensor(s))), jnp.bfloat16))
        return {p.path: out}
    codes = np.empty((len(packed), *packed[0].shape), np.uint8)
    scale = np.empty((len(scales), *scales[0].shape), np.uint8)
    for e, (c, s) in enumerate(zip(packed, scales)):
        codes[e] = read_tensor(c)
        scale[e] = read_tensor(s)
    return {p.path + ".codes": codes, p.path + ".scales": scale}


def split_parts(jobs: tuple[Job, ...], part_bytes: int, dequantize: Dequantize = None,
                dtype: CastTo = None) -> list[list[Job]]:
    """Consecutive jobs grouped into parts of at most ``part_bytes`` (a larger single job stands alone)."""
    parts: list[list[Job]] = [[]]
    used = 0
    for job in jobs:
        n = out_bytes(job, dequantize, dtype)
        if parts[-1] and used + n > part_bytes:
            parts.append([])
            used = 0
        parts[-1].append(job)
        used += n
    return [p for p in parts if p]


def _fingerprint(pl: Plan, parts: list[list[Job]], dequantize: Dequantize, dtype: CastTo) -> dict:
    files = [{"file": s.file, "bytes": (pl.source.folder / s.file).stat().st_size,
              "mtime_ns": (pl.source.folder / s.file).stat().st_mtime_ns} for s in pl.source.shards]
    return {"source": str(pl.source.folder.absolute()), "files": files, "dequantize": dequantize, "dtype": dtype,
            "version": VERSION, "parts": [[j.param.path for j in p] for p in parts]}


def _a_log_tails(pl: Plan) -> dict[str, list[str]]:
    """Non-zero padding of K3's A_log (kept so an export is bit-identical), as float hex strings."""
    out = {}
    for job in pl.jobs:
        if job.param.kind == "a_log":
            _, tail = a_log_to_canonical(read_tensor(job.sources[0]), job.param.shape[0])
            if np.any(tail != 0) or np.any(np.signbit(tail)):
                out[job.sources[0].name] = [float(x).hex() for x in tail]
    return out


def manifest(pl: Plan, parts: list[list[Job]], part_entries: dict[str, Any], dequantize: Dequantize = None,
             dtype: CastTo = None) -> dict:
    """The manifest (``convert.manifest``): params, parts with files and checksums, source layout."""
    params = {job.param.path: {"part": part_name(i), "shape": list(job.param.shape),
                               "dtype": out_dtype(job, dequantize, dtype)}
              for i, jobs in enumerate(parts) for job in jobs}
    wanted = {s.name for j in pl.jobs for s in j.specs}
    shards = [{"file": s.file, "metadata": dict(s.metadata),
               "tensors": [[t.name, t.dtype, list(t.shape)] for t in s.tensors if t.name in wanted]}
              for s in pl.source.shards]
    return {"format": FORMAT, "version": VERSION, "dtype": CASTS.get(dtype), "dequantize": dequantize,
            "params": params, "parts": part_entries,
            "source": {"prefix": pl.prefix, "shards": [s for s in shards if s["tensors"]],
                       "skipped": list(pl.skipped), "unknown": list(pl.unknown), "a_log_tails": _a_log_tails(pl)}}


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a.view(np.uint8), b.view(np.uint8))


def verify_parts(folder: Path, parts: list[list[Job]], dequantize: Dequantize = None, dtype: CastTo = None, *,
                 quiet: bool = True) -> None:
    """Re-read every part of ``folder`` (a finished or partial output with its manifest), check its
    files and CRC-32s, and compare it bit for bit with freshly assembled source tensors. A part that
    differs is removed (``--resume`` writes it again) and ``ConversionError`` says so."""
    man = read_manifest(folder)
    bar = Progress(sum(j.read_bytes for p in parts for j in p), "verify", quiet=quiet)
    for i, jobs in enumerate(parts):
        name = part_name(i)
        try:
            got = read_checked_part(folder, name, man, [j.param.path for j in jobs], verify=False)
            for job in jobs:
                for key, want in assemble(job, dequantize, dtype).items():
                    if not _same(got[key], want):
                        raise CheckpointError(f"{folder / PARTS / name}: {key} differs from {job.sources[0].file} "
                                              f"tensor {job.sources[0].name!r} on re-read")
                bar.advance(job.read_bytes)
            if checksums(got) != man["parts"][name]["crc32"]:
                raise CheckpointError(f"{folder / MANIFEST}: parts.{name}.crc32 does not match the arrays written")
        except CheckpointError as e:
            drop_part(folder, i)
            raise ConversionError(f"{e}; the output is not trustworthy: {name} was removed, rerun with --resume "
                                  f"to write it again") from None
    bar.close()


def _check_free_space(out: Path, needed: int) -> None:
    """Refuse, before writing, when the output's file system has less room than ``needed`` bytes."""
    folder = next(p for p in (out.absolute(), *out.absolute().parents) if p.exists())
    free = shutil.disk_usage(folder).free
    if free < needed:
        raise ConversionError(f"{folder}: {size(free)} free but the conversion needs about {size(needed)}; "
                              f"nothing was written")


def convert(
    source: str | Path, out: str | Path, *, dtype: CastTo = None, dequantize: Dequantize = None, resume: bool = False,
    verify: bool = False, quiet: bool = False, allow_unknown: bool = False, part_bytes: int = 128 << 20,
    inflight_bytes: int = 768 << 20, process_index: int = 0, process_count: int = 1, wait_s: float = 1800,
) -> Path:
    """Convert the released checkpoint folder ``source`` into the k3jax checkpoint ``out``.

    ``dtype`` ("bf16", "f16", "f32"; default: as stored) casts the weights (see ``out_dtype``);
    ``dequantize="bf16"`` stores MXFP4 experts as bf16 [E, N, K]; ``resume`` continues from
    ``<out>.partial``; ``verify`` re-reads the output and compares it bit for bit before the final
    rename. ``part_bytes`` sizes the orbax parts (the unit of resuming); ``inflight_bytes`` bounds
    the parts being assembled or written at once (memory). Returns ``out``.

    ``process_index`` / ``process_count``: this is process k of n converting together (same arguments,
    one folder all can write): it writes parts k, k + n, ... Process 0 prepares ``<out>.partial`` (the
    others wait for it, up to ``wait_s``), then waits for every part (failing once none completed for
    ``wait_s``), writes the manifest, verifies (all parts) and renames; the others return ``<out>.partial``
    when their parts are written. A run that failed is finished by rerunning with ``resume``, as n
    processes or as one.

    Raises ``CheckpointError`` for bad input: found while planning, nothing was written; found in a
    tensor's data midway (a NaN scale byte), ``<out>.partial`` is removed and the message says so.
    Raises ``ConversionError`` when writing fails (disk full, no permission) or verification fails:
    ``<out>.partial`` is kept for ``resume`` and the message says so; ``out`` does not exist.
    """
    source, out = Path(source), Path(out)
    if dtype not in (None, *CASTS):
        raise ValueError(f"dtype: {dtype!r}; expected None or one of {sorted(CASTS)}")
    if dequantize not in (None, "bf16"):
        raise ValueError(f"dequantize: {dequantize!r}; expected None or 'bf16'")
    share = Share(process_index, process_count)
    if out.exists():
        raise ConversionError(f"{out}: already exists; remove it or choose another output path")
    partial = partial_of(out)
    pl = plan(open_checkpoint(source), allow_unknown=allow_unknown)
    parts = split_parts(pl.jobs, part_bytes, dequantize, dtype)
    sizes = [sum(out_bytes(j, dequantize, dtype) for j in jobs) for jobs in parts]
    fingerprint = _fingerprint(pl, parts, dequantize, dtype)
    if share.index:
        join(partial, fingerprint, share, wait_s)
    else:
        if not partial.exists():
            _check_free_space(out, sum(sizes))
        prepare(partial, fingerprint, resume, share)
    mine = [i for i in range(len(parts)) if share.owns(i)]
    bar = Progress(sum(j.read_bytes for i in mine for j in parts[i]), f"convert {source.name}", quiet=quiet)

    def part(i: int) -> dict[str, np.ndarray]:
        leaves: dict[str, np.ndarray] = {}
        for job in parts[i]:
            leaves.update(assemble(job, dequantize, dtype))
            bar.advance(job.read_bytes)
        return leaves

    skip = lambda i: bar.advance(sum(j.read_bytes for j in parts[i]), skipped=True)
    try:
        write_parts(partial, len(parts), ((i, sizes[i], functools.partial(part, i))
                                          for i in iter_todo(partial, len(parts), skip, share)), inflight_bytes)
        bar.close()
        if share.index:
            return partial
        wait_for_parts(partial, len(parts), wait_s)
        shutil.copyfile(source / "config.json", partial / "config.json")
        write_json(partial / MANIFEST, manifest(pl, parts, part_entries(partial, len(parts)), dequantize, dtype))
        if verify:
            verify_parts(partial, parts, dequantize, dtype, quiet=quiet)
        finish(partial, out)
    except CheckpointError as e:
        discard(partial)
        raise CheckpointError(f"{e}; {partial} was removed (nothing is kept: the source must change first)") from None
    except OSError as e:
        raise ConversionError(f"{e.filename or partial}: {e.strerror or e}; {out} was not created and {partial} "
                              f"is kept: fix the cause and rerun with --resume") from e
    if not quiet and pl.skipped:
        print(f"note: skipped {len(pl.skipped)} tensor(s) outside the text model (vision tower, projector)",
              file=sys.stderr)
    return out


__all__ = ["CASTS", "ConversionError", "Job", "Plan", "assemble", "convert", "manifest", "model_config", "out_bytes",
           "out_dtype", "plan", "split_parts", "verify_parts"]
