"""Whole-model checks: jitted forward of the small presets, the real K3 config built abstractly with
its parameter count, and the compile time of a 93-layer stack (the scan over layer groups)."""

import time

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.model import K3Model, layer_groups
from k3jax.param_count import count_params
from k3jax.presets import preset


def test_layer_groups_cover_every_layer_once():
    for name in ["kimi-k3", "kimi-linear-48b", "tiny", "tiny_linear", "mini"]:
        cfg = preset(name)
        covered = [s + i for s, size, reps in layer_groups(cfg) for i in range(size * reps)]
        assert covered == list(range(cfg.num_layers)), name
    assert layer_groups(preset("kimi-k3")) == [(0, 4, 1), (4, 4, 22), (92, 1, 1)]


def test_kimi_k3_parameter_count_abstract():
    counts = count_params(preset("kimi-k3"))  # nnx.eval_shape: no parameter memory
    print(f"\nKimi-K3: total {counts.total / 1e12:.3f}T, active {counts.active / 1e9:.1f}B "
          f"(routed experts {counts.routed_experts / 1e12:.3f}T, embedding {counts.embedding / 1e9:.2f}B)")
    assert abs(counts.routed_experts - 92 * 896 * 3 * 3072 * 3584) == 0
    assert 2.75e12 < counts.total < 2.81e12  # spec: about 2.78T
    assert 103.5e9 < counts.active < 104.7e9  # spec: about 104.1B


def test_93_layer_stack_compiles_through_scan():
    k3, tiny = preset("kimi-k3"), preset("tiny")
    cfg = tiny.replace(layer_types=k3.layer_types, attn_res_block_size=12, name="tiny-93")
    graph, state = nnx.split(K3Model(cfg, rngs=nnx.Rngs(0)))
    forward = jax.jit(lambda s, t: nnx.merge(graph, s)(t))
    tokens = jax.random.randint(jax.random.key(1), (1, 11), 0, cfg.vocab_size)
    start = time.perf_counter()
    compiled = forward.lower(state, tokens).compile()
    seconds = time.perf_counter() - start
    print(f"\n93-layer tiny-width model: compiled in {seconds:.1f} s ({len(layer_groups(cfg))} runs)")
    logits = compiled(state, tokens)
    assert logits.shape == (1, 11, cfg.vocab_size) and bool(jnp.isfinite(logits).all())
    assert seconds < 60.0
