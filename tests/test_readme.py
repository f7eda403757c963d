"""Every snippet of README.md runs as written: the Python blocks in order in one namespace, and each `k3jax`
command of the bash blocks (but the setup block, which installs) through the command line's own entry."""

import re
import shlex
from pathlib import Path

import pytest

from k3jax.cli import main

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()
BLOCKS = re.findall(r"```(\w+)\n(.*?)```", README, flags=re.S)


def test_python_snippets_run_in_order():
    snippets = [code for lang, code in BLOCKS if lang == "python"]
    assert snippets
    namespace: dict = {}
    for code in snippets:
        exec(compile(code, "README.md", "exec"), namespace)
    assert namespace["logits"].shape == (1, 5, namespace["cfg"].vocab_size)
    assert len(namespace["out"].tokens[0]) == 8


def _commands() -> list[str]:
    shell = [code for lang, code in BLOCKS if lang == "bash" and "pip install" not in code]
    lines = [line.split("#")[0].strip() for code in shell for line in code.splitlines()]
    return [part.strip() for line in lines if line for part in line.split("&&")]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """One folder for the commands in turn (a later command reads what an earlier one wrote)."""
    return tmp_path_factory.mktemp("readme")


@pytest.mark.parametrize("command", _commands())
def test_command_snippets_run(command, workdir, monkeypatch):
    monkeypatch.chdir(workdir)
    argv = shlex.split(command)
    assert argv[0] == "k3jax", command
    assert main(argv[1:]) in (0, None), command
