"""JSON of the right syntax but the wrong types, and file names that try to leave their folder: each
refused with ``CheckpointError`` naming the file and key, before anything is opened or written."""

from __future__ import annotations

import json
import os

import pytest

from convert import CheckpointError, convert, export_checkpoint, write_synthetic
from convert.integrity import CheckpointParams
from convert.manifest import MANIFEST
from convert.safetensors_io import INDEX_FILE, open_checkpoint, read_header
from convert.testing import copy_folder, linear_config


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hostile") / "released"
    write_synthetic(folder, linear_config(), seed=5)
    return folder


@pytest.fixture(scope="module")
def converted(released, tmp_path_factory):
    return convert(released, tmp_path_factory.mktemp("hostile_out") / "k3jax", quiet=True, part_bytes=32 << 10)


def _refused(src, tmp_path, match):
    out = tmp_path / "out"
    with pytest.raises(CheckpointError, match=match):
        convert(src, out, quiet=True)
    assert not out.exists() and not out.with_name("out.partial").exists()


def _header(path, header: bytes, data: bytes = b"") -> None:
    path.write_bytes(len(header).to_bytes(8, "little") + header + data)


@pytest.mark.parametrize("header, match", [
    (b'{"__metadata__": ["format", "pt"]}', r"x.safetensors: __metadata__: expected a JSON object of strings, got a list"),
    (b'{"__metadata__": {"format": 1}}', r"x.safetensors: __metadata__: expected a JSON object of strings"),
    (b'{"t": {"dtype": "F32", "shape": "2", "data_offsets": [0, 8]}}', r"x.safetensors: t.shape: expected a list of "
                                                                        r"integers >= 0, got '2'"),
    (b'{"t": {"dtype": "F32", "shape": [true], "data_offsets": [0, 4]}}', r"t.shape: expected a list of integers"),
    (b'{"t": [1, 2]}', r"x.safetensors: t: expected a JSON object, got a list of 2"),
    (b'{"t": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "t": {}}', r"not valid JSON \(key 't' appears twice"),
    (b"[" * 100000 + b"]" * 100000, r"x.safetensors: corrupt header: not valid JSON \(nested too deep\)"),
    (b'{"t": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}', r"4 unused bytes before tensor 't'"),
])
def test_header_of_wrong_types(tmp_path, header, match):
    path = tmp_path / "x.safetensors"
    _header(path, header, bytes(8) if b"data_offsets" in header else b"")
    with pytest.raises(CheckpointError, match=match):
        read_header(path)


@pytest.mark.parametrize("weight_map, match", [
    (["model.embed_tokens.weight"], r"weight_map: expected a JSON object of strings, got a list of 1"),
    ({"model.embed_tokens.weight": 1}, r"weight_map: expected a JSON object of strings"),
    ({"model.embed_tokens.weight": "../outside.safetensors"}, r"weight_map\['model.embed_tokens.weight'\]: expected "
                                                              r"a file name inside the folder, got '../outside"),
    ({"model.embed_tokens.weight": "/etc/passwd"}, r"weight_map\['model.embed_tokens.weight'\]: expected a file name "
                                                   r"inside the folder, got '/etc/passwd'"),
])
def test_index_of_wrong_types_or_paths(released, tmp_path, weight_map, match):
    src = copy_folder(released, tmp_path / "src")
    (tmp_path / "outside.safetensors").write_bytes(b"not read")
    (src / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    _refused(src, tmp_path, rf"{INDEX_FILE}: {match}")


def test_index_shard_linked_out_of_the_folder(released, tmp_path):
    src = copy_folder(released, tmp_path / "src")
    shard = open_checkpoint(src).shards[0].file
    (src / shard).rename(tmp_path / "elsewhere.safetensors")
    (src / shard).symlink_to(tmp_path / "elsewhere.safetensors")
    _refused(src, tmp_path, rf"{INDEX_FILE}: '{shard}' is a link to .*elsewhere.safetensors, outside .*src")


def test_hub_cache_links_into_blobs_are_read(released, tmp_path):
    """The Hugging Face hub cache keeps files in <repo>/blobs and links them from <repo>/snapshots/<rev>."""
    snapshot, blobs = tmp_path / "repo" / "snapshots" / "abc123", tmp_path / "repo" / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for i, f in enumerate(sorted(released.iterdir())):
        (blobs / f"blob{i}").write_bytes(f.read_bytes())
        (snapshot / f.name).symlink_to(os.path.relpath(blobs / f"blob{i}", snapshot))
    assert convert(snapshot, tmp_path / "out", quiet=True).is_dir()


@pytest.mark.parametrize("config, match", [
    ([1, 2, 3], r"config.json: the top level: expected a JSON object, got a list of 3"),
    ({"num_hidden_layers": "three"}, r"config.json: num_hidden_layers: expected an integer >= 1, got 'three'"),
    ({"linear_attn_config": "kda"}, r"config.json: linear_attn_config: expected a JSON object, got 'kda'"),
    ({"linear_attn_config": {"full_attn_layers": "3"}}, r"config.json: linear_attn_config.full_attn_layers: expected "
                                                        r"a list of integers, got '3'"),
    ({"text_config": 7}, r"config.json: text_config: expected a JSON object, got 7"),
])
def test_config_of_wrong_types(released, tmp_path, config, match):
    src = copy_folder(released, tmp_path / "src")
    base = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(config if isinstance(config, list) else {**base, **config}))
    _refused(src, tmp_path, match)


def _manifest(ckpt, tmp_path, edit):
    bad = copy_folder(ckpt, tmp_path / "ckpt")
    man = json.loads((bad / MANIFEST).read_text())
    edit(man)
    (bad / MANIFEST).write_text(json.dumps(man))
    return bad


@pytest.mark.parametrize("name", ["../escaped.safetensors", "/tmp/escaped.safetensors", "sub/x.safetensors", ".."])
def test_export_of_a_crafted_manifest_writes_nothing_outside(converted, tmp_path, name):
    bad = _manifest(converted, tmp_path, lambda m: m["source"]["shards"][0].update(file=name))
    with pytest.raises(CheckpointError, match=rf"{MANIFEST}: source.shards\[0\].file: expected a file name inside the "
                                              rf"folder, got '{name}'"):
        export_checkpoint(bad, tmp_path / "exported" / "back")
    assert not (tmp_path / "exported").exists() and not (tmp_path / "escaped.safetensors").exists()


@pytest.mark.parametrize("edit, match", [
    (lambda m: m["params"]["embed_tokens.weight"].update(part="../../x"), r"params.embed_tokens.weight.part: expected "
                                                                          r"one of \['part_00000'"),
    (lambda m: m["parts"]["part_00000"]["files"].update({"../../etc/x": 1}), r"parts.part_00000.files '../../etc/x': "
                                                                              r"expected a file name inside the folder"),
    (lambda m: m["params"]["embed_tokens.weight"].update(shape="320x40"), r"params.embed_tokens.weight.shape: expected "
                                                                          r"a list of integers >= 0, got '320x40'"),
    (lambda m: m.update(params=[]), r"params: expected a JSON object, got a list of 0"),
    (lambda m: m["parts"]["part_00000"]["crc32"].popitem(), r"parts.part_00000.crc32 does not list the part's arrays"),
    (lambda m: m.update(version=1), r"version: expected 2 \(this converter's; convert the released checkpoint again\)"),
])
def test_manifest_of_wrong_types(converted, tmp_path, edit, match):
    bad = _manifest(converted, tmp_path, edit)
    with pytest.raises(CheckpointError, match=rf"{MANIFEST}: {match}"):
        CheckpointParams(bad)
