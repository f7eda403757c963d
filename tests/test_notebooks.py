"""The research notebooks run as shipped: each one's code cells in order, in a fresh namespace, on the
CPU. Every notebook asserts what it shows against a known value or an independent form (the E2M1 table,
decode-then-dot, the recurrent delta rule, the full forward, a uniform mix over the sources present), so a
change that breaks what a notebook says fails here."""

from __future__ import annotations

import json
import pathlib

import pytest

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


def test_notebooks_are_found():
    assert NOTEBOOKS, "no notebooks/*.ipynb beside tests/: the test below would run none"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path):
    cells = json.loads(path.read_text())["cells"]
    namespace = {"__name__": "__notebook__"}
    for i, cell in enumerate(cells):
        if cell["cell_type"] == "code":
            exec(compile("".join(cell["source"]), f"{path.name}, cell {i}", "exec"), namespace)
