"""The memory estimate's arguments: positive integers, each error naming its argument, in Python and on the command
line (one line on stderr, no traceback, from the installed entry as well). Per device on a mesh: the weights, caches
and communication against the shapes worked out by hand, and the weights and caches against what placement puts on
a device."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from k3jax.cli import main
from k3jax.memory import abstract_mesh, communication, device_weights, estimate, per_device, report
from k3jax.presets import preset

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "kwargs, error, name",
    [
        ({"context": -1}, ValueError, "context"),
        ({"context": 0}, ValueError, "context"),
        ({"batch": 0}, ValueError, "batch"),
        ({"cache_bytes": 0}, ValueError, "cache_bytes"),
        ({"context": 1.5}, TypeError, "context"),
        ({"batch": True}, TypeError, "batch"),
        ({"context": "4096"}, TypeError, "context"),
    ],
)
def test_estimate_refuses_bad_arguments(kwargs, error, name):
    args = {"context": 4096, "batch": 1, **kwargs}
    with pytest.raises(error, match=rf"^{name}: .*got {args[name]!r}"):
        estimate(preset("tiny"), **args)


def test_numpy_integers_are_integers():
    import numpy as np

    assert estimate(preset("tiny"), np.int64(4096), np.int32(2)) == estimate(preset("tiny"), 4096, 2)
    assert "context 4,096 tokens, batch 2" in report(preset("tiny"), np.int64(4096), np.int32(2))


@pytest.mark.parametrize("argv, flag", [(["--context", "-1", "--batch", "0"], "--context"),
                                        (["--batch", "0"], "--batch")])
def test_cli_refuses_bad_sizes_on_one_line(capsys, argv, flag):
    assert main(["memory", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"k3jax memory: error: {flag}: must be >= 1") and err.count("\n") == 1, err


def test_the_installed_entry_prints_no_traceback():
    """The issue's command in a process of its own: status 2, one line on stderr, nothing on stdout."""
    run = subprocess.run([sys.executable, "-m", "k3jax.cli", "memory", "--context", "-1", "--batch", "0"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 2, run.stderr
    assert run.stderr == "k3jax memory: error: --context: must be >= 1, got -1 (see k3jax memory --help)\n"
    assert run.stdout == ""


# tiny_mesh's sizes (k3jax/presets.py): width, vocabulary, KDA heads and head dim, MLA heads and its ranks and head
# dims, experts and their width F and latent R, the shared experts' and layer 0's MLP widths; 3 KDA and 1 MLA
# layers, layer 0 dense, 3 MoE layers, k = 2.
D, V, H, K, E, F, R, S, I = 48, 320, 4, 8, 8, 32, 64, 32, 72
Q, C, NOPE, ROPE, VH = 24, 16, 8, 4, 8
BF, F32, MX = 2, 4, 0.5 + 1 / 32


def _hand_weights(heads=1, dense=1, shared=1, vocab=1, experts=1):
    """tiny_mesh's bytes on one device from the shapes of docs/model.md section 8, each split dim divided by
    how many ways the mesh splits it (heads, dense MLP width, shared-expert width, vocabulary, experts)."""
    top = 2 * V * D * BF / vocab + 3 * D * BF  # embed and head; final norm, output AttnRes norm and proj [1, D]
    layer = 6 * D * BF  # input and post-attention norms, two AttnRes norm and proj pairs
    kda = ((5 * H * K * D * BF + H * D * BF + H * K * K * BF + 3 * H * K * 4 * F32 + H * F32 + H * K * F32) / heads
           + K * D * BF + K * BF)  # q k v g o, b, f_b, convs, A_log, dt_bias / f_a, o_norm
    mla = ((H * (NOPE + ROPE) * Q + H * (NOPE + VH) * C + 2 * D * H * VH) * BF / heads
           + (Q * D + Q + (C + ROPE) * D + C) * BF)  # q_b, kv_b, o, g / q_a and its norm, kv_a and its norm
    moe = (E * D * BF + E * F32 + 2 * R * D * BF + R * BF + 3 * S * D * BF / shared
           + 3 * E * F * R * MX / experts)  # router and bias, latent maps and norm, shared, routed stacks
    return top + 4 * layer + 3 * kda + mla + 3 * I * D * BF / dense + 3 * moe


@pytest.mark.parametrize("sizes, split", [
    ("data=2,expert=2,tensor=2", dict(heads=2, dense=2, shared=2, vocab=2, experts=4)),  # experts over expert x tensor
    ("tensor=8", dict(dense=8, shared=8, vocab=8, experts=8)),  # 4 heads stay whole; 8 experts over tensor alone
    ({"expert": 8}, dict(experts=8)),
    ("expert=2,tensor=3", dict(dense=3, experts=2)),  # 6 does not divide 8 experts, 2 does; only 72 divides by 3
    ("expert=3,tensor=3", dict(dense=3)),  # neither 9 nor 3 divides 8 experts; only layer 0's 72-wide MLP divides by 3
])
def test_weights_per_device_follow_the_shapes(sizes, split):
    assert device_weights(preset("tiny_mesh"), abstract_mesh(sizes)).total == pytest.approx(_hand_weights(**split),
                                                                                            rel=1e-12)


def test_one_device_walk_counts_float32_at_four_bytes():
    """``estimate`` counts every non-expert parameter at 2 bytes; the walk finds the float32 ones (KDA convs,
    A_log, dt_bias; the router bias) at 4."""
    float32 = 3 * (3 * H * K * 4 + H + H * K) + 3 * E
    walked = device_weights(preset("tiny_mesh"), abstract_mesh("")).total
    assert walked == _hand_weights() == estimate(preset("tiny_mesh"), 1).weights + 2 * float32


def _hand_caches(sequences, heads, context):
    """tiny_mesh's caches on one device, per sequence it holds: per KDA layer the float32 state [heads, K, K] and
    the q, k, v convs' last 3 inputs [3 * H * K] (channels side by side, whole over tensor); per MLA layer the bf16
    latents [context, C + ROPE]."""
    return sequences * 3 * F32 * (heads * K * K + 3 * 3 * H * K), sequences * context * BF * (C + ROPE)


@pytest.mark.parametrize("sizes, batch, sequences, heads", [
    ("data=2,expert=2,tensor=2", 4, 1, 2),  # batch over data x expert, KDA heads over tensor
    ("data=2,expert=2,tensor=2", 6, 3, 2),  # 4 does not divide 6: over data alone
    ("data=2,tensor=8", 3, 3, 4),  # 2 does not divide 3: whole; 8 does not divide 4 heads
    ("expert=4", 8, 2, 4),  # the attention data-parallel over expert
    ("expert=3,tensor=3", 3, 1, 4),
])
def test_caches_per_device(sizes, batch, sequences, heads):
    d = per_device(preset("tiny_mesh"), sizes, context=100, batch=batch)
    assert (d.sequences, d.kda_heads) == (sequences, heads)
    assert (d.kda_state, d.mla_cache) == _hand_caches(sequences, heads, 100)  # every head reads all the latents
    assert d.total == d.weights.total + d.kda_state + d.mla_cache


# Communication per token of a data group, by hand: a device's share of the group's tokens in each layout, the
# bytes a reshard must bring it (what of its new share it did not hold), a ring all-reduce 2(n-1)/n of the buffer,
# an all-gather (n-1)/n of the result; rows R wide in bf16, the psum in float32, k = 2 pairs a token.
KP = 2
REDUCE = lambda n, nbytes: 2 * (n - 1) / n * nbytes  # noqa: E731
GATHER = lambda n, nbytes: (n - 1) / n * nbytes  # noqa: E731


def test_communication_attention_data_parallel_over_expert():
    """data=2, expert=2, tensor=2, batch 4: each device attends for 1 of its data group's 2 sequences."""
    c = communication(preset("tiny_mesh"), abstract_mesh("data=2,expert=2,tensor=2"), 4)
    reduce_d = REDUCE(2, D * BF) / 2  # over tensor=2, half the group's tokens
    assert c.kda_attention == c.mla_attention == c.dense_mlp == c.shared_experts == c.embedding == reduce_d
    assert c.head == GATHER(2, V * F32) / 2
    # exchanged: a quarter of the tokens a device (cut from its half, nothing sent), 2 pairs each, out and back,
    # 3 of 4 destinations elsewhere; then its quarter gathered with its tensor partner's back into the half
    assert c.moe_exchanged == pytest.approx(2 * KP * R * BF * (3 / 4) / 4 + GATHER(2, R * BF / 2))
    # replicated: its half gathered with its expert partner's into all the group's tokens, a psum of float32
    # rows over the 4 devices, then each keeps its own half
    assert c.moe_replicated == pytest.approx(GATHER(2, R * BF) + REDUCE(4, R * F32))


def test_communication_batch_over_data_alone():
    """batch 2 on the same mesh: 4 does not divide it, so each data group attends for its 1 sequence whole."""
    c = communication(preset("tiny_mesh"), abstract_mesh("data=2,expert=2,tensor=2"), 2)
    assert c.kda_attention == c.embedding == REDUCE(2, D * BF)
    assert c.head == GATHER(2, V * F32)
    # exchanged rows: the quarter comes back to every device of the group: a gather over 4 devices
    assert c.moe_exchanged == pytest.approx(2 * KP * R * BF * (3 / 4) / 4 + GATHER(4, R * BF))
    assert c.moe_replicated == pytest.approx(REDUCE(4, R * F32))  # the tokens already on every device


def test_communication_experts_over_expert_alone():
    """expert=2, tensor=3, batch 2: 8 experts over expert (6 does not divide them), each device attends for one
    sequence; the MoE's tokens: a sixth a device (exchanged) or a third, over tensor (replicated)."""
    c = communication(preset("tiny_mesh"), abstract_mesh("expert=2,tensor=3"), 2)
    assert c.kda_attention == c.mla_attention == c.shared_experts == c.embedding == c.head == 0  # 4, 32, 320 by 3
    assert c.dense_mlp == pytest.approx(REDUCE(3, D * BF) / 2)
    # exchanged: 2 pairs out and back, half of them to the other expert device; then a gather over tensor
    assert c.moe_exchanged == pytest.approx(2 * KP * R * BF * (1 / 2) / 6 + GATHER(3, R * BF / 2))
    # replicated: a device holding half (its expert index) needs a third (its tensor index): it lacks 1/3 - 1/6
    # (the two overlap in 1/6 on average); the psum over expert=2 of its third; back it lacks 1/2 - 1/6
    assert c.moe_replicated == pytest.approx((1 / 3 - 1 / 6) * R * BF + REDUCE(2, R * F32) / 3
                                             + (1 / 2 - 1 / 6) * R * BF)


@pytest.mark.parametrize("batch, attended", [(3, 1 / 3), (1, 1)])
def test_communication_with_whole_experts(batch, attended):
    """expert=3, tensor=3: the stacks stay whole; both forms split the tokens over all 9 devices and gather them
    back to where the attention has them (a third of them with batch 3, all with batch 1)."""
    c = communication(preset("tiny_mesh"), abstract_mesh("expert=3,tensor=3"), batch)
    assert c.kda_attention == c.mla_attention == c.shared_experts == c.embedding == c.head == 0
    assert c.dense_mlp == pytest.approx(REDUCE(3, D * BF) * attended)
    assert c.moe_exchanged == c.moe_replicated == pytest.approx((attended - 1 / 9) * R * BF)


@pytest.mark.parametrize("mesh, message", [("expert=8,tensr=2", "'tensr=2'"), ({"expert": 0}, "must be >= 1"),
                                           ({"pipeline": 2}, "unknown axes")])
def test_bad_mesh_is_named(mesh, message):
    with pytest.raises(ValueError, match=message):
        per_device(preset("tiny_mesh"), mesh, 100)


def test_cli_names_mesh_on_one_line(capsys):
    assert main(["memory", "--mesh", "expert=8,tensor=x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("k3jax memory: error: --mesh: 'tensor=x'; expected axis=size") and err.count("\n") == 1


PLACED = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    from flax import nnx
    from k3jax.memory import abstract_mesh, device_weights, per_device
    from k3jax.model import K3Model
    from k3jax.presets import preset
    from k3jax.sharding import make_mesh, param_spec, place
    from k3jax.sharding.mesh import constrain_cache
    from k3jax.sharding.rules import spec_bytes

    cfg = preset("tiny_mesh")
    # K3Model's own structure and dtypes holding zeros: placement reads only shapes, and drawing the random
    # weights compiles ~70 small programs (12 s on a 2-core CPU)
    graph, state = nnx.split(nnx.eval_shape(lambda: K3Model(cfg, rngs=nnx.Rngs(0), param_dtype=jnp.bfloat16)))
    model = nnx.merge(graph, jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), state))
    first = jax.devices()[0]
    # (mesh, experts a device holds: 8 over expert x tensor, batch, the sequences a device holds caches for)
    for sizes, experts, batch, sequences in (("data=2,expert=2,tensor=2", 2, 4, 1), ("expert=4,tensor=2", 1, 4, 1),
                                             ("data=2,expert=2,tensor=2", 2, 6, 3)):
        mesh = make_mesh(sizes)
        held, shapes = {}, {}
        for path, var in nnx.to_flat_state(nnx.state(place(model, mesh))):
            for sub, leaf in jax.tree_util.tree_leaves_with_path(var.get_value()):
                name = ".".join(map(str, (*path, *(key.name for key in sub))))  # an MXTensor's .codes, .scales
                shard = next(s for s in leaf.addressable_shards if s.device == first)
                held[name], shapes[name] = shard.data.nbytes, (tuple(leaf.shape), leaf.dtype.itemsize)
        assert sum(held.values()) == device_weights(cfg, abstract_mesh(sizes)).total, sizes
        for name in ("embed_tokens.weight", "layers.0.self_attn.q_proj.weight", "layers.0.self_attn.A_log",
                     "layers.3.self_attn.kv_b_proj.weight", "layers.1.block_sparse_moe.experts.w2.codes",
                     "layers.1.block_sparse_moe.routed_expert_down_proj.weight"):
            shape, itemsize = shapes[name]
            want = spec_bytes(shape, itemsize, param_spec(cfg, name, shape, mesh), mesh)
            assert held[name] == want, (sizes, name, held[name], want)
        assert held["layers.1.block_sparse_moe.experts.w2.codes"] == experts * 64 * 16, sizes  # [E/n, R, F/2]
        # the inference cache (MLA latents in bf16) held where the model holds it (constrain_cache, in a jit)
        cache = jax.jit(lambda c: constrain_cache(c, mesh))(model.init_cache(batch, 100, jnp.bfloat16))
        kda = mla = 0
        for path, leaf in jax.tree_util.tree_leaves_with_path(cache):
            nbytes = next(s for s in leaf.addressable_shards if s.device == first).data.nbytes
            if path[-1].name in ("conv", "recurrent"):
                kda += nbytes
            else:
                mla += nbytes
        d = per_device(cfg, sizes, context=100, batch=batch)
        assert (kda, mla) == (d.kda_state, d.mla_cache) and d.sequences == sequences, (sizes, batch, kda, mla, d)
        print(sizes, batch, sum(held.values()), kda, mla)
    """
)


def test_placed_bytes_equal_the_estimate():
    """Each parameter placed by ``k3jax.sharding.place`` on 8 CPU devices: device 0's shards add up to
    ``device_weights``, and a few of them to what their rules-table spec says; the inference cache held by
    ``constrain_cache``: device 0's shards add up to ``per_device``'s KDA state and MLA cache."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", PLACED], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
