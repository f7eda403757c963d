"""The memory estimate's arguments: positive integers, each error naming its argument, in Python and on the command
line (one line on stderr, no traceback, from the installed entry as well)."""

import subprocess
import sys
from pathlib import Path

import pytest

from k3jax.cli import main
from k3jax.memory import estimate, report
from k3jax.presets import preset

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "kwargs, error, name",
    [
        ({"context": -1}, ValueError, "context"),
        ({"context": 0}, ValueError, "context"),
        ({"batch": 0}, ValueError, "batch"),
        ({"cache_bytes": 0}, ValueError, "cache_bytes"),
        ({"context": 1.5}, TypeError, "context"),
        ({"batch": True}, TypeError, "batch"),
        ({"context": "4096"}, TypeError, "context"),
    ],
)
def test_estimate_refuses_bad_arguments(kwargs, error, name):
    args = {"context": 4096, "batch": 1, **kwargs}
    with pytest.raises(error, match=rf"^{name}: .*got {args[name]!r}"):
        estimate(preset("tiny"), **args)


def test_numpy_integers_are_integers():
    import numpy as np

    assert estimate(preset("tiny"), np.int64(4096), np.int32(2)) == estimate(preset("tiny"), 4096, 2)
    assert "context 4,096 tokens, batch 2" in report(preset("tiny"), np.int64(4096), np.int32(2))


@pytest.mark.parametrize("argv, flag", [(["--context", "-1", "--batch", "0"], "--context"),
                                        (["--batch", "0"], "--batch")])
def test_cli_refuses_bad_sizes_on_one_line(capsys, argv, flag):
    assert main(["memory", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"k3jax memory: error: {flag}: must be >= 1") and err.count("\n") == 1, err


def test_the_installed_entry_prints_no_traceback():
    """The issue's command in a process of its own: status 2, one line on stderr, nothing on stdout."""
    run = subprocess.run([sys.executable, "-m", "k3jax.cli", "memory", "--context", "-1", "--batch", "0"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 2, run.stderr
    assert run.stderr == "k3jax memory: error: --context: must be >= 1, got -1 (see k3jax memory --help)\n"
    assert run.stdout == ""
