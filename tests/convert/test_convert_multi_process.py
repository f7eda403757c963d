"""Several processes converting together (``--process-index`` / ``--process-count``): each writes its own
parts into the shared ``<out>.partial``, process 0 finishes; the result equals a one-process conversion,
and a process that is missing makes the others fail with a message instead of waiting forever."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from convert import ConversionError, convert, read_params, write_synthetic
from convert.manifest import MANIFEST
from convert.partial import is_done
from convert.testing import k3_config, same_bytes

PART = 24 << 10  # about 8 parts


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    folder = tmp_path_factory.mktemp("k3") / "released"
    write_synthetic(folder, k3_config(), seed=5)
    return folder


@pytest.fixture(scope="module")
def reference(src, tmp_path_factory):
    return convert(src, tmp_path_factory.mktemp("one") / "out", quiet=True, part_bytes=PART)


def _assert_same_checkpoint(got, want):
    a, b = (json.loads((f / MANIFEST).read_text()) for f in (got, want))
    assert a["params"] == b["params"] and a["source"] == b["source"] and len(a["parts"]) >= 4
    for name, part in b["parts"].items():  # orbax's commit_success.txt holds a time stamp: only its name
        assert a["parts"][name]["crc32"] == part["crc32"] and a["parts"][name]["files"].keys() == part["files"].keys()
    got_params, want_params = read_params(got), read_params(want)
    assert got_params.keys() == want_params.keys()
    for name, value in want_params.items():
        leaves = (value.codes, value.scales) if hasattr(value, "codes") else (value,)
        other = (got_params[name].codes, got_params[name].scales) if hasattr(value, "codes") else (got_params[name],)
        assert all(same_bytes(x, y) for x, y in zip(other, leaves)), name


def test_two_processes_write_what_one_writes(src, reference, tmp_path):
    out = tmp_path / "out"
    cli = [sys.executable, "-m", "convert.cli", str(src), str(out), "--part-mb", str(PART / 2**20), "--quiet",
           "--process-count", "2", "--wait-minutes", "2", "--process-index"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    procs = [subprocess.Popen([*cli, str(i)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in (1, 0)]  # the helper first: it waits for the folder process 0 prepares
    try:
        (out1, err1), (out0, err0) = (p.communicate(timeout=120) for p in procs)
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], err0 + err1
    assert out1.startswith(f"wrote the parts of process 1 of 2 into {out}.partial; process 0 finishes {out}")
    assert out0.startswith(f"wrote {out}: ")
    _assert_same_checkpoint(out, reference)


def test_missing_process_fails_with_a_message_then_resume_finishes(src, reference, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(ConversionError, match=r"out\.partial: process 0 did not create it within 0 s"):
        convert(src, out, quiet=True, part_bytes=PART, process_index=1, process_count=2, wait_s=0.2)
    with pytest.raises(ConversionError, match=r"part\(s\) written by other processes are not complete \(none "
                                              r"completed for 0 s\), e.g. part_00001; rerun those processes"):
        convert(src, out, quiet=True, part_bytes=PART, process_index=0, process_count=2, wait_s=0.2)
    partial = tmp_path / "out.partial"
    count = len(json.loads((reference / MANIFEST).read_text())["parts"])
    assert [is_done(partial, i) for i in range(count)] == [i % 2 == 0 for i in range(count)]
    assert not out.exists() and not (partial / MANIFEST).exists()  # nothing looks complete
    assert convert(src, out, quiet=True, part_bytes=PART, process_index=1, process_count=2) == partial
    assert all(is_done(partial, i) for i in range(count)) and not out.exists()
    assert convert(src, out, quiet=True, part_bytes=PART, resume=True) == out  # one process finishes
    _assert_same_checkpoint(out, reference)


def test_process_index_outside_the_count(src, tmp_path):
    with pytest.raises(ValueError, match=r"process_index 2 / process_count 2: expected 0 <= process_index"):
        convert(src, tmp_path / "out", process_index=2, process_count=2)
