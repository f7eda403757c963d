"""Jitted generation: chunked prefill into the cache, then compiled decode steps, several per call.

The cache per sequence: for KDA layers the float32 state [H, K, V] and the short-conv inputs (the
last 3 per channel); for MLA layers only c_kv (after kv_a_layernorm) and k_pe per position, 576
values for K3, preallocated to ``max_len``. Block AttnRes needs no cache across tokens: it mixes
over depth, per token, so every decode step rebuilds its blocks from the new token alone.

    gen = Generator(model, max_len=512)
    out = gen.generate([[1, 2, 3], [4, 5]], max_new_tokens=16, sampling=Sampling(temperature=0.7), seed=0)

The compiled functions take the weights as one flat list of arrays: handing a jitted function the
model's nested parameter tree costs about a millisecond of host time per call in pytree flattening,
as long as a whole decode step of a small model on a GPU.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from k3jax import arguments
from k3jax.model import K3Model
from k3jax.sampling import Sampling, sample, token_logprobs
from k3jax.sharding.mesh import constrain_cache, on_mesh
from k3jax.typing import Array


@dataclass(frozen=True)
class Generation:
    """New tokens per sequence (EOS included when it stopped on it) and each one's log-probability under the
    model's own distribution (``token_logprobs``: before temperature and filters), with timings: prefill (first
    call compiles), and the decode calls after the first (which compiles the steps)."""

    tokens: list[list[int]]
    logprobs: list[list[float]]
    prefill_seconds: float
    decode_seconds: float
    decode_tokens: int

    @property
    def decode_tokens_per_second(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds > 0 else float("nan")


# The decode step's command buffer (CUDA graph) orders its kernels by the buffers they share, not in
# XLA's one-stream schedule, so kernels that share no buffer may run side by side: on the H200
# the B=64 step of `mini` took 2.73 ms against 3.11 (benchmarks/HISTORY.md, 2026-12-01).
DECODE_GPU_OPTIONS = {"xla_gpu_command_buffer_scheduling_mode": "CONCURRENT"}
# A prefill chunk's: XLA's dot merger off. It joins the matmuls that read one input (a layer's projections) into one
# over their weights concatenated, a copy of the weights (up to 46 MB at `mini`) written on every call: on the H200, 33
# copies in a 2048-token `mini` chunk, 290 us of its 10.6 ms; without them a 2048-token prompt took 19.5 against 20.7
# ms (best of five rounds; medians 22.2 and 22.7). The decode step keeps the merger: its concurrent command buffer
# runs the copies beside the step's chain (B=8 and B=64 tied) (benchmarks/HISTORY.md, 2026-12-03).
PREFILL_GPU_OPTIONS = {"xla_disable_hlo_passes": "dot-merger"}
# Prompt tokens per prefill call: on the H200 a 4096-token `mini` prompt took 35.3 ms in chunks of 2048 against
# 67.6 in chunks of 256, with as many compiles (benchmarks/HISTORY.md, 2026-12-03).
DEFAULT_PREFILL_CHUNK = 2048
# Decode steps per compiled call in ``generate``: on the H200 `mini`'s B=1 steps took 0.844 ms a token in calls of 8
# and of 32 (the GPU's own time), against 0.95 one step a call, where the host's 0.6-1.0 ms to dispatch a step set
# the pace (benchmarks/HISTORY.md, 2026-12-04).
DEFAULT_STEPS_PER_CALL = 8
# Run-to-run reproducibility on a GPU: XLA picks some of its kernels by timing candidates at each compile (its
# autotuning), so two processes may sum a product in different orders; with this option the same weights, prompts and
# seed give the same bits in every process. On the H200, `mini`'s prefill logits differed between two processes
# without it, and prefill, decode and generate were bitwise equal across two processes with it; it cost a 2048-token
# prefill 14.6 against 12.6 ms, the B=1 step 0.916 against 0.897 ms a token, the B=64 step 3.10 against 2.45 ms, so
# it is off by default (benchmarks/HISTORY.md, 2026-12-04). Within one process a compiled call
# repeats bitwise either way.
DETERMINISTIC_GPU_OPTIONS = {"xla_gpu_deterministic_ops": True}


def on_gpu(options: dict, deterministic: bool = False) -> dict | None:
    """A jit's ``compiler_options``: ``options`` (``DECODE_GPU_OPTIONS`` or ``PREFILL_GPU_OPTIONS``, as they are at
    the call), with ``DETERMINISTIC_GPU_OPTIONS`` if ``deterministic``, on a GPU; none elsewhere."""
    if jax.default_backend() != "gpu":
        return None
    return {**options, **(DETERMINISTIC_GPU_OPTIONS if deterministic else {})}


class Generator:
    """Holds the split model, the compiled prefill chunk and decode step, and runs batches.

    max_len bounds prompt plus new tokens per sequence (the MLA cache is preallocated to it);
    prefill_chunk bounds the tokens processed per prefill call (memory stays bounded for long
    prompts); cache_dtype is the MLA latent cache's dtype (default: the parameters' dtype);
    scan_layers=True compiles repeated layer groups once under ``lax.scan`` but stacks their weights
    on every call, so the default unrolls the layers: a longer compile, no weight copies per token;
    attend_block: the MLA layers read the filled part of their cache rounded up to attend_block
    times a power of two (``window``), so a short sequence in a long cache does not read all of it
    (one compiled variant per window size, at most log2(max_len / attend_block) + 2);
    steps_per_call: decode steps ``generate`` runs per compiled call (a ``lax.scan`` on the device), so the host
    dispatches once per that many tokens; tokens reach the host, ``on_token`` and the stop checks in bursts of that
    many, and up to twice that many steps may run past the last stop or max_new_tokens (their tokens dropped);
    deterministic: on a GPU, compile every call with ``DETERMINISTIC_GPU_OPTIONS``, so a seed gives the same tokens
    and logprobs in every process, not only within one;
    mesh: run on this ``k3jax.sharding`` mesh (the model's parameters placed on it, ``k3jax.sharding.place`` or
    ``k3jax.load(..., mesh=)``): the caches are held as ``k3jax.sharding.rules.CACHE_AXES`` says (batch over
    ``data``, KDA heads over ``tensor``) and the MoE layers run expert-parallel.
    """

    def __init__(
        self, model: K3Model, max_len: int = 2048, prefill_chunk: int = DEFAULT_PREFILL_CHUNK, cache_dtype=None,
        scan_layers: bool = False, attend_block: int = 256, steps_per_call: int = DEFAULT_STEPS_PER_CALL,
        deterministic: bool = False, mesh: Mesh | None = None,
    ):
        if not isinstance(model, K3Model):
            raise TypeError(f"model: expected a K3Model, got {type(model).__name__}")
        max_len = arguments.integer("max_len", max_len, minimum=2)
        prefill_chunk = arguments.integer("prefill_chunk", prefill_chunk, minimum=1)
        attend_block = arguments.integer("attend_block", attend_block, minimum=1)
        steps_per_call = arguments.integer("steps_per_call", steps_per_call, minimum=1)
        if mesh is not None and not isinstance(mesh, Mesh):
            raise TypeError(f"mesh: expected a jax.sharding.Mesh (k3jax.sharding.make_mesh), got {type(mesh).__name__}")
        self.cfg, self.mesh = model.cfg, mesh
        self.max_len, self.prefill_chunk, self.scan_layers = max_len, prefill_chunk, scan_layers
        self.attend_block, self.steps_per_call = attend_block, steps_per_call
        self.cache_dtype = cache_dtype or model.embed_tokens.weight.dtype
        self._graph, params = nnx.split(model)
        self._weights, self._treedef = jax.tree_util.tree_flatten(params)
        self._model = model
        options = lambda gpu_options: on_gpu(gpu_options, deterministic)
        self._chunk = jax.jit(self._chunk_fn, donate_argnums=2, static_argnames="window",
                              compiler_options=options(PREFILL_GPU_OPTIONS))
        self._init_cache = jax.jit(self._init_cache_fn, static_argnums=0)
        self._logits = jax.jit(self._logits_fn, compiler_options=options({}))
        self._decode = jax.jit(self._decode_fn, donate_argnums=2, static_argnames=("sampling", "window"),
                               compiler_options=options(DECODE_GPU_OPTIONS))
        self._decode_steps = jax.jit(self._decode_steps_fn, donate_argnums=2,
                                     static_argnames=("sampling", "window", "steps"),
                                     compiler_options=options(DECODE_GPU_OPTIONS))
        self._first = jax.jit(self._first_fn, static_argnames="sampling", compiler_options=options({}))
        # host data goes to the device as the compiled calls give it back (on a mesh: whole on every device)
        self._home = None if mesh is None else NamedSharding(mesh, PartitionSpec())
        self._step0 = jax.device_put(jnp.zeros((), jnp.int32), self._home)

    def _merged(self, weights) -> K3Model:
        return nnx.merge(self._graph, jax.tree_util.tree_unflatten(self._treedef, weights))

    def _extend_fn(self, weights, tokens, cache, start, lengths, logits_at=None, window=None, head=True):
        if self.mesh is None:
            return self._merged(weights).extend(tokens, cache, start, lengths, self.scan_layers, logits_at, window,
                                                head)
        with on_mesh(self.mesh):  # the cache comes back where it went in: each call compiles once
            out, cache = self._merged(weights).extend(tokens, cache, start, lengths, self.scan_layers, logits_at,
                                                      window, head)
        return out, constrain_cache(cache, self.mesh)

    def _chunk_fn(self, weights, tokens, cache, start, lengths, logits_at, last, ends_here, window):
        """One prefill chunk into the cache; ``last`` [B, D] takes the final hidden state of the prompts that end in
        it (``ends_here`` [B]), so the host dispatches no other work per chunk."""
        hidden, cache = self._extend_fn(weights, tokens, cache, start, lengths, logits_at, window, head=False)
        return jnp.where(ends_here[:, None], hidden[:, 0].astype(last.dtype), last), cache

    def _init_cache_fn(self, batch: int) -> list:
        cache = self._model.init_cache(batch, self.max_len, self.cache_dtype, self.scan_layers)
        return cache if self.mesh is None else constrain_cache(cache, self.mesh)

    def _logits_fn(self, weights, hidden):
        return self._merged(weights).logits(hidden)

    def _decode_fn(self, weights, tokens, cache, positions, key, step, sampling, window):
        """One decode step -> (next tokens, logits, cache, positions + 1, step + 1): ``generate`` feeds the last two
        back, so no step needs an array from the host."""
        logits, cache = self._extend_fn(weights, tokens[:, None], cache, positions, None, window=window)
        next_tokens = sample(logits[:, 0], jax.random.fold_in(key, step), sampling)
        next_tokens, positions = self._whole(next_tokens), self._whole(positions)
        return next_tokens, logits[:, 0], cache, positions + 1, step + 1

    def _whole(self, x: Array) -> Array:
        """On a mesh, a small array held whole on every device, as the host's arrays arrive: a decode step's tokens
        and positions go back in as they came, so the step compiles once."""
        return x if self.mesh is None else jax.lax.with_sharding_constraint(x, self._home)

    def _first_fn(self, logits, key, sampling):
        """The first new tokens, from the prompts' last logits with key step 0 -> (tokens [B], their logprobs [B])."""
        tokens = self._whole(sample(logits, jax.random.fold_in(key, 0), sampling))
        return tokens, token_logprobs(logits, tokens)

    def _decode_steps_fn(self, weights, tokens, cache, positions, key, step, sampling, window, steps):
        """``steps`` decode steps under ``lax.scan`` -> (tokens [steps, B], their logprobs [steps, B], the last tokens,
        cache, positions + steps, step + steps). A position past the cache is held at its last slot: such steps come
        after every sequence has its max_new_tokens (``generate`` drops their tokens), and a write past the cache would
        be out of bounds."""
        def one(carry, _):
            tokens, cache, positions, step = carry
            positions = jnp.minimum(positions, self.max_len - 1)
            tokens, logits, cache, positions, step = self._decode_fn(weights, tokens, cache, positions, key, step,
                                                                     sampling, window)
            return (tokens, cache, positions, step), (tokens, token_logprobs(logits, tokens))

        (last, cache, positions, step), (tokens, logprobs) = jax.lax.scan(one, (tokens, cache, positions, step),
                                                                          length=steps)
        if self.mesh is not None:  # the loop's carry leaves where XLA put it: back where it came in
            last, positions, cache = self._whole(last), self._whole(positions), constrain_cache(cache, self.mesh)
        return tokens, logprobs, last, cache, positions, step

    def window(self, end: int) -> int:
        """MLA cache positions read by a call whose new tokens end before position ``end``: the
        smallest attend_block * 2**i >= end, at most max_len."""
        size = self.attend_block
        while size < end:
            size *= 2
        return min(size, self.max_len)

    def decode_step(
        self, tokens: Array, cache: list, positions: Array, key: Array, sampling: Sampling = Sampling(),
        window: int | None = None, step: Array | None = None,
    ) -> tuple[Array, Array, list]:
        """One token per sequence (tokens [B] at ``positions`` [B]) -> (next tokens [B], logits [B, V],
        cache). The cache passed in is donated: use the one returned. The next tokens are sampled with
        ``jax.random.fold_in(key, step)`` (``step`` an int32 scalar on the device; None: 0). ``window``: the MLA cache
        positions to read, at least max(positions) + 1 (``self.window`` rounds that to a compiled size); None reads the
        whole cache. Arrays from the host (NumPy, Python numbers) are copied to the device on every call, which on a
        GPU can hold the host until the previous step has run: pass device arrays. Arguments are checked by shape and
        dtype, and host data by value too (ids in the vocabulary, positions in the cache, ``window`` covering them);
        TypeError or ValueError name the argument."""
        tokens, positions, window = self._decode_arguments(tokens, positions, key, sampling, window, step, steps=1)
        step = self._step0 if step is None else step
        return self._decode(self._weights, tokens, cache, positions, key, step, sampling=sampling, window=window)[:3]

    def decode_steps(
        self, tokens: Array, cache: list, positions: Array, key: Array, steps: int, sampling: Sampling = Sampling(),
        window: int | None = None, step: Array | None = None,
    ) -> tuple[Array, Array, list]:
        """``steps`` decode steps in one compiled call, each feeding its sampled tokens to the next: as ``steps``
        calls of ``decode_step`` (the same tokens), with one dispatch from the host -> (tokens [steps, B], their
        logprobs [steps, B] (``token_logprobs``), cache).
        ``window`` must cover max(positions) + steps; positions past max_len - 1 are held there. Arguments are checked
        as ``decode_step``'s, and ``steps`` is a positive integer."""
        steps = arguments.integer("steps", steps, minimum=1)
        tokens, positions, window = self._decode_arguments(tokens, positions, key, sampling, window, step, steps)
        step = self._step0 if step is None else step
        out = self._decode_steps(self._weights, tokens, cache, positions, key, step, sampling=sampling,
                                 window=window, steps=steps)
        return out[0], out[1], out[3]

    def _decode_arguments(self, tokens, positions, key, sampling, window, step, steps: int):
        """The decode calls' arguments checked -> (tokens, positions, window) as the compiled call takes them. A
        device array is checked by shape and dtype only (reading its values would wait for the device); host data
        by value too, ``window`` against the positions the ``steps`` steps write."""
        tokens = arguments.ids("tokens", tokens, self.cfg.vocab_size, ("B",), read_device=False)
        positions = arguments.ids("positions", positions, self.max_len, ("B",), kind="position", of="the cache",
                                  read_device=False)
        if positions.shape != tokens.shape:
            raise ValueError(f"positions: shape {tuple(positions.shape)}, not tokens' {tuple(tokens.shape)}: one "
                             f"position per sequence")
        arguments.random_key("key", key)
        _check_sampling(sampling)
        if step is not None:
            arguments.integer_scalar("step", step)
        if window is None:
            return tokens, positions, window
        window = arguments.integer("window", window, minimum=1, maximum=self.max_len)
        if isinstance(positions, np.ndarray) and window < min(int(positions.max()) + steps, self.max_len):
            raise ValueError(f"window: {window} cache positions do not cover position {int(positions.max())} + "
                             f"{steps} step(s); use self.window(max(positions) + steps) or None")
        return tokens, positions, window

    def init_cache(self, batch: int) -> list:
        """An empty cache for ``batch`` sequences, made by one compiled call (made op by op, its zeros cost a GPU's
        host about 8 ms before a prompt's first chunk could start: benchmarks/HISTORY.md, 2026-12-03)."""
        return self._init_cache(arguments.integer("batch", batch, minimum=1))

    def prefill(
        self, prompts: Sequence[Sequence[int]], cache: list, on_chunk: Callable[[int, int], None] | None = None,
    ) -> tuple[Array, list]:
        """Run right-padded prompts through the model in chunks. Returns (last-token logits [B, V], cache).
        Each chunk keeps the final hidden state of the prompts that end in it; the output head runs once, after
        the last chunk. ``prompts``: lists of token ids or 1-D integer arrays (or one 2-D array), each non-empty,
        within the vocabulary and at most max_len long (TypeError or ValueError naming the prompt and position).
        ``on_chunk(tokens done, tokens in the longest prompt)`` is called as each chunk finishes (the host waits for
        every chunk then, so pass it only to show progress)."""
        checked = arguments.prompts("prompts", prompts, self.cfg.vocab_size, self.max_len)
        return self._prefill(checked, cache, _callable_or_none("on_chunk", on_chunk))

    def _prefill(self, prompts: list[np.ndarray], cache: list, on_chunk) -> tuple[Array, list]:
        """``prefill`` of prompts already checked."""
        lengths = np.array([len(p) for p in prompts], np.int32)
        chunk = min(self.prefill_chunk, -(-int(lengths.max()) // 16) * 16)
        total = -(-int(lengths.max()) // chunk) * chunk
        tokens = np.zeros((len(prompts), total), np.int32)
        for i, p in enumerate(prompts):
            tokens[i, : len(p)] = p
        starts = range(0, total, chunk)
        # each chunk's tokens, start, each prompt's last token within it and whether the prompt ends in it, copied to
        # the device at once, before the first chunk: a copy from the host between chunks can hold the host until the
        # GPU has run the chunks before it
        per_chunk = [(tokens[:, s : s + chunk], np.full(len(prompts), s, np.int32),
                      np.clip(lengths - 1 - s, 0, chunk - 1).astype(np.int32),
                      (lengths - 1 >= s) & (lengths - 1 < s + chunk)) for s in starts]
        last = np.zeros((len(prompts), self.cfg.hidden_size), self._model.embed_tokens.weight.dtype)
        longest = int(lengths.max())
        inputs, lengths, last = jax.device_put((per_chunk, lengths, last), self._home)
        for start, (tokens_in, start_in, index_in, ends_in) in zip(starts, inputs):
            last, cache = self._chunk(self._weights, tokens_in, cache, start_in, lengths, index_in, last, ends_in,
                                      window=self.window(start + chunk))
            if on_chunk:
                jax.block_until_ready(last)
                on_chunk(min(start + chunk, longest), longest)
        return self._logits(self._weights, last), cache

    def generate(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int, sampling: Sampling = Sampling(),
        seed: int = 0, eos_id: int | None = None, on_token: Callable[[np.ndarray, np.ndarray], None] | None = None,
        on_chunk: Callable[[int, int], None] | None = None,
    ) -> Generation:
        """Generate up to max_new_tokens per prompt; a sequence stops at ``eos_id`` (kept in its output).
        ``on_token(tokens [B], active [B])`` sees each step's tokens as they come (streaming), in bursts of
        ``steps_per_call``; ``on_chunk`` sees the prefill's progress (``prefill``). Each new token's log-probability
        comes with it (``Generation.logprobs``). Prompts are checked as ``prefill``'s, with room for max_new_tokens
        (a positive integer) in max_len; every argument's check names it (TypeError or ValueError)."""
        prompts = arguments.prompts("prompts", prompts, self.cfg.vocab_size, self.max_len,
                                    arguments.integer("max_new_tokens", max_new_tokens, minimum=1))
        _check_sampling(sampling)
        seed = arguments.integer("seed", seed, minimum=-2**63, maximum=2**63 - 1)
        if eos_id is not None:
            eos_id = arguments.integer("eos_id", eos_id, minimum=0, maximum=self.cfg.vocab_size - 1)
        on_token, on_chunk = _callable_or_none("on_token", on_token), _callable_or_none("on_chunk", on_chunk)
        B = len(prompts)
        key = jax.random.key(seed)
        t0 = time.perf_counter()
        logits, cache = self._prefill(prompts, self.init_cache(B), on_chunk)
        token, logprob = self._first(logits, key, sampling=sampling)
        token_host = np.asarray(token)
        t1 = time.perf_counter()
        out = [[int(t)] for t in token_host]
        logprobs = [[float(p)] for p in np.asarray(logprob)]
        active = np.array([eos_id is None or t != eos_id for t in token_host]) & (max_new_tokens > 1)
        if on_token:
            on_token(token_host, np.ones(B, bool))
        timed = 0

        def take(first: int, tokens: Array, call_logprobs: Array) -> None:  # a call's tokens: kept, streamed, stopped
            nonlocal timed
            for token_host, logprob_host in zip(np.asarray(tokens), np.asarray(call_logprobs)):
                if not active.any():
                    return
                timed += int(active.sum()) if first > 1 else 0
                if on_token:
                    on_token(token_host, active.copy())
                for b in np.flatnonzero(active):
                    out[b].append(int(token_host[b]))
                    logprobs[b].append(float(logprob_host[b]))
                    if (eos_id is not None and token_host[b] == eos_id) or len(out[b]) == max_new_tokens:
                        active[b] = False

        # Each call of steps_per_call steps is dispatched before the previous call's tokens are read (their copy to
        # the host started when that call was dispatched), and takes its tokens, positions and key step from the call
        # before on the device, so the host's work runs while the GPU computes. Every sequence's position advances
        # each step (a stopped sequence's rows are computed and dropped); a stop is seen one call late, so after the
        # last stop one more call may run.
        lengths = np.array([len(p) for p in prompts], np.int32)
        positions, step_dev = jax.device_put((lengths, np.int32(1)), self._home)
        longest, steps = int(lengths.max()), self.steps_per_call
        t2, pending = t1, None
        for first in range(1, max_new_tokens, steps):  # the call's first step (step s feeds position length + s - 1)
            if not active.any():
                break
            if first == 1 + steps:  # steady state from here: the first call, which compiled, done
                jax.block_until_ready(pending[1])
                t2 = time.perf_counter()
            tokens, call_logprobs, token, cache, positions, step_dev = self._decode_steps(
                self._weights, token, cache, positions, key, step_dev, sampling=sampling,
                window=self.window(longest + first + steps - 1), steps=steps)
            for call_out in (tokens, call_logprobs):  # read after the next call is dispatched, by then on the host
                call_out.copy_to_host_async()
            if pending:
                take(*pending)
            pending = first, tokens, call_logprobs
        if pending and active.any():  # else the call after the last stop: nothing to keep
            take(*pending)
        return Generation(out, logprobs, t1 - t0, time.perf_counter() - t2 if timed else 0.0, timed)


def _check_sampling(sampling) -> None:
    if not isinstance(sampling, Sampling):
        raise TypeError(f"sampling: expected a Sampling (k3jax.sampling.Sampling(temperature, top_k, top_p)), got "
                        f"{sampling!r}")


def _callable_or_none(name: str, value):
    if value is not None and not callable(value):
        raise TypeError(f"{name}: expected a function or None, got {type(value).__name__}")
    return value


__all__ = ["DEFAULT_PREFILL_CHUNK", "DEFAULT_STEPS_PER_CALL", "DETERMINISTIC_GPU_OPTIONS", "Generator", "Generation"]
