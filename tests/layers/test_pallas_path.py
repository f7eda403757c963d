"""The implementation switch: KDA, MoE and MLA layers give the reference's outputs on the Pallas path
(kernels in interpret mode on CPU), for prefill and decode shapes; the ``KernelPolicy`` choices the layers
meet there give the same outputs either way."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import pallas_kernels._platform
import pallas_kernels.moe.ops
from k3jax.config import KDAConfig
from k3jax.implementation import KernelPolicy, use_implementation
from k3jax.layers.basic import RMSNorm
from k3jax.layers.kda import KDA
from k3jax.layers.mla import MLA
from k3jax.layers.mlp import activation
from k3jax.layers.moe import MoE
from k3jax.presets import preset
from reference_numpy import rel_err


def both(fn, *args, policy: KernelPolicy | None = None):
    """fn's outputs on the reference path, then on the Pallas path (under ``policy``). The switch is read at
    trace time and jax.jit caches traces by function, so each setting traces a fresh function (else the
    second jit would reuse the first trace and compare the reference with itself)."""
    outs = {}
    for name in ("reference", "pallas"):
        with use_implementation(name, policy=policy):
            outs[name] = jax.jit(lambda *a: fn(*a))(*args)
    return outs["reference"], outs["pallas"]


@pytest.mark.parametrize("batch", [2, 1])  # batch 1: the decode step's projections in one matvec kernel
def test_kda_layer_prefill_and_decode(batch):
    cfg = preset("tiny")
    layer = KDA(cfg.hidden_size, cfg.kda, cfg.rms_norm_eps, rngs=nnx.Rngs(1))
    norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
    norm.weight.set_value(1.0 + jax.random.normal(jax.random.key(3), (cfg.hidden_size,)))
    graph, params = nnx.split((layer, norm))
    x = jax.random.normal(jax.random.key(2), (batch, 21, cfg.hidden_size))

    def run(params, x):
        m, n = nnx.merge(graph, params)
        y, state = m(x[:, :20], norm=n)
        z, state = m(x[:, 20:], state, norm=n)
        return y, z, state.recurrent

    ref, pal = both(run, params, x)
    for a, b in zip(ref, pal):  # bf16 matrix inputs inside the kernels
        assert rel_err(b, a) < 5e-3


def test_kda_decode_conv_in_maps_is_the_conv_kernel():
    """``KernelPolicy.conv_in_matvec``: at one row the short convs inside the input maps' kernel give the
    output and both states of the separate conv kernel bitwise, with one kernel fewer in the step."""
    cfg = preset("tiny")
    layer = KDA(cfg.hidden_size, cfg.kda, cfg.rms_norm_eps, rngs=nnx.Rngs(7))
    norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
    graph, params = nnx.split((layer, norm))
    x = jax.random.normal(jax.random.key(8), (1, 6, cfg.hidden_size))
    with use_implementation("pallas"):
        m, n = nnx.merge(graph, params)
        _, state = m(x[:, :5], norm=n)  # a prefilled state, so the conv taps see real history

    def step(params, x, state):
        m, n = nnx.merge(graph, params)
        return m(x[:, 5:], state, norm=n)

    outs, kernels = {}, {}
    for on in (False, True):
        with use_implementation("pallas", policy=KernelPolicy(conv_in_matvec=on)):
            f = lambda *a: step(*a)  # a fresh function: the policy is read when traced
            kernels[on] = str(jax.make_jaxpr(f)(params, x, state)).count("pallas_call[")
            outs[on] = jax.jit(f)(params, x, state)
    assert kernels[True] == kernels[False] - 1
    for a, b in zip(jax.tree.leaves(outs[False]), jax.tree.leaves(outs[True])):
        assert a.shape == b.shape and bool(jnp.all(a == b))


def test_kda_prefill_with_the_chunk_kernel_equals_xla_convs():
    """The KDA layer on the Pallas path over two chunks of a ragged batch (the state carried from the first) with
    ``KernelPolicy.conv_kernel_at_prefill`` on and off: the same outputs and states."""
    cfg = KDAConfig(num_heads=2, head_dim=16, conv_size=4, gate_lower_bound=-5.0)
    layer = KDA(32, cfg, 1e-6, rngs=nnx.Rngs(3))
    x = jax.random.normal(jax.random.key(1), (2, 24, 32))
    valid = jnp.arange(24)[None] < jnp.array([[24], [13]])
    runs, kernels = {}, {}
    for on in (True, False):
        with use_implementation("pallas", policy=KernelPolicy(conv_kernel_at_prefill=on)):
            # one chunk's function, traced under the policy, for both chunks
            chunk = jax.jit(lambda x, state, valid: layer(x, state, valid=valid))
            state = layer.initial_state(2)
            kernels[on] = str(chunk.trace(x[:, :12], state, valid[:, :12]).jaxpr).count("name=conv_silu_chunk")
            first, state = chunk(x[:, :12], state, valid[:, :12])
            second, state = chunk(x[:, 12:], state, valid[:, 12:])
        runs[on] = (first, second, state.conv, state.recurrent)
    assert (kernels[True], kernels[False]) == (1, 0)
    for got, want in zip(runs[True], runs[False]):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_kda_layer_ragged_rows():
    """Right padding (``valid``) leaves the state as it was, on both paths: row 1 has 13 real prompt
    tokens and no real decode token."""
    cfg = preset("tiny")
    layer = KDA(cfg.hidden_size, cfg.kda, cfg.rms_norm_eps, rngs=nnx.Rngs(5))
    graph, params = nnx.split(layer)
    x = jax.random.normal(jax.random.key(6), (2, 21, cfg.hidden_size))
    valid = jnp.arange(21)[None, :] < jnp.array([[21], [13]])

    def run(params, x):
        m = nnx.merge(graph, params)
        y, state = m(x[:, :20], valid=valid[:, :20])
        _, state_13 = m(x[1:, :13])
        z, state = m(x[:, 20:], state, valid=valid[:, 20:])
        return y[0], y[1, :13], z[0], state.recurrent, state_13.recurrent[0]

    ref, pal = both(run, params, x)
    for a, b in zip(ref, pal):
        assert rel_err(b, a) < 5e-3
    assert rel_err(pal[3][1], pal[4]) < 5e-3  # row 1's state is the state after its 13 tokens


# (3, 1): 6 (token, expert) pairs, the fused decode MoE's two kernels; (5, 7): 70, sorted; (1, 1): one row,
# the two kernels with one output row per down program, the input maps (norm, router, latent, shared gate and
# up) in one matvec kernel, and the latent norm and up projection in another
@pytest.mark.parametrize("tokens", [(3, 1), (5, 7), (1, 1)])
def test_moe_layer_with_packed_experts(tokens):
    cfg = preset("tiny")
    layer = MoE(cfg.hidden_size, cfg.moe, activation("situ"), cfg.rms_norm_eps, rngs=nnx.Rngs(3), packed_experts=True)
    norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
    norm.weight.set_value(1.0 + jax.random.normal(jax.random.key(5), (cfg.hidden_size,)))
    graph, params = nnx.split((layer, norm))
    x = 3.0 * jax.random.normal(jax.random.key(4), (*tokens, cfg.hidden_size))

    def run(params, x):
        m, n = nnx.merge(graph, params)
        return m(x, norm=n)

    ref, pal = both(run, params, x)
    assert rel_err(pal, ref) < 5e-3


def test_moe_layer_tiled_for_prefill(monkeypatch):
    """With the prefill threshold lowered to 1 pair per expert (``KernelPolicy.prefill_pairs_per_expert``,
    default 256) a bf16 layer takes its routed experts through ``tiled_moe_mx`` (the grouped Mosaic GPU
    kernel, interpret mode) and matches the reference path within bf16 rounding."""
    calls = []
    tiled = pallas_kernels.moe.ops.tiled_moe_mx
    monkeypatch.setattr(pallas_kernels.moe.ops, "tiled_moe_mx", lambda *a, **kw: calls.append(1) or tiled(*a, **kw))
    cfg = preset("tiny")
    layer = MoE(cfg.hidden_size, cfg.moe, activation("situ"), cfg.rms_norm_eps, rngs=nnx.Rngs(3), packed_experts=True,
                param_dtype=jnp.bfloat16)
    graph, params = nnx.split(layer)
    x = jax.random.normal(jax.random.key(4), (2, 24, cfg.hidden_size)).astype(jnp.bfloat16)
    ref, pal = both(lambda params, x: nnx.merge(graph, params)(x), params, x,
                    policy=KernelPolicy(prefill_pairs_per_expert=1))
    assert calls and pal.dtype == jnp.bfloat16
    assert rel_err(pal, ref) < 1e-2


@pytest.mark.parametrize("tokens, mesh, mosaic",
                         [(1, False, True), (3, False, True), (1, True, True), (1, True, False)])
def test_moe_layer_tiled_at_decode(monkeypatch, tokens, mesh, mosaic):
    """A bf16 decode step's routed experts, the kernels in interpret mode. Where the Mosaic GPU kernels run
    (``mosaic``: ``pallas_kernels._platform.mosaic_gpu_runs`` made to hold here): through ``tiled_moe_mx`` in
    tiles of ``SPARSE_BM`` pairs from 2 tokens (``KernelPolicy.split_moe_max_tokens_beside_tiled``), through the
    split kernels at one, and under an expert mesh (one device here; 3 in test_sharding.py) through the tiled
    MoE at one token too. Where they do not, under the mesh: through the sorted dispatch on the Triton grouped
    kernel (a shard_map whose output-variance check refused every pallas_call failed to trace here). All match
    the reference path within bf16 rounding."""
    from k3jax.sharding import expert_sharding, on_mesh
    from pallas_kernels.mx_matmul.mosaic_gpu_grouped import SPARSE_BM

    calls = []
    tiled = pallas_kernels.moe.ops.tiled_moe_mx
    monkeypatch.setattr(pallas_kernels._platform, "mosaic_gpu_runs", lambda: mosaic)
    monkeypatch.setattr(pallas_kernels.moe.ops, "tiled_moe_mx",
                        lambda *a, **kw: calls.append(kw["bm"]) or tiled(*a, **kw))
    cfg = preset("tiny")
    layer = MoE(cfg.hidden_size, cfg.moe, activation("situ"), cfg.rms_norm_eps, rngs=nnx.Rngs(3), packed_experts=True,
                param_dtype=jnp.bfloat16)
    graph, params = nnx.split(layer)
    x = jax.random.normal(jax.random.key(4), (tokens, 1, cfg.hidden_size)).astype(jnp.bfloat16)
    sharded = contextlib.nullcontext()
    if mesh:
        # Auto axes: on an Explicit mesh (make_mesh's default) the Pallas interpreter of the matvec kernels
        # meets a sharding-type error (JAX 0.10.2)
        experts_mesh = jax.make_mesh((1,), ("expert",), axis_types=(jax.sharding.AxisType.Auto,))
        sharded, place = on_mesh(experts_mesh), expert_sharding(experts_mesh, cfg.moe.num_experts)
        for name in ("w1", "w2", "w3"):
            var = params["experts"][name]
            var.set_value(jax.tree.map(lambda a: jax.device_put(a, place), var.get_value()))
    with sharded:
        ref, pal = both(lambda params, x: nnx.merge(graph, params)(x), params, x)
    assert calls == ([SPARSE_BM] if mosaic and (tokens > 1 or mesh) else [])
    assert rel_err(pal, ref) < 1e-2


def test_mla_layer_decode_one_row():
    """A batch-1 MLA prefill chunk (the flash-attention kernel) and decode step: the normed input's maps
    (q_a, kv_a, output gate) in one matvec kernel and q_a_layernorm + q_b_proj in another, against the
    reference path."""
    cfg = preset("tiny")
    layer = MLA(cfg.hidden_size, cfg.mla, rngs=nnx.Rngs(7))
    norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
    norm.weight.set_value(1.0 + jax.random.normal(jax.random.key(8), (cfg.hidden_size,)))
    graph, params = nnx.split((layer, norm))
    x = 2.0 * jax.random.normal(jax.random.key(9), (1, 6, cfg.hidden_size))

    def run(params, x):
        m, n = nnx.merge(graph, params)
        cache = m.init_cache(1, 8)
        y, cache = m.extend(x[:, :5], cache, jnp.zeros((1,), jnp.int32), norm=n)
        z, cache = m.extend(x[:, 5:], cache, jnp.full((1,), 5, jnp.int32), norm=n)
        return y, z, cache.c_kv

    ref, pal = both(run, params, x)
    for a, b in zip(ref, pal):
        assert rel_err(b, a) < 5e-3


def test_mla_layer_prefill_chunks():
    """Two prefill chunks of a batch whose sequences start at positions 0 and 3, the second chunk read
    through a window: the flash-attention kernel over expanded keys against the absorbed form."""
    cfg = preset("tiny")
    layer = MLA(cfg.hidden_size, cfg.mla, rngs=nnx.Rngs(10))
    graph, params = nnx.split(layer)
    x = 2.0 * jax.random.normal(jax.random.key(11), (2, 14, cfg.hidden_size))

    def run(params, x):
        m = nnx.merge(graph, params)
        cache, start = m.init_cache(2, 24), jnp.array([0, 3], jnp.int32)
        y, cache = m.extend(x[:, :7], cache, start)
        z, cache = m.extend(x[:, 7:], cache, start + 7, window=16)
        return y, z, cache.c_kv

    ref, pal = both(run, params, x)
    for a, b in zip(ref, pal):
        assert rel_err(b, a) < 1e-4


def test_mla_layer_full_sequence():
    """The expanded full-sequence form (``MLA.__call__``): the flash-attention kernel against the
    reference's materialized causal softmax."""
    cfg = preset("tiny")
    layer = MLA(cfg.hidden_size, cfg.mla, rngs=nnx.Rngs(12))
    graph, params = nnx.split(layer)
    x = 2.0 * jax.random.normal(jax.random.key(13), (2, 19, cfg.hidden_size))
    ref, pal = both(lambda params, x: nnx.merge(graph, params)(x), params, x)
    assert rel_err(pal, ref) < 1e-4


TRACE_TWICE = """
import jax, jax.numpy as jnp
from flax import nnx
from jax._src import config
from k3jax import K3Model, preset, use_implementation

model = K3Model(preset("tiny"), rngs=nnx.Rngs(0))
graph, params = nnx.split(model)
traces = []

def prefill(params, tokens):
    traces.append(1)
    m = nnx.merge(graph, params)
    return m.extend(tokens, m.init_cache(1, 32, scan_layers=False), jnp.zeros((1,), jnp.int32), None, False)[0]

with use_implementation("pallas"):
    before = len(config.trace_context())
    f = jax.jit(prefill)
    for _ in range(2):
        f.trace(params, jnp.ones((1, 16), jnp.int32))
    print(before, len(config.trace_context()), len(traces))
"""


def test_pallas_path_traces_once_in_a_fresh_process():
    """In a fresh process, the kernels the layers import on the Pallas path change no jit cache key: the
    trace context holds as many values after a prefill chunk's trace as before it, and tracing the same
    jitted chunk again finds the first trace (JAX 0.11 registers a config value in its Pallas TPU module,
    which ``pallas_kernels.kda`` imports: made inside the first trace, that import sent the next call to a
    second compile)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", TRACE_TWICE], capture_output=True, text=True, check=True)
    before, after, traces = map(int, out.stdout.split()[-3:])
    assert (after, traces) == (before, 1)
