"""Load a checkpoint into a ready ``K3Model``: a converted k3jax checkpoint or a released folder.

``load(path)`` reads ``path/config.json`` and builds the model abstractly (``nnx.eval_shape``, no
initializer runs), then fills it parameter by parameter, placing each on the device (or on a mesh)
as soon as it is read, so host memory holds about one part/tensor at a time:

- a k3jax checkpoint (``convert.convert`` output: ``k3jax_checkpoint.json`` + orbax parts), or
- a released safetensors folder (Kimi-K3 or Kimi-Linear), converted on the fly (same name table,
  same validation as ``k3jax convert``).

Routed experts: if the model's expert parameters hold ``MXTensor`` values (``K3Model``'s default
for an MXFP4 config) they are filled with the packed codes and scales (or quantized, from a bf16
checkpoint: lossless for values that came from MXFP4); with ``packed_experts=False`` they hold
arrays and MXFP4 experts are decoded to the parameter dtype. Sharding on a ``mesh``: everything replicated, except routed
experts, split along E over a mesh axis named ``expert`` when there is one and it divides E.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from k3jax.config import K3Config, from_hf_config
from k3jax.model import K3Model
from k3jax.mx import MXTensor, decode_compiled, quantize_compiled
from k3jax.sharding import EXPERT_AXIS



def _config(path: Path, config: K3Config | Mapping[str, Any] | None) -> K3Config:
    from convert.safetensors_io import read_config

    if isinstance(config, K3Config):
        return config
    return from_hf_config(config if config is not None else read_config(path), name=path.name)


def iter_params(path: str | Path, cfg: K3Config) -> Iterator[tuple[str, Any]]:
    """Stream (canonical path, numpy array or ``MXTensor`` of numpy arrays) from either kind of folder."""
    from convert.conversion import assemble, plan
    from convert.orbax_io import CheckpointParams, is_k3jax_checkpoint
    from convert.safetensors_io import open_checkpoint

    path = Path(path)
    if is_k3jax_checkpoint(path):
        params = CheckpointParams(path, cache_parts=1)
        for name in params:
            yield name, params[name]
        return
    for job in plan(open_checkpoint(path), cfg=cfg).jobs:
        leaves = assemble(job)
        name = job.param.path
        yield name, MXTensor(leaves[name + ".codes"], leaves[name + ".scales"]) if name not in leaves else leaves[name]


def sharding_for(mesh: Mesh | None, path: str, shape: tuple[int, ...]) -> NamedSharding | None:
    """Replicated, except routed experts [E, ...] split over the ``expert`` mesh axis (when it divides E)."""
    if mesh is None:
        return None
    if ".experts.w" in path and EXPERT_AXIS in mesh.axis_names and shape[0] % mesh.shape[EXPERT_AXIS] == 0:
        return NamedSharding(mesh, PartitionSpec(EXPERT_AXIS))
    return NamedSharding(mesh, PartitionSpec())


def coerce(target: Any, value: Any, path: str) -> Any:
    """Fit a stored value to the model's abstract parameter ``target`` (ShapeDtypeStruct or
    MXTensor of them): MXFP4 <-> array as needed, float dtype cast, shape checked."""
    from convert.safetensors_io import CheckpointError

    if tuple(value.shape) != tuple(target.shape):
        raise CheckpointError(f"{path}: checkpoint holds shape {tuple(value.shape)}; the model expects "
                              f"{tuple(target.shape)} (does config.json match the checkpoint?)")
    if isinstance(target, MXTensor):
        return value if isinstance(value, MXTensor) else quantize_compiled(jnp.asarray(value))
    if isinstance(value, MXTensor):
        return decode_compiled(MXTensor(jnp.asarray(value.codes), jnp.asarray(value.scales)), jnp.dtype(target.dtype))
    return np.asarray(value).astype(target.dtype, copy=False)


def _place(value: Any, sharding: NamedSharding | None) -> Any:
    put = (lambda a: jax.device_put(a, sharding)) if sharding is not None else jnp.asarray
    return jax.tree.map(put, value)


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
        var.set_value(_place(coerce(target, value, name), sharding_for(mesh, name, tuple(target.shape))))
    if todo:
        raise CheckpointError(f"{where}: {len(todo)} model parameter(s) missing, e.g. {next(iter(todo))}")
    return nnx.merge(graphdef, state)


def load(
    path: str | Path, mesh: Mesh | None = None, config: K3Config | Mapping[str, Any] | None = None, *,
    dtype: Any = None, packed_experts: bool | None = None,
) -> K3Model:
    """Restore ``path`` (k3jax checkpoint or released safetensors folder) into a ready ``K3Model``.

    ``config`` (a ``K3Config`` or config.json dict) overrides ``path/config.json``. ``dtype`` is the
    model's ``param_dtype`` (default bf16: parameters keep their released dtypes, float32 where
    released so). ``packed_experts``: routed experts as MXFP4 ``MXTensor`` (default for K3) or
    decoded ``dtype`` arrays (False). ``mesh``: see the module docstring. Raises ``CheckpointError`` naming the tensor
    if the checkpoint does not fit the model; ``nnx.split(model)`` gives graphdef and state.
    """
    path = Path(path)
    cfg = _config(path, config)
    return from_params(cfg, iter_params(path, cfg), mesh, dtype=dtype, packed_experts=packed_experts,
                       where=str(path))


__all__ = ["coerce", "from_params", "iter_params", "load", "sharding_for"]
