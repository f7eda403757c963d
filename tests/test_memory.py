"""The memory estimate's arguments: positive integers, each error naming its argument, in Python and on the command
line (one line on stderr, no traceback, from the installed entry as well). Per device on a mesh: the weights, caches
and communication against the shapes worked out by hand, and the weights against what placement puts on a device."""

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
# dims, experts and their width F and latent R, the shared experts' and layer 0's MLP widths; 6 KDA and 2 MLA
# layers, layer 0 dense, 7 MoE layers, k = 2.
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
    return top + 8 * layer + 6 * kda + 2 * mla + 3 * I * D * BF / dense + 7 * moe


@pytest.mark.parametrize("sizes, split", [
    ("data=2,expert=2,tensor=2", dict(heads=2, dense=2, shared=2, vocab=2, experts=2)),
    ("tensor=8", dict(dense=8, shared=8, vocab=8)),  # 4 heads stay whole
    ({"expert": 8}, dict(experts=8)),
    ("expert=3,tensor=3", dict(dense=3)),  # only layer 0's 72-wide MLP divides by 3
])
def test_weights_per_device_follow_the_shapes(sizes, split):
    assert device_weights(preset("tiny_mesh"), abstract_mesh(sizes)).total == pytest.approx(_hand_weights(**split),
                                                                                            rel=1e-12)


def test_one_device_walk_counts_float32_at_four_bytes():
    """``estimate`` counts every non-expert parameter at 2 bytes; the walk finds the float32 ones (KDA convs,
    A_log, dt_bias; the router bias) at 4."""
    float32 = 6 * (3 * H * K * 4 + H + H * K) + 7 * E
    walked = device_weights(preset("tiny_mesh"), abstract_mesh("")).total
    assert walked == _hand_weights() == estimate(preset("tiny_mesh"), 1).weights + 2 * float32


def test_caches_per_device():
    d = per_device(preset("tiny_mesh"), "data=2,expert=2,tensor=2", context=100, batch=4)
    state = (H // 2) * K * K + 3 * 3 * (H // 2) * K  # half the heads: state, q k v conv inputs
    assert (d.sequences, d.kda_heads) == (2, 2)
    assert d.kda_state == 2 * 6 * 4 * state
    assert d.mla_cache == 2 * 100 * 2 * BF * (C + ROPE)  # every device holds every head's latents
    assert d.total == d.weights.total + d.kda_state + d.mla_cache
    odd = per_device(preset("tiny_mesh"), "data=2,tensor=8", context=100, batch=3)  # 3 over data=2: whole
    assert (odd.sequences, odd.kda_heads) == (3, 4)


def test_communication_per_token():
    c = communication(preset("tiny_mesh"), abstract_mesh("data=2,expert=2,tensor=2"))
    reduce_d = 2 * (1 / 2) * D * BF  # ring all-reduce over tensor=2 of a [D] bf16 row
    assert c.kda_attention == c.mla_attention == c.dense_mlp == c.shared_experts == c.embedding == reduce_d
    # exchanged: 2 pairs a token, a row out and back, half leave, tokens over expert x tensor = 4; gather 3/4
    assert c.moe_exchanged == pytest.approx(2 * 2 * R * BF * (1 / 2) / 4 + (3 / 4) * R * BF)
    # replicated: psum over expert=2 of float32 rows, a device holding half the tokens; gather 1/2 over tensor
    assert c.moe_replicated == pytest.approx(2 * (1 / 2) * R * F32 / 2 + (1 / 2) * R * BF)
    assert c.head == (1 / 2) * V * F32
    odd = communication(preset("tiny_mesh"), abstract_mesh("expert=3,tensor=3"))
    assert odd.kda_attention == odd.mla_attention == odd.shared_experts == odd.embedding == odd.head == 0
    assert odd.dense_mlp == pytest.approx(2 * (2 / 3) * D * BF)
    assert odd.moe_exchanged == odd.moe_replicated == pytest.approx((8 / 9) * R * BF)  # no exchange, a gather


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
    from k3jax.memory import abstract_mesh, device_weights
    from k3jax.model import K3Model
    from k3jax.presets import preset
    from k3jax.sharding import make_mesh, param_spec, place
    from k3jax.sharding.rules import spec_bytes

    cfg = preset("tiny_mesh")
    # K3Model's own structure and dtypes holding zeros: placement reads only shapes, and drawing the random
    # weights compiles ~70 small programs (12 s on a 2-core CPU)
    graph, state = nnx.split(nnx.eval_shape(lambda: K3Model(cfg, rngs=nnx.Rngs(0), param_dtype=jnp.bfloat16)))
    model = nnx.merge(graph, jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), state))
    first = jax.devices()[0]
    for sizes, experts in (("data=2,expert=2,tensor=2", 4), ("expert=4,tensor=2", 2)):  # experts a device holds
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
        assert held["layers.1.block_sparse_moe.experts.w2.codes"] == experts * 64 * 16, sizes  # [E/e, R, F/2]
        print(sizes, sum(held.values()))
    """
)


def test_placed_bytes_equal_the_estimate():
    """Each parameter placed by ``k3jax.sharding.place`` on 8 CPU devices: device 0's shards add up to
    ``device_weights``, and a few of them to what their rules-table spec says."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", PLACED], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
