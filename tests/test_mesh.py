"""The whole model on a mesh of 8 simulated CPU devices (data x expert x tensor): logits, forced routing and decode
after prefill equal one device's, float32 on the reference path, within rounding (summation order: the tensor
split's partial sums, the experts' exchange); generation gives the same tokens and compiles its decode call once. Runs in a subprocess: the device count is fixed at start."""

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    from flax import nnx
    from k3jax.implementation import KernelPolicy, use_implementation
    from k3jax.inference import Generator
    from k3jax.model import K3Model
    from k3jax.presets import preset
    from k3jax.sharding import make_mesh, on_mesh, place, place_batch

    assert len(jax.devices()) == 8
    TOL = 1e-4  # of the largest |logit|; a wrong split, route or exchange is off by O(1)

    def close(got, want, what):
        err = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
        print(what, f"{err:.1e}", flush=True)
        assert err < TOL, (what, err)

    def forward(model, tokens, mesh=None, exchange_from=1):
        graph, params = nnx.split(model)
        run = jax.jit(lambda p, t: nnx.merge(graph, p)(t))
        if mesh is None:
            return run(params, tokens)
        policy = KernelPolicy(expert_exchange_min_tokens=exchange_from)
        with on_mesh(mesh), use_implementation("reference", policy):
            return run(nnx.split(place(model, mesh))[1], place_batch(tokens, mesh))

    def routed_to(model, experts, bias):
        for layer in model.layers:
            if hasattr(layer, "block_sparse_moe"):
                gate = layer.block_sparse_moe.gate.e_score_correction_bias
                gate.set_value(gate[...].at[jnp.asarray(experts)].set(bias))
        return model

    EXCHANGE, REPLICATED = 1, 10**9
    tokens = jax.random.randint(jax.random.key(1), (4, 19), 0, 320)
    # (preset, mesh, MoE form): every mesh of the issue for the K3-shaped tiny_mesh, both MoE forms; tiny's 3
    # heads and 6 experts split where they divide and stay whole where not
    cases = [("tiny_mesh", "expert=8", EXCHANGE), ("tiny_mesh", "data=2,expert=4", REPLICATED),
             ("tiny_mesh", "expert=2,tensor=4", EXCHANGE), ("tiny_mesh", "data=2,expert=2,tensor=2", REPLICATED),
             ("tiny", "data=2,expert=2,tensor=2", EXCHANGE), ("tiny", "expert=8", REPLICATED)]
    models = {name: K3Model(preset(name), rngs=nnx.Rngs(0)) for name in ("tiny_mesh", "tiny")}
    want = {name: forward(model, tokens) for name, model in models.items()}
    for name, mesh, form in cases:
        close(forward(models[name], tokens, make_mesh(mesh), form), want[name], f"{name} {mesh} form {form}")

    # every pair routed to the two experts of one device: its buffer takes them all, none dropped
    forced = routed_to(K3Model(preset("tiny_mesh"), rngs=nnx.Rngs(2)), [4, 5], 50.0)
    load = forced.inspect(tokens).stats.expert_load
    moe = load.sum(axis=1) > 0
    assert bool(jnp.all(load[moe][:, 4:6].sum(axis=1) == load[moe].sum(axis=1))), load
    close(forward(forced, tokens, make_mesh("data=2,expert=4"), EXCHANGE), forward(forced, tokens),
          "forced onto experts 4, 5 (one device)")

    # decode after prefill: two prompts of different lengths, then three greedy steps
    prompts = [[5, 9, 11, 200, 3, 17, 8], [42, 7, 300]]
    def decode(model, mesh=None):
        gen = Generator(model if mesh is None else place(model, mesh), max_len=16, prefill_chunk=4, mesh=mesh)
        logits, cache = gen.prefill(prompts, gen.init_cache(2))
        positions = jnp.asarray([len(p) for p in prompts], jnp.int32)
        out, next_tokens = [logits], jnp.argmax(logits, axis=-1).astype(jnp.int32)
        for step in range(3):
            next_tokens, logits, cache = gen.decode_step(next_tokens, cache, positions + step, jax.random.key(0))
            out.append(logits)
        return jnp.stack(out)
    mesh = make_mesh("data=2,expert=2,tensor=2")
    close(decode(models["tiny_mesh"], mesh), decode(models["tiny_mesh"]), "prefill + 3 decode steps, 2x2x2")

    # generate: the same greedy tokens, and on the mesh its decode call compiles once (the cache, tokens and
    # positions go back in where they came out)
    sharded = Generator(place(models["tiny_mesh"], mesh), max_len=40, prefill_chunk=4, mesh=mesh)
    got = sharded.generate(prompts, 24).tokens
    assert got == Generator(models["tiny_mesh"], max_len=40, prefill_chunk=4).generate(prompts, 24).tokens, got
    assert sharded._decode_steps._cache_size() == 1
    print("ok")
    """
)


def test_model_on_a_mesh_equals_one_device():
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.endswith("ok\n"), done.stdout + done.stderr
