"""Argument checks of the public Python API: ``Generator`` (prefill, decode_step, decode_steps, generate), ``K3Model``
and ``Sampling`` refuse a bad argument with TypeError (wrong kind) or ValueError (out of range) naming it, the value
and where it sits, before anything runs on the device; prompts come as lists, NumPy or JAX arrays alike; a device
array given to a decode step is checked by shape and dtype, not read."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.inference import Generator
from k3jax.sampling import Sampling
from small_models import build

MAX_LEN, VOCAB = 32, 320  # tiny_linear's vocabulary


@pytest.fixture(scope="module")
def built():
    model = build("tiny_linear")
    assert model.cfg.vocab_size == VOCAB
    return model


@pytest.fixture(scope="module")
def gen(built):
    return Generator(built.model, max_len=MAX_LEN, prefill_chunk=16, attend_block=16)


def refused(error, message, call, *args, **kwargs):
    with pytest.raises(error, match=re.escape(message)):
        call(*args, **kwargs)


@pytest.mark.parametrize(
    "prompts, error, message",
    [
        ([[1, 2], [3, VOCAB]], ValueError, "prompts[1]: token id 320 outside the vocabulary [0, 320) at index 1"),
        ([[1, -1]], ValueError, "prompts[0]: token id -1 outside the vocabulary [0, 320) at index 1"),
        ([[2**70]], ValueError, f"prompts[0]: token id {2**70} outside the vocabulary"),
        (jnp.array([[5, VOCAB]]), ValueError, "prompts[0]: token id 320 outside the vocabulary [0, 320) at index 1"),
        ([list(range(MAX_LEN + 1))], ValueError, "prompts[0]: 33 prompt tokens exceed the cache (max_len 32)"),
        ([[1, 1.7]], TypeError, "prompts[0]: token ids must be integers, got 1.7 (float) at index 1"),
        ([[1, True]], TypeError, "prompts[0]: token ids must be integers, got True (bool) at index 1"),
        ([[np.float32(2)]], TypeError, "prompts[0]: token ids must be integers, got np.float32(2.0) (float32)"),
        (np.array([[1.0, 2.0]]), TypeError, "prompts: token ids must be integers, got an array of dtype float64"),
        ([np.array([True])], TypeError, "prompts[0]: token ids must be integers, got an array of dtype bool"),
        (np.arange(4), ValueError, "prompts: an array of prompts must be 2-D [batch, tokens], got shape (4,)"),
        ([1, 2, 3], TypeError, "prompts[0]: expected a prompt (a list of token ids), got 1 (int)"),
        ([[[1, 2]]], ValueError, "prompts[0]: expected shape [T], got (1, 2)"),
        ("hello", TypeError, "prompts: expected a batch of prompts"),
        ([], ValueError, "prompts: empty batch"),
        ([[1], []], ValueError, "prompts[1]: empty prompt"),
    ],
)
def test_prefill_refuses_bad_prompts(gen, prompts, error, message):
    refused(error, message, gen.prefill, prompts, None)  # refused before the cache is touched


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"max_new_tokens": 0}, ValueError, "max_new_tokens: must be >= 1, got 0"),
        ({"max_new_tokens": 2.5}, TypeError, "max_new_tokens: expected an integer, got 2.5 (float)"),
        ({"max_new_tokens": True}, TypeError, "max_new_tokens: expected an integer, got True (bool)"),
        ({"max_new_tokens": 30}, ValueError, "prompts[0]: 3 prompt tokens + max_new_tokens 30 exceed the cache"),
        ({"sampling": 0.7}, TypeError, "sampling: expected a Sampling"),
        ({"seed": 1.5}, TypeError, "seed: expected an integer, got 1.5"),
        ({"eos_id": VOCAB}, ValueError, "eos_id: must be >= 0 and <= 319, got 320"),
        ({"on_token": 5}, TypeError, "on_token: expected a function or None, got int"),
        ({"on_chunk": "progress"}, TypeError, "on_chunk: expected a function or None, got str"),
    ],
)
def test_generate_refuses_bad_arguments(gen, kwargs, error, message):
    refused(error, message, gen.generate, [[1, 2, 3]], **{"max_new_tokens": 4, **kwargs})


def test_generator_refuses_bad_settings(built):
    refused(TypeError, "model: expected a K3Model, got Built", Generator, built)
    refused(TypeError, "max_len: expected an integer, got 64.0 (float)", Generator, built.model, max_len=64.0)
    refused(ValueError, "max_len: must be >= 2, got 1", Generator, built.model, max_len=1)
    refused(TypeError, "prefill_chunk: expected an integer, got True (bool)", Generator, built.model,
            prefill_chunk=True)
    refused(ValueError, "steps_per_call: must be >= 1, got 0", Generator, built.model, steps_per_call=0)


KEY = jax.random.key(0)


@pytest.mark.parametrize(
    "args, kwargs, error, message",
    [
        (([VOCAB], [3]), {}, ValueError, "tokens: token id 320 outside the vocabulary [0, 320) at index 0"),
        (([1.5], [3]), {}, TypeError, "tokens: token ids must be integers, got 1.5 (float) at index 0"),
        ((jnp.array([1.0]), [3]), {}, TypeError, "tokens: token ids must be integers, got an array of dtype float32"),
        ((np.array([[1]]), [3]), {}, ValueError, "tokens: expected shape [B], got (1, 1)"),
        (([], []), {}, ValueError, "tokens: empty (shape (0,))"),
        (([1], [MAX_LEN]), {}, ValueError, "positions: position 32 outside the cache [0, 32) at index 0"),
        (([1], [-1]), {}, ValueError, "positions: position -1 outside the cache [0, 32) at index 0"),
        (([1], jnp.array([3.0])), {}, TypeError, "positions: positions must be integers, got an array of dtype"),
        (([1], [3, 4]), {}, ValueError, "positions: shape (2,), not tokens' (1,): one position per sequence"),
        (([1], [3]), {"key": 0}, TypeError, "key: expected one random key (jax.random.key(seed)), got int"),
        (([1], [3]), {"key": jax.random.split(KEY)}, TypeError, "key: expected one random key"),
        (([1], [3]), {"sampling": 0.0}, TypeError, "sampling: expected a Sampling"),
        (([1], [3]), {"window": 0}, ValueError, "window: must be >= 1 and <= 32, got 0"),
        (([1], [3]), {"window": MAX_LEN + 1}, ValueError, "window: must be >= 1 and <= 32, got 33"),
        (([1], [20]), {"window": 16}, ValueError, "window: 16 cache positions do not cover position 20 + 1 step"),
        (([1], [3]), {"step": 1.5}, TypeError, "step: expected an integer, got 1.5 (float)"),
        (([1], [3]), {"step": jnp.zeros(2, jnp.int32)}, ValueError, "step: expected a scalar, got shape (2,)"),
    ],
)
def test_decode_step_refuses_bad_arguments(gen, args, kwargs, error, message):
    kwargs = {"key": KEY, **kwargs}
    refused(error, message, gen.decode_step, args[0], None, args[1], **kwargs)


def test_decode_steps_refuses_bad_steps_and_short_windows(gen):
    refused(ValueError, "steps: must be >= 1, got 0", gen.decode_steps, [1], None, [3], KEY, 0)
    refused(TypeError, "steps: expected an integer, got 2.0 (float)", gen.decode_steps, [1], None, [3], KEY, 2.0)
    refused(ValueError, "window: 16 cache positions do not cover position 10 + 8 step(s)", gen.decode_steps, [1],
            None, [10], KEY, 8, window=16)


def test_decode_step_checks_device_arrays_by_shape_only(gen, monkeypatch):
    """Reading a device array's values would wait for the device: an id past the vocabulary on the device reaches
    the compiled step (here a stand-in) unread, while host lists arrive as checked int32 NumPy arrays."""
    calls = []
    monkeypatch.setattr(gen, "_decode", lambda *args, **kwargs: calls.append((args, kwargs)) or (None,) * 5)
    on_device = jnp.array([VOCAB + 5], jnp.int32)
    gen.decode_step(on_device, None, jnp.array([MAX_LEN + 5], jnp.int32), KEY, window=16)
    assert calls[-1][0][1] is on_device
    gen.decode_step([7, 8], None, [3, 4], KEY, window=16)
    tokens, positions = calls[-1][0][1], calls[-1][0][3]
    assert isinstance(tokens, np.ndarray) and tokens.dtype == np.int32 and tokens.tolist() == [7, 8]
    assert isinstance(positions, np.ndarray) and positions.dtype == np.int32 and positions.tolist() == [3, 4]


def test_prompts_as_lists_numpy_and_jax_arrays_prefill_alike(gen):
    """One compile: the same two prompts as lists of ints, a 2-D NumPy int64 array, a list of 1-D JAX arrays."""
    rows = [[5, 17, 300, 2, 9], [1, 2, 3, 4, 5]]
    forms = [rows, np.array(rows, np.int64), [jnp.array(r, jnp.int32) for r in rows]]
    logits = [np.asarray(gen.prefill(form, gen.init_cache(2))[0]) for form in forms]
    assert not np.isnan(logits[0]).any()
    for other in logits[1:]:
        np.testing.assert_array_equal(other, logits[0])


def test_model_checks_tokens_eagerly_and_shapes_under_jit(built):
    """Eager calls check values; traced ones shape and dtype only (their values are not known)."""
    refused(ValueError, "tokens: token id 320 outside the vocabulary [0, 320) at [0, 1]", built.model, [[1, VOCAB]])
    refused(ValueError, "tokens: token id -2 outside the vocabulary", built.model, np.array([[-2, 1]]))
    refused(TypeError, "tokens: token ids must be integers, got 1.7 (float) at [0, 0]", built.model, [[1.7]])
    refused(ValueError, "tokens: expected shape [B, T], got (3,)", built.model, np.array([1, 2, 3]))
    refused(TypeError, "tokens: token ids must be integers, got an array of dtype float32", jax.eval_shape,
            built.forward, built.params, jax.ShapeDtypeStruct((1, 4), jnp.float32))
    traced = jax.eval_shape(built.forward, built.params, jax.ShapeDtypeStruct((2, 4), jnp.int32))
    assert traced.shape == (2, 4, VOCAB)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"temperature": float("inf")}, ValueError, "temperature: must be a finite number, got inf"),
        ({"temperature": float("nan")}, ValueError, "temperature: must be a finite number, got nan"),
        ({"temperature": -0.5}, ValueError, "temperature: must be >= 0.0, got -0.5"),
        ({"temperature": "0.7"}, TypeError, "temperature: expected a number, got '0.7' (str)"),
        ({"top_k": 2.0}, TypeError, "top_k: expected an integer, got 2.0 (float)"),
        ({"top_k": True}, TypeError, "top_k: expected an integer, got True (bool)"),
        ({"top_p": float("nan")}, ValueError, "top_p: must be a finite number, got nan"),
        ({"top_p": 0.0}, ValueError, "top_p: must be > 0.0 and <= 1.0, got 0.0"),
    ],
)
def test_sampling_refuses_bad_settings(kwargs, error, message):
    refused(error, message, Sampling, **kwargs)
