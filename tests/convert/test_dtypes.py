"""Checkpoints saved in float32 and float16 (as HF saves a model held in that dtype): converted as
stored or cast with ``dtype``, and read to the same logits as the float32 maths on the same weights."""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from convert import CheckpointError, convert, read_params, write_synthetic
from convert.manifest import MANIFEST
from convert.names import param_table
from convert.safetensors_io import open_checkpoint
from convert.testing import copy_folder, edit_tensors, linear_config, same_bytes
from k3jax.checkpoint import from_params, load
from k3jax.config import from_hf_config

TOKENS = (jnp.arange(2 * 13).reshape(2, 13) * 37 + 5) % 320


@functools.partial(jax.jit, static_argnums=0)
def _logits(graphdef, state, tokens):
    return nnx.merge(graphdef, state)(tokens)


def logits(model):
    """Forward logits [2, 13, V] float32 of ``model`` (one compilation per graph and dtypes)."""
    graphdef, state = nnx.split(model)
    return _logits(graphdef, state, TOKENS)


@pytest.fixture(scope="module", params=["F32", "F16"])
def saved(request, tmp_path_factory):
    """(dtype, released folder with every float tensor in that dtype, converted folder, float32
    reference params: the drawn values rounded through that dtype)."""
    folder = tmp_path_factory.mktemp(request.param) / "released"
    hf, params = write_synthetic(folder, linear_config(), seed=11, dtype=request.param)
    stored = np.dtype(np.float16 if request.param == "F16" else np.float32)
    reference = {k: np.asarray(v).astype(stored).astype(np.float32) for k, v in params.items()}
    out = convert(folder, tmp_path_factory.mktemp(request.param + "_out") / "k3jax", quiet=True, verify=True)
    return request.param, folder, out, reference


def test_released_layout_holds_the_dtype(saved):
    dtype, folder, _, _ = saved
    assert {t.dtype for s in open_checkpoint(folder).shards for t in s.tensors} == {dtype}


def test_kept_as_stored_and_said_in_the_manifest(saved):
    dtype, _, out, reference = saved
    man = json.loads((out / MANIFEST).read_text())
    assert man["dtype"] is None and {p["dtype"] for p in man["params"].values()} == {dtype}
    got = read_params(out)
    for path, want in reference.items():
        assert same_bytes(got[path], want.astype(got[path].dtype)), path


def test_logits_equal_the_float32_maths_on_the_same_weights(saved):
    dtype, folder, out, reference = saved
    cfg = from_hf_config(json.loads((folder / "config.json").read_text()))
    want = logits(from_params(cfg, reference, dtype=jnp.float32))
    assert bool(jnp.all(jnp.isfinite(want))) and float(jnp.std(want)) > 0
    for path in (out, folder):
        model = load(path, dtype=jnp.float32)
        assert bool(jnp.all(logits(model) == want)), path
    default = load(out)
    assert default.embed_tokens.weight.get_value().dtype == {"F32": jnp.float32, "F16": jnp.float16}[dtype]


def test_dtype_casts_weights_and_keeps_float32_parameters(saved, tmp_path):
    dtype, folder, _, reference = saved
    out = convert(folder, tmp_path / "bf16", dtype="bf16", quiet=True)
    man = json.loads((out / MANIFEST).read_text())
    table = {p.path: p.dtype for p in param_table(from_hf_config(json.loads((folder / "config.json").read_text())))}
    assert man["dtype"] == "BF16"
    assert all(man["params"][path]["dtype"] == kind for path, kind in table.items())
    got = read_params(out)
    for path, kind in table.items():
        want = reference[path].astype(jnp.bfloat16 if kind == "BF16" else np.float32)
        assert same_bytes(got[path], want), path


def test_experts_of_one_stack_in_two_dtypes_are_refused(saved, tmp_path):
    _, folder, _, _ = saved
    src = copy_folder(folder, tmp_path / "src")
    name = "model.layers.2.block_sparse_moe.experts.3.w1.weight"
    shard = next(i for i, s in enumerate(open_checkpoint(src).shards) if any(t.name == name for t in s.tensors))
    edit_tensors(src, lambda t: {**t, name: t[name].astype(jnp.bfloat16)}, shard=shard)
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' is BF16 but .* expected one dtype for the experts "
                                              r"stacked into layers.2.block_sparse_moe.experts.w1"):
        convert(src, tmp_path / "out", quiet=True)
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()
