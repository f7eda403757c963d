"""Logits of the small presets on both implementations, made the same way whenever this runs: the
forward of a batch of awkward length, and cached generation (a chunked prefill of two prompts, greedy
decode steps at batch 2 and at batch 1, where the Pallas path takes its one-row kernels).

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

PRESETS = ("tiny", "tiny_linear")
IMPLEMENTATIONS = ("reference", "pallas")
PATH = os.path.join(os.path.dirname(__file__), "data", "golden_logits.npz")


def _model(name: str) -> k3jax.K3Model:
    """The preset with seed-0 weights, its zero-initialized parameters (AttnRes queries, router bias) drawn."""
    model = k3jax.K3Model(k3jax.preset(name), rngs=nnx.Rngs(0))
    graph, params = nnx.split(model)
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(7), len(leaves))
    leaves = [0.5 * jax.random.normal(k, x.shape, x.dtype) if x.dtype.kind == "f" and not x.any() else x
              for k, x in zip(keys, leaves)]
    nnx.update(model, jax.tree.unflatten(treedef, leaves))
    return model


def _generation(model: k3jax.K3Model, prompts: list[list[int]], steps: int) -> list[np.ndarray]:
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
        model = _model(name)
        vocab = model.cfg.vocab_size
        rng = np.random.default_rng(11)
        tokens = rng.integers(0, vocab, (2, 21)).astype(np.int32)
        prompts = [rng.integers(0, vocab, 19).tolist(), rng.integers(0, vocab, 7).tolist()]
        graph, params = nnx.split(model)
        for impl in IMPLEMENTATIONS:
            with k3jax.use_implementation(impl):
                forward = jax.jit(lambda p, t: nnx.merge(graph, p)(t))
                out[f"{name}/{impl}/forward"] = np.asarray(forward(params, tokens))
                for i, logits in enumerate(_generation(model, prompts, 2)):
                    out[f"{name}/{impl}/batch2/{i}"] = logits
                for i, logits in enumerate(_generation(model, prompts[:1], 2)):
                    out[f"{name}/{impl}/batch1/{i}"] = logits
    return out


def fingerprint() -> str:
    """What the stored bits depend on besides the code: JAX's version and the CPU."""
    flags = ""
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    isa = " ".join(sorted(f for f in flags.split() if f.startswith(("avx", "fma", "sse4"))))
    return f"jax {jax.__version__}; {platform.machine()}; {isa}"


if __name__ == "__main__":
    logits = compute()
    np.savez_compressed(PATH, fingerprint=np.array(fingerprint()), **logits)
    print(f"wrote {len(logits)} logits arrays to {PATH}", file=sys.stderr)
