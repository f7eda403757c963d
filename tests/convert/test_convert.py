"""Converter end to end: synthetic released checkpoints -> k3jax -> logits, and back, bit for bit."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from convert import convert, export_checkpoint, read_params, write_synthetic
from convert.cli import build_parser, main
from convert.manifest import MANIFEST
from convert.testing import k3_config, linear_config, same_bytes
from k3jax.checkpoint import from_params, load
from k3jax.config import from_hf_config
from k3jax.mx import MXTensor

CONFIGS = {"k3": k3_config, "linear": linear_config}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def source(request, tmp_path_factory):
    """(name, folder, hf_config, in-memory params) of a synthetic released checkpoint."""
    folder = tmp_path_factory.mktemp(request.param) / "released"
    hf, params = write_synthetic(folder, CONFIGS[request.param](), seed=3)
    return request.param, folder, hf, params


@pytest.fixture(scope="module")
def converted(source, tmp_path_factory):
    name, folder, _, _ = source
    out = tmp_path_factory.mktemp(name + "_out") / "k3jax"
    return convert(folder, out, verify=True, quiet=True, part_bytes=64 << 10)


def test_released_layout(source):
    name, folder, hf, _ = source
    files = sorted(p.name for p in folder.iterdir())
    assert "model.safetensors.index.json" in files and sum(f.endswith(".safetensors") for f in files) >= 3
    weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    if name == "k3":
        assert "text_config" in hf and all(n.startswith("language_model.") for n in weight_map)
        assert "language_model.model.layers.1.block_sparse_moe.experts.5.w2.weight_packed" in weight_map
        assert "language_model.model.layers.4.mlp_res_proj.weight" in weight_map
    else:
        assert "model.layers.2.block_sparse_moe.experts.4.w3.weight" in weight_map
        assert not any("weight_packed" in n for n in weight_map)


def test_params_bit_identical(source, converted):
    _, _, _, params = source
    got = read_params(converted)
    assert got.keys() == params.keys()
    for path, want in params.items():
        if isinstance(want, MXTensor):
            assert isinstance(got[path], MXTensor), path
            assert same_bytes(got[path].codes, want.codes) and same_bytes(got[path].scales, want.scales), path
        else:
            assert same_bytes(got[path], want), path


def test_logits_match_in_memory_params(source, converted):
    _, folder, hf, params = source
    cfg = from_hf_config(hf)
    reference = from_params(cfg, params)
    graphdef, ref_state = nnx.split(reference)
    forward = jax.jit(lambda state, tokens: nnx.merge(graphdef, state)(tokens))
    tokens = (jnp.arange(2 * 13).reshape(2, 13) * 37 + 5) % cfg.vocab_size
    want = forward(ref_state, tokens)
    assert bool(jnp.all(jnp.isfinite(want))) and float(jnp.std(want)) > 0
    for path in (converted, folder):
        _, state = nnx.split(load(path))
        assert bool(jnp.all(forward(state, tokens) == want)), path


def test_export_round_trip_bit_identical(source, converted, tmp_path):
    _, folder, _, _ = source
    back = export_checkpoint(converted, tmp_path / "back")
    names = sorted(p.name for p in folder.iterdir())
    assert sorted(p.name for p in back.iterdir()) == names
    for n in names:
        assert (back / n).read_bytes() == (folder / n).read_bytes(), n


def test_dequantize_bf16_then_export_repacks(tmp_path):
    folder = tmp_path / "released"
    _, params = write_synthetic(folder, k3_config(), seed=5)
    out = convert(folder, tmp_path / "bf16", dequantize="bf16", quiet=True)
    man = json.loads((out / MANIFEST).read_text())
    assert man["params"]["layers.1.block_sparse_moe.experts.w1"]["dtype"] == "BF16"
    got = read_params(out)
    w2 = params["layers.2.block_sparse_moe.experts.w2"]
    assert same_bytes(got["layers.2.block_sparse_moe.experts.w2"], np.asarray(w2.decode(jnp.bfloat16)))
    back = export_checkpoint(out, tmp_path / "back")
    for p in folder.iterdir():
        assert (back / p.name).read_bytes() == p.read_bytes(), p.name
    requantized = load(out).layers[2].block_sparse_moe.experts.w2.get_value()
    assert same_bytes(requantized.codes, w2.codes) and same_bytes(requantized.scales, w2.scales)
    decoded = load(folder, packed_experts=False).layers[2].block_sparse_moe.experts.w2.get_value()
    assert same_bytes(decoded, np.asarray(w2.decode(jnp.bfloat16)))


def test_cli_convert_verify_and_export(tmp_path, capsys):
    folder = tmp_path / "released"
    parser = build_parser()
    assert main(parser.parse_args(["--synthetic", "tiny_linear", str(folder), "--shard-mb", "1"])) == 0
    assert main(parser.parse_args([str(folder), str(tmp_path / "k3jax"), "--verify"])) == 0
    assert "convert released" in capsys.readouterr().err
    assert main(parser.parse_args(["--export", str(tmp_path / "k3jax"), str(tmp_path / "back")])) == 0
    assert (tmp_path / "back" / "model.safetensors").read_bytes() == (folder / "model.safetensors").read_bytes()
    assert main(parser.parse_args([str(folder), str(tmp_path / "k3jax")])) == 1
    assert "already exists" in capsys.readouterr().err
