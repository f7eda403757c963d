"""Argument checks shared by the public entries: ``Generator``, ``K3Model.__call__``, ``Sampling``, ``memory`` and the
command line.

Each check names the argument, the offending value (and where it sits) and what was expected; it raises
``TypeError`` for a value of the wrong kind (a float or a bool for a token id) and ``ValueError`` for one of the
right kind out of range (an id past the vocabulary, an empty prompt). Checks run on the host and stay cheap: host
data (Python numbers, lists, NumPy arrays) is checked value by value; a JAX array by shape and dtype, and by value
only where the caller allows a read from the device (``read_device``), never while it is traced.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import jax
import numpy as np


def integer(name: str, value: Any, minimum: int | None = None, maximum: int | None = None) -> int:
    """A Python or NumPy integer (not a bool) in [minimum, maximum] -> int."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected an integer, got {value!r} ({type(value).__name__})")
    _in_range(name, int(value), minimum, maximum)
    return int(value)


def real(name: str, value: Any, minimum: float | None = None, maximum: float | None = None, *,
         above: float | None = None) -> float:
    """A finite Python or NumPy real number (not a bool) in [minimum, maximum] and > above -> float."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected a number, got {value!r} ({type(value).__name__})")
    if not math.isfinite(value):
        raise ValueError(f"{name}: must be a finite number, got {value!r}")
    _in_range(name, float(value), minimum, maximum, above)
    return float(value)


def _in_range(name: str, value: float, minimum=None, maximum=None, above=None) -> None:
    low = f"> {above}" if above is not None else None if minimum is None else f">= {minimum}"
    high = None if maximum is None else f"<= {maximum}"
    if ((above is not None and not value > above) or (minimum is not None and value < minimum)
            or (maximum is not None and value > maximum)):
        raise ValueError(f"{name}: must be {' and '.join(t for t in (low, high) if t)}, got {value!r}")


def random_key(name: str, value: Any) -> None:
    """A JAX random key: a typed one (``jax.random.key``, shape ()) or a raw uint32 [2] (``jax.random.PRNGKey``)."""
    typed = isinstance(value, jax.Array) and jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key)
    raw = isinstance(value, (jax.Array, np.ndarray)) and value.dtype == np.uint32 and value.shape == (2,)
    if not (typed and value.shape == () or raw):
        described = f"shape {value.shape}, dtype {value.dtype}" if hasattr(value, "dtype") else type(value).__name__
        raise TypeError(f"{name}: expected one random key (jax.random.key(seed)), got {described}")


def integer_scalar(name: str, value: Any) -> Any:
    """An integer for the device: a Python or NumPy integer (not a bool) or an integer array of shape ()."""
    if isinstance(value, (jax.Array, np.ndarray)):
        _integer_dtype(name, value.dtype, "value")
        if value.shape != ():
            raise ValueError(f"{name}: expected a scalar, got shape {value.shape}")
        return value
    return integer(name, value)


def ids(name: str, values: Any, limit: int, axes: tuple[str, ...], *, kind: str = "token id",
        of: str = "the vocabulary", read_device: bool = True) -> Any:
    """Integer ids in [0, limit), one dimension per letter of ``axes`` (("B", "T"): [B, T]), none of them empty ->
    int32 data: a NumPy array for host data (nested lists of ints, a NumPy array), the array itself for a JAX one
    (cast where it holds another integer type). A JAX array's values are read (a wait for the device) only with
    ``read_device``, and never while traced. ``kind`` and ``of`` say what an id is and where it must lie."""
    if isinstance(values, jax.Array):
        _integer_dtype(name, values.dtype, kind)
        _shape(name, values.shape, axes)
        if read_device and not isinstance(values, jax.core.Tracer):
            _bounded(name, np.asarray(values), limit, kind, of)
        return values if values.dtype == np.int32 else values.astype(np.int32)
    array = _host_integers(name, values, axes, kind)
    _bounded(name, array, limit, kind, of)
    return array.astype(np.int32)


def prompts(name: str, values: Any, vocab_size: int, max_len: int, max_new_tokens: int = 0) -> list[np.ndarray]:
    """A batch of prompts (a list of token-id lists or 1-D integer arrays, or one 2-D integer array) -> one int32
    NumPy array per prompt. Each prompt is non-empty, its ids in [0, vocab_size), and its length plus
    ``max_new_tokens`` at most ``max_len``."""
    if isinstance(values, (np.ndarray, jax.Array)):
        _integer_dtype(name, values.dtype, "token id")
        if values.ndim != 2:
            raise ValueError(f"{name}: an array of prompts must be 2-D [batch, tokens], got shape {values.shape}")
        values = np.asarray(values)
    elif not isinstance(values, (list, tuple)):
        raise TypeError(f"{name}: expected a batch of prompts (a list of token-id lists, or a 2-D integer array), "
                        f"got {type(values).__name__}")
    if len(values) == 0:
        raise ValueError(f"{name}: empty batch; give at least one prompt")
    checked = []
    for i, prompt in enumerate(values):
        where = f"{name}[{i}]"
        if not isinstance(prompt, (list, tuple, np.ndarray, jax.Array)):
            raise TypeError(f"{where}: expected a prompt (a list of token ids), got {prompt!r} "
                            f"({type(prompt).__name__}); {name} is a batch of prompts, e.g. [[1, 2, 3]]")
        if len(prompt) == 0:
            raise ValueError(f"{where}: empty prompt; give at least one token")
        tokens = np.asarray(ids(where, prompt, vocab_size, ("T",)))
        if len(tokens) + max_new_tokens > max_len:
            asked = f" + max_new_tokens {max_new_tokens}" if max_new_tokens else ""
            raise ValueError(f"{where}: {len(tokens)} prompt tokens{asked} exceed the cache (max_len {max_len}); "
                             f"raise max_len or shorten the request")
        checked.append(tokens)
    return checked


def _host_integers(name: str, values: Any, axes: tuple[str, ...], kind: str) -> np.ndarray:
    """Host data of shape ``axes`` -> a NumPy array of integers (an integer dtype, or objects that are each an int).
    Lists are checked element by element: NumPy would turn a bool among ints into 1, and a float into a float array."""
    if isinstance(values, np.ndarray):
        _integer_dtype(name, values.dtype, kind)
        _shape(name, values.shape, axes)
        return values
    array = np.array(values, dtype=object)
    if array.ndim < len(axes) and array.size and isinstance(array.flat[0], (list, tuple, np.ndarray)):
        raise ValueError(f"{name}: rows of different lengths; expected a rectangular list of shape {_axes(axes)}")
    _shape(name, array.shape, axes)
    for flat_index, value in enumerate(array.flat):
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
            index = np.unravel_index(flat_index, array.shape)
            raise TypeError(f"{name}: {kind}s must be integers, got {value!r} ({type(value).__name__}) "
                            f"at {_where(index)}")
    return array


def _integer_dtype(name: str, dtype: Any, kind: str) -> None:
    if not np.issubdtype(dtype, np.integer):
        raise TypeError(f"{name}: {kind}s must be integers, got an array of dtype {dtype}")


def _shape(name: str, shape: tuple, axes: tuple[str, ...]) -> None:
    if len(shape) != len(axes):
        raise ValueError(f"{name}: expected shape {_axes(axes)}, got {tuple(shape)}")
    if 0 in shape:
        raise ValueError(f"{name}: empty (shape {shape})")


def _bounded(name: str, array: np.ndarray, limit: int, kind: str, of: str) -> None:
    outside = ((array < 0) | (array >= limit)).astype(bool)
    if outside.any():
        index = np.unravel_index(int(np.flatnonzero(outside)[0]), array.shape)
        raise ValueError(f"{name}: {kind} {array[index]} outside {of} [0, {limit}) at {_where(index)}")


def _axes(axes: tuple[str, ...]) -> str:
    return f"[{', '.join(axes)}]"


def _where(index: tuple) -> str:
    return f"index {index[0]}" if len(index) == 1 else f"[{', '.join(str(int(i)) for i in index)}]"


__all__ = ["ids", "integer", "integer_scalar", "prompts", "random_key", "real"]
