"""Expert parallelism: the MoE under shard_map over 3 (simulated CPU) devices equals the unsharded
MoE, with the expert stacks really split. Runs in a subprocess: the device count is fixed at start."""

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import jax, jax.numpy as jnp
    from flax import nnx
    from k3jax.layers.mlp import activation
    from k3jax.layers.moe import MoE
    from k3jax.presets import preset
    from k3jax.sharding import expert_sharding, on_mesh

    cfg = preset("tiny")
    assert len(jax.devices()) == 3
    mesh = jax.make_mesh((3,), ("expert",), axis_types=(jax.sharding.AxisType.Auto,))
    for packed in (False, True):
        moe = MoE(cfg.hidden_size, cfg.moe, activation("situ"), cfg.rms_norm_eps, rngs=nnx.Rngs(1),
                  packed_experts=packed)
        moe.gate.e_score_correction_bias.set_value(jax.random.normal(jax.random.key(2), (cfg.moe.num_experts,)))
        graph, params = nnx.split(moe)
        x = jax.random.normal(jax.random.key(3), (2, 9, cfg.hidden_size))
        run = jax.jit(lambda p, x: nnx.merge(graph, p)(x))
        want = run(params, x)
        place = expert_sharding(mesh, cfg.moe.num_experts)
        sharded = jax.tree.map(lambda a: a, params)
        for name in ("w1", "w2", "w3"):
            var = sharded["experts"][name]
            var.set_value(jax.tree.map(lambda a: jax.device_put(a, place), var.get_value()))
        leaf = jax.tree.leaves(sharded["experts"]["w1"])[0]
        assert len(leaf.addressable_shards) == 3 and leaf.addressable_shards[0].data.shape[0] == 2
        with on_mesh(mesh):
            got = jax.jit(lambda p, x: nnx.merge(graph, p)(x))(sharded, x)
        err = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
        print("packed", packed, "rel err", err)
        assert err < 1e-5, err
    """
)


def test_expert_parallel_moe_equals_unsharded():
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=3", "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
