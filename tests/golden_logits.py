"""Logits of the small presets on both implementations, made the same way whenever this runs: the
forward of a batch of awkward length, a chunked prefill of two prompts of other lengths, and at batch 1
a prefill and greedy decode steps (where the Pallas path takes its one-row kernels).

``python tests/golden_logits.py`` writes ``tests/data/golden_logits.npz``; ``tests/test_golden_logits.py``
compares today's logits with it, so a change meant to keep behaviour shows that it did."""

from __future__ import annotations

import os
import platform
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import k3jax
from small_models import build

PRESETS = ("tiny", "tiny_linear")
IMPLEMENTATIONS = ("reference", "pallas")
PATH = os.path.join(os.path.dirname(__file__), "data", "golden_logits.npz")


def _generation(model: k3jax.K3Model, prompts: list[list[int]], steps: int) -> list[np.ndarray]:
    """The prompts' last logits after a prefill in chunks of 16, then each greedy decode step's."""
    gen = k3jax.Generator(model, max_len=48, prefill_chunk=16, steps_per_call=1)
    logits, cache = gen.prefill(prompts, gen.init_cache(len(prompts)))
    out = [np.asarray(logits)]
    positions = jnp.array([len(p) for p in prompts], jnp.int32)
    tokens = jnp.argmax(logits, -1).astype(jnp.int32)
    for _ in range(steps):
        tokens, logits, cache = gen.decode_step(tokens, cache, positions, jax.random.key(0),
                                                window=gen.window(int(positions.max()) + 1))
        out.append(np.asarray(logits))
        positions = positions + 1
    return out


def compute() -> dict[str, np.ndarray]:
    """{'<preset>/<implementation>/<case>': logits float32}."""
    out = {}
    for name in PRESETS:
        model = build(name).model  # seed-0 weights, the zero-initialized ones drawn (seed 7)
        vocab = model.cfg.vocab_size
        rng = np.random.default_rng(11)
        tokens = rng.integers(0, vocab, (2, 21)).astype(np.int32)
        prompts = [rng.integers(0, vocab, 19).tolist(), rng.integers(0, vocab, 7).tolist()]
        graph, params = nnx.split(model)
        for impl in IMPLEMENTATIONS:
            with k3jax.use_implementation(impl):
                forward = jax.jit(lambda p, t: nnx.merge(graph, p)(t))
                out[f"{name}/{impl}/forward"] = np.asarray(forward(params, tokens))
                out[f"{name}/{impl}/batch2/0"] = _generation(model, prompts, 0)[0]
                for i, logits in enumerate(_generation(model, prompts[:1], 2)):
                    out[f"{name}/{impl}/batch1/{i}"] = logits
    return out


def fingerprint() -> str:
    """What the stored bits depend on besides the code: JAX's version and the CPU (its model, cache and
    instruction sets: XLA's CPU matmuls block by cache size, which orders their sums)."""
    info = {}
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                info.setdefault(key.strip(), value.strip())
    isa = " ".join(sorted(f for f in info.get("flags", "").split() if f.startswith(("avx", "fma", "sse4"))))
    cpu = f"{info.get('model name', platform.processor())}; cache {info.get('cache size', '?')}"
    return f"jax {jax.__version__}; {platform.machine()}; {cpu}; {isa}"


if __name__ == "__main__":
    logits = compute()
    np.savez_compressed(PATH, fingerprint=np.array(fingerprint()), **logits)
    print(f"wrote {len(logits)} logits arrays to {PATH}", file=sys.stderr)
