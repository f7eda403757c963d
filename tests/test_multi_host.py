"""Two processes over loopback (``jax.distributed``, gloo CPU collectives), 4 simulated CPU devices each, one
mesh data=2, expert=2, tensor=2 over all 8 with the processes along ``expert``: each loads a converted tiny_mesh
checkpoint onto the mesh reading only the rows its devices hold (counted with the kernel's rchar), runs the
forward on a batch built from the rows each process's devices hold, and gathers logits equal to one device's."""

import json
import os
import socket
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from convert.conversion import convert
from convert.synthetic import write_synthetic
from k3jax.checkpoint import load
from k3jax.presets import preset_hf_config

WORKER = textwrap.dedent("""
    import json, sys
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    pid, port, ckpt, folder = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid, initialization_timeout=60)
    import jax.numpy as jnp, numpy as np
    from flax import nnx
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding
    import convert.conversion, convert.integrity  # imported before reads are counted
    from k3jax.checkpoint import load
    from k3jax.mx import MXTensor
    from k3jax.sharding import make_mesh, on_mesh
    from k3jax.sharding.mesh import place_local_batch
    from k3jax.sharding.rules import batch_spec

    def rchar():  # bytes this process has read through read(2) and friends
        return int(next(l for l in open("/proc/self/io") if l.startswith("rchar")).split()[1])

    local = [[d for d in jax.devices() if d.process_index == p] for p in range(2)]
    mesh = make_mesh("data=2,expert=2,tensor=2",
                     devices=[local[e][2 * d + t] for d in range(2) for e in range(2) for t in range(2)])
    before = rchar()
    model = load(ckpt, mesh=mesh, dtype=jnp.float32)
    read = rchar() - before

    params = json.load(open(f"{ckpt}/k3jax_checkpoint.json"))["params"]
    itemsize = {"BF16": 2, "F16": 2, "F32": 4, "MXFP4": 1}
    needed = 0  # bytes of the distinct row ranges this process's shards cover, in the stored dtypes
    for key, var in nnx.to_flat_state(nnx.state(model)):
        name = ".".join(map(str, key))
        value = var.get_value()
        for leaf in (value.codes, value.scales) if isinstance(value, MXTensor) else (value,):
            ranges = {s.index[0].indices(leaf.shape[0])[:2] for s in leaf.addressable_shards}
            row = np.prod(leaf.shape[1:], dtype=int) * itemsize[params[name]["dtype"]]
            needed += sum(stop - start for start, stop in ranges) * int(row)
            if ".experts." in name:  # this process is expert index pid: it holds experts 4 pid .. 4 pid + 3
                assert {e for a, b in ranges for e in range(a, b)} == set(range(4 * pid, 4 * pid + 4)), ranges

    tokens = np.load(f"{folder}/tokens.npy")
    held = NamedSharding(mesh, batch_spec(len(tokens), mesh, 2)).addressable_devices_indices_map(tokens.shape)
    rows = np.concatenate([tokens[a:b] for a, b in sorted({i[0].indices(len(tokens))[:2] for i in held.values()})])
    graph, state = nnx.split(model)
    with on_mesh(mesh):
        logits = jax.jit(lambda p, t: nnx.merge(graph, p)(t))(state, place_local_batch(rows, mesh, len(tokens)))
    np.save(f"{folder}/logits{pid}.npy", multihost_utils.process_allgather(logits, tiled=True))
    json.dump({"read": read, "needed": needed}, open(f"{folder}/read{pid}.json", "w"))
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _data_bytes(ckpt) -> tuple[int, int]:
    """Bytes of every array file in the checkpoint, and of the routed experts' files."""
    parts = json.loads((ckpt / "k3jax_checkpoint.json").read_text())["parts"]
    files = {f: n for p in parts.values() for f, n in p["files"].items() if "/" in f and not f.endswith(".zarray")}
    return sum(files.values()), sum(n for f, n in files.items() if ".experts." in f)


def test_two_processes_load_their_slices_and_match_one_device(tmp_path):
    hf = preset_hf_config("tiny_mesh")
    hf["text_config"].update(moe_intermediate_size=96, routed_expert_hidden_size=128)  # experts: most bytes
    write_synthetic(tmp_path / "released", hf, seed=7)
    ckpt = convert(tmp_path / "released", tmp_path / "ckpt", quiet=True, part_bytes=200_000)
    tokens = np.random.default_rng(3).integers(0, 320, (4, 13)).astype(np.int32)
    np.save(tmp_path / "tokens.npy", tokens)
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    port = _free_port()
    logs = [tmp_path / f"log{i}.txt" for i in range(2)]
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(i), str(port), str(ckpt), str(tmp_path)], env=env,
                              stdout=log.open("w"), stderr=subprocess.STDOUT) for i, log in enumerate(logs)]
    try:
        graph, state = nnx.split(load(ckpt, dtype=jnp.float32))  # meanwhile: one device, one process
        want = np.asarray(jax.jit(lambda p, t: nnx.merge(graph, p)(t))(state, tokens))
        for p in procs:
            p.wait(timeout=180)  # a hung coordinator or collective fails here
    finally:
        for p in procs:
            p.kill()
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log.read_text()[-4000:]
    total, experts = _data_bytes(ckpt)
    metadata = sum(f.stat().st_size for f in (ckpt / "k3jax_checkpoint.json", ckpt / "config.json",
                                              *ckpt.rglob(".zarray")))
    for i in range(2):
        got = np.load(tmp_path / f"logits{i}.npy")
        assert got.shape == want.shape
        err = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
        assert err < 1e-4, (i, err)
        read = json.loads((tmp_path / f"read{i}.json").read_text())
        assert read["needed"] == total - experts // 2, (read, total, experts)  # all but the other's experts
        assert 0 <= read["read"] - read["needed"] - metadata < 16_384, (read, metadata)
