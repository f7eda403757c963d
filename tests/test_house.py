"""The house rules, checked on the source text (pure Python: ``ast`` and ``re``, no JAX):

- the layers choose no kernel themselves: ``k3jax/layers`` names no implementation switch, no Triton
  kernel module and no interpret flag (the op entries of ``pallas_kernels.<op>.ops`` do that);
- the layers import at module level only;
- no module of ``k3jax`` or ``pallas_kernels`` imports a private name (``_x``) of another package (the
  shared modules ``pallas_kernels._platform``, ``_triton``, ``_mosaic_gpu`` and ``_autodiff`` are private to
  ``pallas_kernels`` as a whole: every op folder imports them);
- the modules of ``pallas_kernels`` import one another without a cycle;
- the code, the converter and the README speak of no "session".
"""

from __future__ import annotations

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
OURS = ("k3jax", "pallas_kernels", "convert")  # the top-level packages of this repository
SHARED = {"pallas_kernels._platform", "pallas_kernels._triton", "pallas_kernels._mosaic_gpu",
          "pallas_kernels._autodiff"}
LAYER_WORDS = ("get_implementation", "triton_kernels", "pallas_interpret")


def _sources(folder: str) -> list[pathlib.Path]:
    return sorted(p for p in (ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts)


def _module(path: pathlib.Path) -> str:
    """pallas_kernels/moe/ops.py -> pallas_kernels.moe.ops; pallas_kernels/moe/__init__.py -> pallas_kernels.moe."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _package(path: pathlib.Path) -> str:
    """The package a source file belongs to (an __init__.py: its own)."""
    module = _module(path)
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def _is_package(dotted: str) -> bool:
    return (ROOT / dotted.replace(".", "/") / "__init__.py").is_file()


def _is_module(dotted: str) -> bool:
    return _is_package(dotted) or (ROOT / (dotted.replace(".", "/") + ".py")).is_file()


def _absolute(node: ast.ImportFrom, path: pathlib.Path) -> str:
    """An ImportFrom's module, relative imports resolved against the file's package."""
    if not node.level:
        return node.module or ""
    base = _package(path).split(".")
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imported(tree: ast.AST, path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, dotted target) of every import in the file: a module, or a module's name as ``module.name``."""
    targets = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = _absolute(node, path)
            targets += [(node.lineno, f"{module}.{alias.name}") for alias in node.names if alias.name != "*"]
    return targets


def _private_owner(target: str) -> str | None:
    """The package whose private module or name ``target`` reaches (None: nothing private, or a shared module):
    the package holding the first private component's module."""
    parts = target.split(".")
    if parts[0] not in OURS:
        return None
    for i, part in enumerate(parts[1:], start=1):
        prefix = ".".join(parts[: i + 1])
        if part.startswith("_") and not part.startswith("__") and prefix not in SHARED:
            holder = ".".join(parts[:i])
            return holder if _is_package(holder) else holder.rpartition(".")[0]
    return None


def _parsed(folder: str) -> list[tuple[pathlib.Path, ast.AST]]:
    return [(path, ast.parse(path.read_text(), filename=str(path))) for path in _sources(folder)]


def test_layers_choose_no_kernel():
    found = [f"{path.relative_to(ROOT)}: {word}" for path in sorted((ROOT / "k3jax/layers").glob("*.py"))
             for word in LAYER_WORDS if word in path.read_text()]
    assert not found, "\n".join(found)


def test_layers_import_at_module_level_only():
    found = []
    for path, tree in _parsed("k3jax/layers"):
        for function in ast.walk(tree):
            if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found += [f"{path.relative_to(ROOT)}:{node.lineno} in {function.name}" for node in ast.walk(function)
                          if isinstance(node, (ast.Import, ast.ImportFrom))]
    assert not found, "\n".join(sorted(set(found)))


def test_no_private_name_from_another_package():
    found = []
    for folder in ("k3jax", "pallas_kernels"):
        for path, tree in _parsed(folder):
            package = _package(path)
            for line, target in _imported(tree, path):
                owner = _private_owner(target)
                if owner is not None and owner != package:
                    found.append(f"{path.relative_to(ROOT)}:{line} imports {target} (private to {owner})")
    assert not found, "\n".join(found)


def _pallas_kernels_imports() -> dict[str, set[str]]:
    """Each pallas_kernels module -> the pallas_kernels modules it imports: a name's module, or the module
    named (``from pallas_kernels.moe import ops`` -> pallas_kernels.moe.ops). The packages above an imported
    module are not counted (a package's __init__ importing its own modules is no cycle)."""
    graph = {}
    for path, tree in _parsed("pallas_kernels"):
        edges = set()
        for _, target in _imported(tree, path):
            if target.split(".")[0] != "pallas_kernels":
                continue
            module = target if _is_module(target) else target.rpartition(".")[0]
            assert _is_module(module), f"{path.relative_to(ROOT)} imports {target}: no such module"
            edges.add(module)
        module = _module(path)
        edges.discard(module)
        graph[module] = edges
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of ``graph`` as its modules in order (the first again at the end), or None (depth-first search)."""
    state, stack = {}, []  # state: 1 on the current path, 2 done

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_private_owner_names_the_package():
    assert _private_owner("pallas_kernels.kda.ops._gate_params") == "pallas_kernels.kda"
    assert _private_owner("k3jax.implementation._CURRENT") == "k3jax"
    assert _private_owner("pallas_kernels._triton._private") == "pallas_kernels"
    for public in ("pallas_kernels._platform", "pallas_kernels._triton.triton_params", "pallas_kernels.kda.ops.gated_kda",
                   "jax._src.config"):
        assert _private_owner(public) is None, public


def test_cycle_finder_finds_cycles():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_pallas_kernels_imports_are_acyclic():
    graph = _pallas_kernels_imports()
    assert "pallas_kernels.moe.ops" in graph and "pallas_kernels.moe.triton_split" in graph["pallas_kernels.moe.ops"]
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_no_session_in_code_converter_or_readme():
    word = re.compile(r"\bsession", re.IGNORECASE)
    paths = [ROOT / "README.md"] + [p for folder in ("k3jax", "pallas_kernels", "convert")
                                    for p in sorted((ROOT / folder).rglob("*"))
                                    if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"]
    found = []
    for path in paths:
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), start=1):
            if word.search(line):
                found.append(f"{path.relative_to(ROOT)}:{number}")
    assert not found, "\n".join(found)
