"""Faults of the machine and of the data found midway: a full disk, an output that cannot be
created, a bad scale byte, an interrupt. Each ends in one line naming the path and the cause, and
what is left behind is either resumable (and said so) or removed (and said so)."""

from __future__ import annotations

import errno
import importlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from convert import CheckpointError, ConversionError, convert, export_checkpoint, read_params, write_synthetic
from convert.cli import build_parser, main
from convert.manifest import PARTS
from convert.partial import PLAN_FILE
from convert.safetensors_io import open_checkpoint, read_tensor
from convert.testing import edit_tensors, k3_config, linear_config, same_bytes

REPO = Path(__file__).resolve().parents[2]
EMBED = "model.embed_tokens.weight"
partial_module = importlib.import_module("convert.partial")
export_module = importlib.import_module("convert.export")


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    """A Kimi-Linear checkpoint whose largest tensor (the embedding, 25.6 KB) is moved to the last
    shard, so that a file-size limit of 20 KB lets the first parts through; and its params."""
    folder = tmp_path_factory.mktemp("faults") / "released"
    _, params = write_synthetic(folder, linear_config(), seed=9)
    embed = np.array(read_tensor(open_checkpoint(folder).tensors[EMBED]))
    edit_tensors(folder, lambda t: {n: a for n, a in t.items() if n != EMBED}, shard=0)
    edit_tensors(folder, lambda t: {**t, EMBED: embed}, shard=len(open_checkpoint(folder).shards) - 1)
    return folder, params


def _cli(*args: str) -> int:
    return main(build_parser().parse_args([str(a) for a in args]))


def test_full_disk_then_resume(released, tmp_path, capsys):
    folder, params = released
    out = tmp_path / "out"
    limited = textwrap.dedent(f"""
        import resource, runpy, signal, sys
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as on a full disk
        resource.setrlimit(resource.RLIMIT_FSIZE, (20000, 20000))
        sys.argv = ["convert", {str(folder)!r}, {str(out)!r}, "--part-mb", "0.016", "--quiet"]
        runpy.run_module("convert.cli", run_name="__main__")
    """)
    proc = subprocess.run([sys.executable, "-c", limited], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 1 and proc.stdout == "", proc.stderr[-3000:]
    assert len(proc.stderr.splitlines()) == 1, proc.stderr[-3000:]
    assert "writing failed (File too large)" in proc.stderr and "out.partial is kept" in proc.stderr
    assert "rerun with --resume" in proc.stderr
    done = [p for p in (tmp_path / "out.partial" / PARTS).iterdir() if (p / "_CHECKPOINT_METADATA").is_file()]
    assert done, "the parts written before the disk filled are kept"
    assert _cli(folder, out, "--part-mb", "0.016", "--quiet", "--resume", "--verify") == 0
    assert "verified bit for bit against the source" in capsys.readouterr().out
    got = read_params(out)
    assert got.keys() == params.keys() and all(same_bytes(got[k], params[k]) for k in params)


def test_output_that_cannot_be_created(released, tmp_path, capsys):
    folder, _ = released
    (tmp_path / "a_file").write_text("")
    with pytest.raises(ConversionError, match=r"a_file/out.partial: cannot create it \(Not a directory\); "
                                              r"nothing was written"):
        convert(folder, tmp_path / "a_file" / "out", quiet=True)
    assert _cli(folder, tmp_path / "a_file" / "out", "--quiet") == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot create it (Not a directory)" in err


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write to a read-only folder")
def test_output_folder_without_write_permission(released, tmp_path):
    folder, _ = released
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(ConversionError, match=r"cannot create it \(Permission denied\); nothing was written"):
        convert(folder, locked / "out", quiet=True)


def test_bad_scale_byte_midway_removes_the_partial_folder(tmp_path):
    src = tmp_path / "k3"
    write_synthetic(src, k3_config(), seed=4)
    name = "language_model.model.layers.4.block_sparse_moe.experts.5.w1.weight_scale"
    shard = next(i for i, s in enumerate(open_checkpoint(src).shards) if any(t.name == name for t in s.tensors))

    def nan_byte(tensors):
        tensors[name] = tensors[name].copy()
        tensors[name][3, 1] = 255
        return tensors

    edit_tensors(src, nan_byte, shard=shard)
    out = tmp_path / "out"
    for _ in range(2):  # the second run meets the same error, not a leftover "interrupted conversion"
        with pytest.raises(CheckpointError, match=rf"{name}: E8M0 scale byte 255 is NaN .* first at index \(3, 1\).*; "
                                                  rf".*out.partial was removed \(nothing is kept"):
            convert(src, out, quiet=True, part_bytes=16 << 10)
        assert not out.exists() and not (tmp_path / "out.partial").exists()


def test_partial_folder_not_made_by_a_conversion(released, tmp_path):
    folder, _ = released
    (tmp_path / "out.partial" / PARTS).mkdir(parents=True)
    with pytest.raises(ConversionError, match=rf"{PLAN_FILE}: cannot read it .*; .*out.partial cannot be resumed: "
                                              r"delete it to start over"):
        convert(folder, tmp_path / "out", quiet=True, resume=True)


def test_interrupt_keeps_a_resumable_folder_and_says_so(released, tmp_path, monkeypatch, capsys):
    folder, params = released
    out = tmp_path / "out"
    real, calls = partial_module.write_part, []

    def interrupted(directory, leaves):
        calls.append(directory)
        if len(calls) == 3:
            raise KeyboardInterrupt
        real(directory, leaves)

    monkeypatch.setattr(partial_module, "write_part", interrupted)
    assert _cli(folder, out, "--part-mb", "0.016", "--quiet") == 130
    assert "interrupted; " in capsys.readouterr().err and (tmp_path / "out.partial").is_dir()
    monkeypatch.undo()
    assert _cli(folder, out, "--part-mb", "0.016", "--quiet", "--resume") == 0
    got = read_params(out)
    assert all(same_bytes(got[k], params[k]) for k in params)


def test_export_that_fails_writing_removes_its_folder(released, tmp_path, monkeypatch):
    folder, _ = released
    ckpt = convert(folder, tmp_path / "ckpt", quiet=True)

    def full(path, *args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(export_module, "write_safetensors", full)
    with pytest.raises(ConversionError, match=r"\.safetensors: writing failed \(No space left on device\); "
                                              r".*back.partial was removed, nothing was exported"):
        export_checkpoint(ckpt, tmp_path / "back")
    assert not (tmp_path / "back").exists() and not (tmp_path / "back.partial").exists()
