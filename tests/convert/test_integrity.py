"""A damaged converted checkpoint: structure faults are found on every load, a flipped bit by the
CRC-32 check (``verify=True``, ``k3jax convert --check``); each as one ``CheckpointError`` naming
the part or file."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from convert import CheckpointError, convert, export_checkpoint, verify_checkpoint, write_synthetic
from convert.cli import build_parser, main
from convert.integrity import CheckpointParams
from convert.manifest import MANIFEST, PARTS
from convert.testing import copy_folder, linear_config
from k3jax.checkpoint import load
from k3jax.cli import main as k3jax_main

CHUNK = "layers.1.block_sparse_moe.experts.w1/0.0.0"  # an array's data file inside its part


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    folder = tmp_path_factory.mktemp("integrity") / "released"
    write_synthetic(folder, linear_config(), seed=13)
    return convert(folder, tmp_path_factory.mktemp("integrity_out") / "k3jax", quiet=True, part_bytes=32 << 10)


def _part_of(ckpt, rel):
    return next(p for p in sorted((ckpt / PARTS).iterdir()) if (p / rel).is_file())


def _check(ckpt, capsys):
    status = main(build_parser().parse_args(["--check", str(ckpt), "--quiet"]))
    out, err = capsys.readouterr()
    return status, out, err


def test_clean_checkpoint_verifies(converted, capsys):
    v = verify_checkpoint(converted)
    assert v.parts == len(list((converted / PARTS).iterdir())) and v.arrays == len(CheckpointParams(converted))
    status, out, err = _check(converted, capsys)
    assert status == 0 and err == "" and out.startswith(f"verified {converted}: ") and "every CRC-32 matches" in out


def test_part_folder_deleted(converted, tmp_path):
    bad = copy_folder(converted, tmp_path / "ckpt")
    shutil.rmtree(bad / PARTS / "part_00002")
    with pytest.raises(CheckpointError, match=r"parts/part_00002: missing; the manifest lists this part"):
        load(bad)


def test_manifest_cut_short(converted, tmp_path):
    bad = copy_folder(converted, tmp_path / "ckpt")
    text = (bad / MANIFEST).read_bytes()
    (bad / MANIFEST).write_bytes(text[: len(text) // 2])
    with pytest.raises(CheckpointError, match=rf"{MANIFEST}: not valid JSON"):
        load(bad)


def test_array_file_truncated(converted, tmp_path):
    bad = copy_folder(converted, tmp_path / "ckpt")
    part = _part_of(bad, CHUNK)
    data = (part / CHUNK).read_bytes()
    (part / CHUNK).write_bytes(data[:-7])
    with pytest.raises(CheckpointError, match=rf"{part.name}/{CHUNK}: {len(data) - 7} bytes but the manifest says "
                                              rf"{len(data)} \(truncated or replaced\); the checkpoint is damaged"):
        load(bad)


def test_array_file_deleted(converted, tmp_path):
    bad = copy_folder(converted, tmp_path / "ckpt")
    part = _part_of(bad, CHUNK)
    (part / CHUNK).unlink()
    with pytest.raises(CheckpointError, match=rf"{part.name}: 1 file\(s\) of this part are missing, e.g. {CHUNK}"):
        CheckpointParams(bad)[CHUNK.split("/")[0]]


def test_orbax_metadata_garbled(converted, tmp_path):
    bad = copy_folder(converted, tmp_path / "ckpt")
    part = bad / PARTS / "part_00001"
    (part / "_METADATA").write_bytes(b"#" * (part / "_METADATA").stat().st_size)
    with pytest.raises(CheckpointError, match=r"part_00001: orbax cannot restore this part \("):
        dict(CheckpointParams(bad))


def test_flipped_bit_is_caught_by_verification(converted, tmp_path, capsys):
    bad = copy_folder(converted, tmp_path / "ckpt")
    part = _part_of(bad, CHUNK)
    data = bytearray((part / CHUNK).read_bytes())
    data[1234] ^= 0x10
    (part / CHUNK).write_bytes(bytes(data))
    loaded = load(bad)  # structure only: the same sizes, so this loads
    w1 = np.asarray(loaded.layers[1].block_sparse_moe.experts.w1.get_value())
    assert w1.shape == (5, 24, 40)
    match = rf"{part.name}: array layers.1.block_sparse_moe.experts.w1 fails its CRC-32 check \(read [0-9a-f]{{8}}, "
    with pytest.raises(CheckpointError, match=match):
        load(bad, verify=True)
    status, out, err = _check(bad, capsys)
    assert status == 1 and out == "" and err.count("\n") == 1 and "fails its CRC-32 check" in err
    with pytest.raises(CheckpointError, match=r"fails its CRC-32 check .*; .*back.partial was removed, nothing was "
                                              r"exported"):
        export_checkpoint(bad, tmp_path / "back")
    assert not (tmp_path / "back").exists() and not (tmp_path / "back.partial").exists()
    assert k3jax_main(["generate", "--model", str(bad), "--max-tokens", "1"]) == 1  # the command line verifies
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "fails its CRC-32 check" in err
