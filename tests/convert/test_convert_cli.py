"""``k3jax convert`` as a finished tool: progress in fitting units, a summary line of what was
written or verified, and every user error on one line (exit status 2 for the command line, 1 for
the checkpoint), never a traceback."""

from __future__ import annotations

import pytest

from convert.cli import build_parser, main


def _run(capsys, *args):
    """(exit status, stdout, stderr) of ``k3jax convert args``, parsed as the command line would be."""
    try:
        status = main(build_parser().parse_args([str(a) for a in args]))
    except SystemExit as stop:  # argparse refused a flag
        status = stop.code
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return status, out, err


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cli") / "released"
    assert main(build_parser().parse_args(["--synthetic", "tiny_linear", str(folder), "--quiet"])) == 0
    return folder


def test_progress_in_fitting_units_and_a_summary_line(released, tmp_path, capsys):
    status, out, err = _run(capsys, released, tmp_path / "k3jax", "--verify")
    assert status == 0
    assert "KB / " in err and " GB" not in err, err
    assert out.count("\n") == 1 and out.startswith(f"wrote {tmp_path / 'k3jax'}: ")
    assert "(BF16, F32, as stored)" in out and "verified bit for bit against the source" in out
    status, out, _ = _run(capsys, "--check", tmp_path / "k3jax", "--quiet")
    assert status == 0 and out.startswith(f"verified {tmp_path / 'k3jax'}: ") and "every CRC-32 matches" in out
    status, out, _ = _run(capsys, "--export", tmp_path / "k3jax", tmp_path / "back", "--quiet")
    assert status == 0 and out.startswith(f"wrote {tmp_path / 'back'}: ") and "safetensors file(s)" in out


def test_synthetic_and_dtype_summary(tmp_path, capsys):
    status, out, _ = _run(capsys, "--synthetic", "tiny_linear", tmp_path / "f32", "--dtype", "f32", "--quiet")
    assert status == 0 and "synthetic tiny_linear checkpoint" in out
    status, out, _ = _run(capsys, tmp_path / "f32", tmp_path / "bf16", "--dtype", "bf16", "--quiet")
    assert status == 0 and "(BF16, F32, cast to bf16)" in out


@pytest.mark.parametrize("args, message", [
    (["--export", "A", "B", "--resume"], "--resume does not apply to --export"),
    (["--check", "A", "B"], "--check takes one folder, CKPT"),
    (["A"], "OUT: missing; give the output folder"),
    (["--synthetic", "huge", "B"], "--synthetic huge: unknown preset"),
    (["A", "B", "--seed", "3"], "--seed does not apply to a conversion"),
    (["A", "B", "--part-mb", "-3"], "argument --part-mb: expected a positive number of MB, got '-3'"),
    (["A", "B", "--dtype", "f8"], "argument --dtype: invalid choice: 'f8'"),
])
def test_command_line_mistakes_exit_2_on_one_line(capsys, args, message):
    status, out, err = _run(capsys, *args)
    assert status == 2 and out == "" and err.count("\n") == 1 and message in err, err


def test_checkpoint_mistakes_exit_1_on_one_line(released, tmp_path, capsys):
    for args, message in (
        ([tmp_path / "nowhere", tmp_path / "out"], "nowhere: not a folder"),
        ([released, released], "already exists"),
        (["--check", released], "k3jax_checkpoint.json: missing"),
        (["--export", released, tmp_path / "back"], "k3jax_checkpoint.json: missing"),
    ):
        status, out, err = _run(capsys, *args, "--quiet")
        assert status == 1 and out == "" and err.count("\n") == 1 and message in err, err


@pytest.mark.parametrize("args, message", [
    (["A", "B", "--process-index", "1"], "--process-index and --process-count go together"),
    (["A", "B", "--process-index", "2", "--process-count", "2"], "--process-index 2: expected 0 <= K < --process-count"),
    (["A", "B", "--wait-minutes", "5"], "--wait-minutes applies only with --process-count"),
    (["--export", "A", "B", "--process-index", "0", "--process-count", "2"], "--process-count does not apply to --export"),
])
def test_process_flags_mistakes_exit_2(capsys, args, message):
    status, out, err = _run(capsys, *args)
    assert status == 2 and out == "" and err.count("\n") == 1 and message in err, err
