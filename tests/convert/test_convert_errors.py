"""Bad input and interrupted runs: clear errors naming file/tensor/expectation; nothing that looks complete."""

from __future__ import annotations

import errno
import importlib
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from convert import CheckpointError, ConversionError, convert, read_params, write_synthetic
from convert.manifest import MANIFEST, PARTS
from convert.safetensors_io import INDEX_FILE, open_checkpoint
from convert.testing import copy_folder, edit_tensors, k3_config, linear_config, same_bytes

partial_module = importlib.import_module("convert.partial")
integrity = importlib.import_module("convert.integrity")
PART = 16 << 10  # small parts: many of them, so interruptions land midway


@pytest.fixture(scope="module")
def linear_src(tmp_path_factory):
    folder = tmp_path_factory.mktemp("linear") / "released"
    write_synthetic(folder, linear_config(), seed=7)
    return folder


@pytest.fixture(scope="module")
def k3_src(tmp_path_factory):
    folder = tmp_path_factory.mktemp("k3") / "released"
    write_synthetic(folder, k3_config(), seed=8)
    return folder


@pytest.fixture(scope="module")
def reference(linear_src, tmp_path_factory):
    """Parameters of a clean, uninterrupted conversion."""
    return read_params(convert(linear_src, tmp_path_factory.mktemp("ref") / "out", quiet=True, part_bytes=PART))


def _nothing_written(out):
    assert not out.exists() and not out.with_name(out.name + ".partial").exists()


def _convert_fails(src, tmp_path, match, **kw):
    out = tmp_path / "out"
    with pytest.raises(CheckpointError, match=match):
        convert(src, out, quiet=True, **kw)
    _nothing_written(out)


def _shard_of(folder, name):
    return next(i for i, s in enumerate(open_checkpoint(folder).shards) if any(t.name == name for t in s.tensors))


Q = "model.layers.1.self_attn.q_proj.weight"


def test_missing_tensor(linear_src, tmp_path):
    src = copy_folder(linear_src, tmp_path / "src")
    edit_tensors(src, lambda t: {n: a for n, a in t.items() if n != Q}, shard=_shard_of(src, Q))
    _convert_fails(src, tmp_path, rf"1 tensor\(s\) required by config.json .* {Q}")


def test_unknown_tensor_errors_or_is_skipped_on_request(linear_src, tmp_path):
    src = copy_folder(linear_src, tmp_path / "src")
    edit_tensors(src, lambda t: {**t, "model.layers.1.mystery.weight": np.ones((2, 3), np.float32)})
    _convert_fails(src, tmp_path, r"model-00001-of-.*: 1 tensor\(s\) have no k3jax parameter.*mystery.*--allow-unknown")
    with pytest.warns(UserWarning, match="mystery"):
        out = convert(src, tmp_path / "out", quiet=True, allow_unknown=True)
    assert json.loads((out / MANIFEST).read_text())["source"]["unknown"] == ["model.layers.1.mystery.weight"]


def test_vision_tensors_are_skipped(k3_src, tmp_path):
    src = copy_folder(k3_src, tmp_path / "src")
    edit_tensors(src, lambda t: {**t, "vision_tower.patch_embed.weight": np.ones((4, 4), np.float32)})
    out = convert(src, tmp_path / "out", quiet=True)
    assert json.loads((out / MANIFEST).read_text())["source"]["skipped"] == ["vision_tower.patch_embed.weight"]


def test_wrong_shape(linear_src, tmp_path):
    src = copy_folder(linear_src, tmp_path / "src")
    edit_tensors(src, lambda t: {**t, Q: t[Q][:-1]}, shard=_shard_of(src, Q))
    _convert_fails(src, tmp_path, rf"model-0000.*tensor '{Q}' is BF16 \[15, 40\]; expected BF16 \[16, 40\]")


def test_wrong_dtype(linear_src, tmp_path):
    src = copy_folder(linear_src, tmp_path / "src")
    edit_tensors(src, lambda t: {**t, Q: t[Q].astype(np.int32)}, shard=_shard_of(src, Q))
    _convert_fails(src, tmp_path, rf"tensor '{Q}' is I32 \[16, 40\]; expected BF16, F16 or F32 \[16, 40\]")


def test_truncated_shard(linear_src, tmp_path):
    src = copy_folder(linear_src, tmp_path / "src")
    shard = src / open_checkpoint(src).shards[1].file
    shard.write_bytes(shard.read_bytes()[:-100])
    _convert_fails(src, tmp_path, rf"{shard.name}: truncated: the header says the data ends at byte")


def test_corrupt_header(linear_src, tmp_path):
    src = copy_folder(linear_src, tmp_path / "src")
    shard = src / open_checkpoint(src).shards[0].file
    raw = bytearray(shard.read_bytes())
    raw[8:20] = b"\x00garbage{{{["
    shard.write_bytes(bytes(raw))
    _convert_fails(src, tmp_path, rf"{shard.name}: corrupt header: not valid JSON")
    raw[:8] = (1 << 40).to_bytes(8, "little")
    shard.write_bytes(bytes(raw))
    _convert_fails(src, tmp_path, rf"{shard.name}: corrupt header: length prefix says")


def test_index_names_missing_shard(linear_src, tmp_path):
    src = copy_folder(linear_src, tmp_path / "src")
    victim = open_checkpoint(src).shards[2].file
    (src / victim).unlink()
    _convert_fails(src, tmp_path, rf"{INDEX_FILE}: lists shard '{victim}' but .* does not exist")


def test_config_does_not_match_tensors(linear_src, k3_src, tmp_path):
    src = copy_folder(linear_src, tmp_path / "src")
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "hidden_size": 48}))
    _convert_fails(src, tmp_path, r"tensor 'model.embed_tokens.weight' is BF16 \[320, 40\]; expected BF16 \[320, 48\]")
    (src / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 4, "linear_attn_config": {
        **cfg["linear_attn_config"], "full_attn_layers": [3, 4], "kda_layers": [1, 2]}}))
    _convert_fails(src, tmp_path, r"required by config.json \(4 layers\) are in no shard, e.g. model.layers.3")
    k3 = copy_folder(k3_src, tmp_path / "k3")
    cfg = json.loads((k3 / "config.json").read_text())
    del cfg["text_config"]["quantization_config"]
    (k3 / "config.json").write_text(json.dumps(cfg))
    _convert_fails(k3, tmp_path, r"config.json: says bf16 routed experts .*weight_packed'; the config does not match")


def _fail_on_call(n, exc):
    calls = {"n": 0}
    real = partial_module.write_part

    def write(directory, leaves):
        calls["n"] += 1
        if calls["n"] == n:
            raise exc
        return real(directory, leaves)

    return write


def _assert_resumes_to(src, out, reference, failed):
    """Parts before ``failed`` are complete, ``failed`` is not (a later one may be: one write overlaps)."""
    partial = out.with_name(out.name + ".partial")
    assert partial.is_dir() and not (partial / MANIFEST).exists() and not out.exists()
    with pytest.raises(ConversionError, match=r"interrupted conversion; pass --resume"):
        convert(src, out, quiet=True, part_bytes=PART)
    done = {p.name for p in (partial / PARTS).iterdir() if (p / "_CHECKPOINT_METADATA").is_file()}
    assert {f"part_{i:05d}" for i in range(failed)} <= done and f"part_{failed:05d}" not in done, done
    convert(src, out, quiet=True, part_bytes=PART, resume=True, verify=True)
    assert not partial.exists()
    got = read_params(out)
    assert got.keys() == reference.keys() and all(same_bytes(got[k], reference[k]) for k in got)


def test_disk_full_midway_then_resume(linear_src, reference, tmp_path, monkeypatch):
    out = tmp_path / "out"
    monkeypatch.setattr(partial_module, "write_part", _fail_on_call(3, OSError(errno.ENOSPC, "No space left on device")))
    with pytest.raises(ConversionError, match=r"part_00002: writing failed .*No space left.*rerun with --resume"):
        convert(linear_src, out, quiet=True, part_bytes=PART)
    monkeypatch.undo()
    _assert_resumes_to(linear_src, out, reference, failed=2)


def test_interrupt_then_resume(linear_src, reference, tmp_path, monkeypatch):
    out = tmp_path / "out"
    monkeypatch.setattr(partial_module, "write_part", _fail_on_call(5, KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        convert(linear_src, out, quiet=True, part_bytes=PART)
    monkeypatch.undo()
    _assert_resumes_to(linear_src, out, reference, failed=4)


def test_resume_after_kill(linear_src, reference, tmp_path):
    out = tmp_path / "out"
    script = textwrap.dedent(f"""
        import importlib, os
        partial = importlib.import_module("convert.partial")
        real, calls = partial.write_part, []
        def write(d, leaves):
            calls.append(d)
            if len(calls) == 4:
                os.kill(os.getpid(), 9)
            real(d, leaves)
        partial.write_part = write
        importlib.import_module("convert.conversion").convert({str(linear_src)!r}, {str(out)!r}, quiet=True, part_bytes={PART})
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=300)
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    _assert_resumes_to(linear_src, out, reference, failed=3)


def test_resume_refuses_a_different_source(linear_src, k3_src, tmp_path, monkeypatch):
    out = tmp_path / "out"
    monkeypatch.setattr(partial_module, "write_part", _fail_on_call(2, OSError(errno.EIO, "I/O error")))
    with pytest.raises(ConversionError):
        convert(linear_src, out, quiet=True, part_bytes=PART)
    monkeypatch.undo()
    with pytest.raises(ConversionError, match=r"made from a different source"):
        convert(k3_src, out, quiet=True, part_bytes=PART, resume=True)


def test_verify_catches_corrupt_output_and_resume_rewrites_the_part(linear_src, reference, tmp_path, monkeypatch):
    out = tmp_path / "out"
    real = integrity.read_part

    def corrupt(directory):
        leaves = real(directory)
        key = sorted(leaves)[0]
        leaves[key] = np.asarray(leaves[key]).copy()
        leaves[key].reshape(-1).view(np.uint8)[0] ^= 1
        return leaves

    monkeypatch.setattr(integrity, "read_part", corrupt)
    with pytest.raises(ConversionError, match=r"part_00000: .* differs from .* on re-read; .*part_00000 was removed, "
                                              r"rerun with --resume"):
        convert(linear_src, out, quiet=True, part_bytes=PART, verify=True)
    monkeypatch.undo()
    assert not out.exists()
    convert(linear_src, out, quiet=True, part_bytes=PART, verify=True, resume=True)
    got = read_params(out)
    assert all(same_bytes(got[k], reference[k]) for k in reference)


def test_existing_output_is_not_overwritten(linear_src, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(ConversionError, match="already exists"):
        convert(linear_src, out, quiet=True)
    assert not os.listdir(out)
