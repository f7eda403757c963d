"""The one name table: k3jax canonical parameter paths <-> released safetensors tensor names.

Canonical paths are the nnx state paths of ``K3Model`` (one entry per layer, unscanned), e.g.
``layers.3.self_attn.kv_b_proj.weight``. The released name is the path with ``model.`` in front
(K3 also puts ``language_model.`` in front of everything), except where ``_RULES`` says
otherwise. Three per-tensor transforms exist besides a plain copy (all keep the PyTorch [out, in]
layout, nothing is transposed):

- ``a_log``: KDA ``A_log``. K3 stores float32 [P] padded (P >= H, here a multiple of 128); Kimi-Linear
  stores float32 [1, 1, H, 1]; canonical is float32 [H].
- ``experts``: routed experts are stacked per layer, canonical [E, F, R] (w1, w3) / [E, R, F] (w2);
  released one tensor per expert: ``experts.<e>.w1.weight`` bf16 [F, R] (Kimi-Linear), or MXFP4
  ``experts.<e>.w1.weight_packed`` uint8 [F, R//2] + ``weight_scale`` uint8 [F, R//32] (K3).
- aliases: the dense layer-0 MLP is ``mlp.*`` or ``block_sparse_moe.{gate,up,down}_proj.*``.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass
from typing import Any, Literal, Mapping

import jax.numpy as jnp
import numpy as np
from flax import nnx

from convert.safetensors_io import DTYPES, FLOATS, CheckpointError, TensorInfo, dtype_name
from k3jax.config import K3Config
from k3jax.model import K3Model
from k3jax.mx import BLOCK, MXTensor, decode_compiled, quantize_compiled

Kind = Literal["copy", "a_log", "experts"]
K3_PREFIX = "language_model."
SKIPPED_PREFIXES = ("vision_tower.", "mm_projector.")
A_LOG_PAD = 128

# (canonical path regex, released name templates: first is written on export, the rest are accepted
# aliases; {0}, {1}.. are the regex groups and {e} the expert index), transform.
_RULES: tuple[tuple[str, tuple[str, ...], Kind], ...] = (
    (r"embed_tokens\.weight", ("model.embed_tokens.weight",), "copy"),
    (r"lm_head\.weight", ("lm_head.weight",), "copy"),
    (r"output_attn_res\.(norm|proj)\.weight", ("model.output_attn_res_{0}.weight",), "copy"),
    (r"layers\.(\d+)\.(self_attention|mlp)_res\.(norm|proj)\.weight", ("model.layers.{0}.{1}_res_{2}.weight",), "copy"),
    (r"layers\.(\d+)\.self_attn\.A_log", ("model.layers.{0}.self_attn.A_log",), "a_log"),
    (r"layers\.(\d+)\.block_sparse_moe\.experts\.(w[123])", ("model.layers.{0}.block_sparse_moe.experts.{{e}}.{1}",), "experts"),
    (r"layers\.(\d+)\.mlp\.(\w+)\.weight", ("model.layers.{0}.mlp.{1}.weight", "model.layers.{0}.block_sparse_moe.{1}.weight"), "copy"),
    (r"(.+)", ("model.{0}",), "copy"),
)


@dataclass(frozen=True)
class Param:
    """A canonical parameter: ``path``, logical ``shape``, released element dtype ("BF16", "F32"),
    the transform ``kind`` and the released name templates (first is the export default)."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    kind: Kind
    names: tuple[str, ...]


@dataclass(frozen=True)
class Released:
    """One released tensor and where its bytes come from: ``param`` path, plus ``expert`` row and
    ``field`` ("weight", "weight_packed", "weight_scale") for routed experts."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    param: str
    expert: int | None = None
    field: str = "weight"


def prefix_for(hf_config: Mapping[str, Any]) -> str:
    """``language_model.`` for K3's multimodal config (nested ``text_config``), else ''."""
    return K3_PREFIX if "text_config" in hf_config else ""


def _rule(path: str) -> tuple[tuple[str, ...], Kind]:
    for pattern, templates, kind in _RULES:
        m = re.fullmatch(pattern, path)
        if m:
            return tuple(t.format(*m.groups()) for t in templates), kind
    raise AssertionError(path)  # the last rule matches everything


@functools.lru_cache(maxsize=16)
def param_table(cfg: K3Config) -> tuple[Param, ...]:
    """Every parameter of ``K3Model(cfg)`` (released dtypes: bf16 weights; float32 A_log, dt_bias,
    conv weights and router bias), in nnx state order. "BF16" marks the weights that follow the
    model's parameter dtype, "F32" those it keeps in float32. Cached: ``nnx.eval_shape`` takes seconds."""
    model = nnx.eval_shape(lambda: K3Model(cfg, rngs=nnx.Rngs(0), param_dtype=jnp.bfloat16))
    out = []
    for key, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        value = var.get_value()
        path = ".".join(map(str, key))
        names, kind = _rule(path)
        dtype = "BF16" if isinstance(value, MXTensor) else dtype_name(value.dtype)
        out.append(Param(path, tuple(value.shape), dtype, kind, names))
    return tuple(out)


def _a_log_shape(p: Param, source: TensorInfo | None, k3: bool) -> tuple[int, ...]:
    (h,) = p.shape
    if source is None:
        return (-(-h // A_LOG_PAD) * A_LOG_PAD,) if k3 else (1, 1, h, 1)
    if source.shape == (1, 1, h, 1) or (len(source.shape) == 1 and source.shape[0] >= h):
        return source.shape
    raise CheckpointError(
        f"{source.file}: tensor {source.name!r} has shape {source.shape}; expected A_log as [P >= {h}] "
        f"(K3, padded) or [1, 1, {h}, 1] (Kimi-Linear) for {h} KDA heads"
    )


def released_specs(
    params: tuple[Param, ...], prefix: str, mx: bool, present: Mapping[str, TensorInfo] | None = None,
) -> tuple[list[Released], list[str]]:
    """The released tensors the parameters map to -> (specs, missing names).

    ``present`` (a checkpoint's tensors) picks among aliases and the A_log variant; without it the
    export defaults are used (first alias, K3 padding when ``prefix`` is K3's). ``mx`` says routed
    experts are MXFP4 packed.
    """
    specs, missing = [], []
    have = present if present is not None else {}
    for p in params:
        names = [prefix + n for n in p.names]
        if p.kind == "experts":
            e_count, rows, k = p.shape
            if mx and k % BLOCK:
                raise CheckpointError(f"{p.path}: MXFP4 needs the input width {k} to be a multiple of {BLOCK}")
            fields = (("weight_packed", "U8", (rows, k // 2)), ("weight_scale", "U8", (rows, k // BLOCK))) if mx \
                else (("weight", p.dtype, (rows, k)),)
            for e in range(e_count):
                for field, dtype, shape in fields:
                    name = f"{names[0].format(e=e)}.{field}"
                    specs.append(Released(name, dtype, shape, p.path, e, field))
                    if present is not None and name not in have:
                        missing.append(name)
            continue
        found = [n for n in names if n in have]
        if len(found) > 1:
            raise CheckpointError(f"{p.path}: the checkpoint has both {found[0]!r} and {found[1]!r}; expected one")
        name = found[0] if found else names[0]
        if present is not None and not found:
            missing.append(" or ".join(repr(n) for n in names) if len(names) > 1 else name)
        shape = _a_log_shape(p, have.get(name), prefix == K3_PREFIX) if p.kind == "a_log" else p.shape
        specs.append(Released(name, p.dtype, shape, p.path))
    return specs, missing


def check_tensor(spec: Released, info: TensorInfo) -> None:
    """Raise ``CheckpointError`` naming file and tensor if shape or dtype differ from ``spec``. A
    float parameter may be saved in any of ``FLOATS`` (HF saves a model in its own dtype)."""
    floats = spec.dtype in FLOATS
    dtype_ok = info.dtype in FLOATS if floats else info.dtype == spec.dtype
    if not dtype_ok or info.shape != spec.shape:
        want = info.dtype if dtype_ok else ("BF16, F16 or F32" if floats else spec.dtype)
        raise CheckpointError(
            f"{info.file}: tensor {info.name!r} is {info.dtype} {list(info.shape)}; "
            f"expected {want} {list(spec.shape)} (for k3jax parameter {spec.param})"
        )


def a_log_to_canonical(x: np.ndarray, heads: int) -> tuple[np.ndarray, np.ndarray]:
    """Released A_log float32 [P >= H] or [1, 1, H, 1] -> (canonical [H], padding tail [P - H] or [0])."""
    flat = x.reshape(-1)
    return np.array(flat[:heads]), np.array(flat[heads:]) if x.ndim == 1 else np.zeros((0,), x.dtype)


def a_log_to_released(x: np.ndarray, shape: tuple[int, ...], tail: np.ndarray | None = None) -> np.ndarray:
    """Canonical A_log [H] -> released ``shape`` ([P] padded with ``tail`` or zeros, or [1, 1, H, 1])."""
    if len(shape) != 1:
        return np.asarray(x).reshape(shape)
    out = np.zeros(shape, np.float32)
    out[: x.shape[0]] = x
    if tail is not None and tail.size:
        out[x.shape[0]:] = tail
    return out


def expert_row(value: Any, spec: Released) -> np.ndarray:
    """Row ``spec.expert`` of a stacked expert parameter in the released field's format: from a
    float [E, N, K] array (as stored; quantized to MXFP4 if ``spec`` is packed) or an ``MXTensor``
    (decoded to bf16 if ``spec`` is a plain weight)."""
    e = spec.expert
    if spec.field == "weight":
        row = decode_compiled(MXTensor(value.codes[e], value.scales[e]), jnp.bfloat16) if isinstance(value, MXTensor) else value[e]
        return np.asarray(row)
    if not isinstance(value, MXTensor):
        value = quantize_compiled(jnp.asarray(value[e : e + 1]))
        e = 0
    return np.asarray(value.codes[e] if spec.field == "weight_packed" else value.scales[e])


def is_skipped(name: str, prefix: str) -> bool:
    """Tensors outside the text model (K3's vision tower and projector) are skipped on purpose."""
    return any(name.startswith(p) or name.startswith(prefix + p) for p in SKIPPED_PREFIXES)


def nbytes(shape: tuple[int, ...], dtype: str) -> int:
    """Bytes of a ``dtype`` (safetensors name) tensor of ``shape``."""
    return math.prod(shape) * DTYPES[dtype].itemsize


__all__ = [
    "A_LOG_PAD",
    "K3_PREFIX",
    "Param",
    "Released",
    "a_log_to_canonical",
    "a_log_to_released",
    "check_tensor",
    "expert_row",
    "is_skipped",
    "nbytes",
    "param_table",
    "prefix_for",
    "released_specs",
]
