"""Load a checkpoint into a ready ``K3Model``: a converted k3jax checkpoint or a released folder.

``load(path)`` reads ``path/config.json`` and builds the model abstractly (``nnx.eval_shape``, no
initializer runs), then fills it parameter by parameter, placing each on the device (or on a mesh)
as soon as it is read, so host memory holds about one part/tensor at a time:

- a k3jax checkpoint (``convert.convert`` output: ``k3jax_checkpoint.json`` + orbax parts; its
  structure checked as it is read, its CRC-32s with ``verify=True``), or
- a released safetensors folder (Kimi-K3 or Kimi-Linear, weights in bf16, f16 or f32), converted
  on the fly (same name table, same validation as ``k3jax convert``).

Routed experts: if the model's expert parameters hold ``MXTensor`` values (``K3Model``'s default
for an MXFP4 config) they are filled with the packed codes and scales (or quantized, from a bf16
checkpoint: lossless for values that came from MXFP4); with ``packed_experts=False`` they hold
arrays and MXFP4 experts are decoded to the parameter dtype.

On a ``mesh`` (``k3jax.sharding.make_mesh``, over every process's devices) each parameter becomes a
global array split as ``k3jax.sharding.rules`` says (``jax.make_array_from_callback``), and each process
reads only the rows its own devices hold: a k3jax checkpoint's arrays are read by ranges of their first
dim (``convert.orbax_io.map_part``), so a host that holds an eighth of the experts reads an eighth of
their bytes (an array split along a later dim, e.g. ``o_proj`` by heads, is read whole). Whole arrays
are read where a value must be computed first (MXFP4 experts decoded, bf16 experts quantized), with
``verify`` (a CRC-32 covers the whole array), for a part stored in another orbax layout, and from a
released safetensors folder (each process reads every tensor: convert it first; docs/multi_host.md).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from k3jax.config import K3Config, from_hf_config
from k3jax.model import K3Model
from k3jax.mx import MXTensor, decode_compiled, quantize_compiled
from k3jax.sharding.rules import param_spec

_DTYPES = {"BF16": jnp.bfloat16, "F16": jnp.float16, "F32": jnp.float32}


def _config(path: Path, config: K3Config | Mapping[str, Any] | None) -> K3Config:
    from convert.safetensors_io import read_config

    if isinstance(config, K3Config):
        return config
    source = "config" if config is not None else str(path / "config.json")
    return from_hf_config(config if config is not None else read_config(path), name=path.name, source=source)


def _source(path: Path, cfg: K3Config, verify: bool, mapped: bool = False) -> tuple[Iterator[tuple[str, Any]], str]:
    """(canonical path, value) pairs of either kind of folder, and the embedding's stored dtype; with
    ``mapped`` a k3jax checkpoint's arrays are read only where indexed (``CheckpointParams``)."""
    from convert.conversion import assemble, plan
    from convert.integrity import CheckpointParams
    from convert.manifest import is_k3jax_checkpoint
    from convert.safetensors_io import open_checkpoint

    if is_k3jax_checkpoint(path):
        params = CheckpointParams(path, cache_parts=1, verify=verify, mapped=mapped)
        return ((name, params[name]) for name in params), params.params["embed_tokens.weight"]["dtype"]

    def released() -> Iterator[tuple[str, Any]]:
        for job in pl.jobs:
            leaves = assemble(job)
            name = job.param.path
            yield name, MXTensor(leaves[name + ".codes"], leaves[name + ".scales"]) if name not in leaves else leaves[name]

    pl = plan(open_checkpoint(path), cfg=cfg)
    return released(), next(j for j in pl.jobs if j.param.path == "embed_tokens.weight").sources[0].dtype


def iter_params(path: str | Path, cfg: K3Config, *, verify: bool = False) -> Iterator[tuple[str, Any]]:
    """Stream (canonical path, numpy array or ``MXTensor`` of numpy arrays) from either kind of folder.
    A k3jax checkpoint's structure is checked as it is read, and each array's CRC-32 with ``verify``."""
    return _source(Path(path), cfg, verify)[0]


def sharding_for(cfg: K3Config, mesh: Mesh | None, path: str, shape: tuple[int, ...]) -> NamedSharding | None:
    """Where parameter ``path`` of ``shape`` lives on ``mesh`` (``k3jax.sharding.rules``); None without a mesh."""
    return None if mesh is None else NamedSharding(mesh, param_spec(cfg, path, shape, mesh))


def coerce(target: Any, value: Any, path: str) -> Any:
    """Fit a stored value to the model's abstract parameter ``target`` (ShapeDtypeStruct or
    MXTensor of them): shape checked, MXFP4 <-> array as needed (whole: a jax array); a stored
    array is returned as it is (a ``StoredArray`` unread), to be cast as it is placed."""
    from convert.safetensors_io import CheckpointError

    if tuple(value.shape) != tuple(target.shape):
        raise CheckpointError(f"{path}: checkpoint holds shape {tuple(value.shape)}; the model expects "
                              f"{tuple(target.shape)} (does config.json match the checkpoint?)")
    if isinstance(target, MXTensor):
        return value if isinstance(value, MXTensor) else quantize_compiled(jnp.asarray(value))
    if isinstance(value, MXTensor):
        return decode_compiled(MXTensor(jnp.asarray(value.codes), jnp.asarray(value.scales)), jnp.dtype(target.dtype))
    return value


def _cast(value: Any, dtype: Any) -> Any:
    return value if isinstance(value, jax.Array) else np.asarray(value).astype(dtype, copy=False)


def _place(target: Any, value: Any, sharding: NamedSharding | None) -> Any:
    """``value``'s leaves in ``target``'s dtypes on the default device, or as global arrays placed by
    ``sharding``, for which each process reads (and casts) only the rows (first-dim ranges) its own
    devices' slices cover, each range once."""
    def put(t: jax.ShapeDtypeStruct, v: Any) -> jax.Array:
        if sharding is None:
            return jnp.asarray(_cast(v, t.dtype))
        rows = functools.cache(lambda start, stop: _cast(v[start:stop], t.dtype))
        return jax.make_array_from_callback(
            t.shape, sharding, lambda index: rows(*index[0].indices(t.shape[0])[:2])[(slice(None), *index[1:])])

    return jax.tree.map(put, target, value)


def from_params(
    cfg: K3Config, params: Iterable[tuple[str, Any]] | Mapping[str, Any], mesh: Mesh | None = None, *,
    dtype: Any = None, packed_experts: bool | None = None, where: str = "params",
) -> K3Model:
    """A ready ``K3Model`` from (canonical path, value) pairs or a path -> value mapping (numpy or
    jax arrays, ``MXTensor``), each placed as it arrives; ``where`` names the source in errors.
    ``packed_experts`` is ``K3Model``'s (default: MXFP4 ``MXTensor`` experts iff ``cfg.mx_experts``)."""
    from convert.safetensors_io import CheckpointError

    abstract = nnx.eval_shape(lambda: K3Model(cfg, rngs=nnx.Rngs(0), param_dtype=dtype or jnp.bfloat16,
                                              packed_experts=packed_experts))
    graphdef, state = nnx.split(abstract)
    todo = {".".join(map(str, k)): v for k, v in nnx.to_flat_state(state)}
    for name, value in params.items() if isinstance(params, Mapping) else params:
        if name not in todo:
            raise CheckpointError(f"{where}: parameter {name} has no place in the model built from its config")
        var = todo.pop(name)
        target = var.get_value()
        var.set_value(_place(target, coerce(target, value, name), sharding_for(cfg, mesh, name, tuple(target.shape))))
    if todo:
        raise CheckpointError(f"{where}: {len(todo)} model parameter(s) missing, e.g. {next(iter(todo))}")
    return nnx.merge(graphdef, state)


def load(
    path: str | Path, mesh: Mesh | None = None, config: K3Config | Mapping[str, Any] | None = None, *,
    dtype: Any = None, packed_experts: bool | None = None, verify: bool = False,
) -> K3Model:
    """Restore ``path`` (k3jax checkpoint or released safetensors folder) into a ready ``K3Model``.

    ``config`` (a ``K3Config`` or config.json dict) overrides ``path/config.json``. ``dtype`` is the
    model's ``param_dtype``; default: the dtype the embedding is stored in (bf16 for the released
    checkpoints; f32 or f16 for a checkpoint saved so), as HF transformers loads with
    ``dtype="auto"``; parameters the model keeps in float32 stay float32. ``packed_experts``:
    routed experts as MXFP4 ``MXTensor`` (default for K3) or decoded ``dtype`` arrays (False).
    ``mesh``: see the module docstring. A k3jax checkpoint's structure is always checked (manifest,
    parts, files and their sizes, array shapes); ``verify`` also checks every array's CRC-32 (a
    released folder has no checksums: its headers and sizes are checked either way), for which each
    process reads whole arrays, on a mesh too. Raises ``CheckpointError`` naming the file or tensor
    (``ConfigError`` for config.json) if the checkpoint is damaged or does not fit the model;
    ``nnx.split(model)`` gives graphdef and state.
    """
    path = Path(path)
    cfg = _config(path, config)
    params, stored = _source(path, cfg, verify, mapped=mesh is not None)
    return from_params(cfg, params, mesh, dtype=dtype or _DTYPES[stored], packed_experts=packed_experts,
                       where=str(path))


__all__ = ["coerce", "from_params", "iter_params", "load", "sharding_for"]
