"""Typed reads of the JSON files the project reads (config.json, the safetensors index and headers,
the k3jax manifest): every error names the file, the key path and what was expected.

    doc = Fields(parse_json(raw, "x/config.json", ConfigError), "x/config.json", ConfigError)
    layers = doc.int("num_hidden_layers", minimum=1)     # ConfigError: "x/config.json: num_hidden_layers:
                                                         #   expected an integer >= 1, got 'twenty'"
    lac = doc.fields("linear_attn_config", {})           # a nested object, its errors say "linear_attn_config.head_dim"

JSON ``null`` reads as an absent key. File names taken from a JSON file pass ``safe_name`` (a name
inside its folder, never a path) and, on read, ``inside`` (no link out of the folder).
Imports nothing of the project: ``k3jax.config`` and the converter (``convert``) both build on it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable, Iterator

REQUIRED: Any = object()  # the default of a getter whose key must be present
_SHOWN = 60  # characters of an offending value quoted in an error


def describe(value: Any) -> str:
    """A short description of a JSON value for an error: "an object of 3", "a list of 2", "null",
    or the value itself (cut to 60 characters)."""
    if isinstance(value, dict):
        return f"an object of {len(value)}"
    if isinstance(value, list):
        return f"a list of {len(value)}"
    text = "null" if value is None else repr(value)
    return text if len(text) <= _SHOWN else text[:_SHOWN] + "..."


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"key {key!r} appears twice")
        out[key] = value
    return out


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def parse_json(raw: bytes | str, source: str, error: type[Exception]) -> Any:
    """``raw`` as JSON; invalid text, NaN/Infinity, a key twice in one object or nesting too deep
    for Python raise ``error`` naming ``source``."""
    try:
        text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
        return json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
    except RecursionError:
        raise error(f"{source}: not valid JSON (nested too deep)") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise error(f"{source}: not valid JSON ({e})") from None


def read_json(path: Path, error: type[Exception]) -> Any:
    """The JSON file ``path``; a missing or unreadable file or bad JSON raise ``error`` naming it."""
    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        raise error(f"{path}: cannot read it ({e.strerror or e})") from None
    return parse_json(raw, str(path), error)


def safe_name(name: Any, source: str, key: str, error: type[Exception]) -> str:
    """``name`` (read from ``source`` at ``key``) if it is a plain file name: a non-empty string
    without path separators, NUL, ``.`` or ``..``; else ``error``."""
    if not isinstance(name, str) or not name or name in (".", "..") or any(c in name for c in "/\\\0"):
        raise error(f"{source}: {key}: expected a file name inside the folder, got {describe(name)}")
    return name


def inside(folder: Path, name: str, source: str, error: type[Exception]) -> Path:
    """``folder / name`` for a ``safe_name``, refusing a link that leaves ``folder``. One exception:
    the Hugging Face hub cache, where ``<repo>/snapshots/<rev>/<file>`` links to ``<repo>/blobs/``."""
    path = folder / name
    real, home = path.resolve(), folder.resolve()
    hub_blobs = (home.parent.parent / "blobs").resolve() if home.parent.name == "snapshots" else None
    if real.parent != home and real.parent != hub_blobs:
        raise error(f"{source}: {name!r} is a link to {real}, outside {folder}")
    return path


class Fields:
    """A JSON object with typed getters. ``source`` names the file, ``error`` is the exception
    raised, ``path`` the key path of this object inside the file ('' for the top level)."""

    def __init__(self, data: Any, source: str, error: type[Exception], path: str = ""):
        self.source, self.error, self.path = source, error, path
        if not isinstance(data, dict):
            raise error(f"{source}: {path or 'the top level'}: expected a JSON object, got {describe(data)}")
        self.data: dict[str, Any] = data

    def key(self, key: str) -> str:
        """The dotted key path of ``key`` in the file (for messages)."""
        return f"{self.path}.{key}" if self.path else key

    def fail(self, key: str, expected: str, value: Any = REQUIRED) -> Exception:
        """The error for ``key``: missing (no ``value``) or holding ``value`` instead of ``expected``."""
        got = "it is missing" if value is REQUIRED else f"got {describe(value)}"
        return self.error(f"{self.source}: {self.key(key)}: expected {expected}, {got}")

    def __contains__(self, key: str) -> bool:
        return self.data.get(key) is not None

    def __iter__(self) -> Iterator[str]:
        return iter(self.data)

    def _get(self, key: str, default: Any, expected: str, ok: Callable[[Any], bool]) -> Any:
        value = self.data.get(key)
        if value is None:
            if default is REQUIRED:
                raise self.fail(key, expected, None if key in self.data else REQUIRED)
            return default
        if not ok(value):
            raise self.fail(key, expected, value)
        return value

    def int(self, key: str, default: Any = REQUIRED, *, minimum: int | None = None) -> int:
        expected = "an integer" + (f" >= {minimum}" if minimum is not None else "")
        return self._get(key, default, expected, lambda v: _is_int(v) and (minimum is None or v >= minimum))

    def float(self, key: str, default: Any = REQUIRED) -> float:
        value = self._get(key, default, "a number", lambda v: (_is_int(v) or isinstance(v, float)) and math.isfinite(v))
        return value if value is None else float(value)

    def bool(self, key: str, default: Any = REQUIRED) -> bool:
        return self._get(key, default, "true or false", lambda v: isinstance(v, bool))

    def str(self, key: str, default: Any = REQUIRED, *, choices: tuple[str, ...] | None = None) -> str:
        expected = f"one of {list(choices)}" if choices else "a string"
        return self._get(key, default, expected, lambda v: isinstance(v, str) and (not choices or v in choices))

    def int_list(self, key: str, default: Any = REQUIRED, *, minimum: int | None = None) -> list[int]:
        expected = "a list of integers" + (f" >= {minimum}" if minimum is not None else "")
        return self._get(key, default, expected, lambda v: isinstance(v, list) and all(
            _is_int(x) and (minimum is None or x >= minimum) for x in v))

    def str_list(self, key: str, default: Any = REQUIRED) -> list[str]:
        return self._get(key, default, "a list of strings", lambda v: isinstance(v, list) and all(
            isinstance(x, str) for x in v))

    def list(self, key: str, default: Any = REQUIRED) -> list[Any]:
        return self._get(key, default, "a list", lambda v: isinstance(v, list))

    def fields(self, key: str, default: Any = REQUIRED) -> "Fields | None":
        """The nested object at ``key`` as ``Fields``; when absent, ``default`` as ``Fields`` (e.g.
        ``{}``) or None (``default=None``)."""
        value = self._get(key, default, "a JSON object", lambda v: isinstance(v, dict))
        return None if value is None else Fields(value, self.source, self.error, self.key(key))

    def str_map(self, key: str, default: Any = REQUIRED) -> dict[str, str]:
        """An object of string values at ``key`` (e.g. an index's weight_map, a header's metadata)."""
        return self._get(key, default, "a JSON object of strings", lambda v: isinstance(v, dict) and all(
            isinstance(x, str) for x in v.values()))

    def int_map(self, key: str, default: Any = REQUIRED, *, minimum: int | None = None) -> dict[str, int]:
        expected = "a JSON object of integers" + (f" >= {minimum}" if minimum is not None else "")
        return self._get(key, default, expected, lambda v: isinstance(v, dict) and all(
            _is_int(x) and (minimum is None or x >= minimum) for x in v.values()))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def relative_file(rel: Any, source: str, key: str, error: type[Exception]) -> str:
    """A '/'-separated path below a folder (e.g. a file inside an orbax part), each component a
    ``safe_name``; absolute paths and ``..`` raise ``error``."""
    if not isinstance(rel, str):
        raise error(f"{source}: {key}: expected a relative file path, got {describe(rel)}")
    for part in rel.split("/"):
        safe_name(part, source, f"{key} {rel!r}", error)
    return rel


__all__ = ["REQUIRED", "Fields", "describe", "inside", "parse_json", "read_json", "relative_file", "safe_name"]
