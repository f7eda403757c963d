"""Safetensors IO against the ``safetensors`` library (independent reader/writer); loading onto a mesh."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from convert import convert, export_checkpoint, read_params, write_synthetic
from convert.names import a_log_to_canonical, a_log_to_released
from convert.safetensors_io import CheckpointError, dtype_name, read_header, read_tensor, write_safetensors
from convert.testing import edit_tensors, k3_config, linear_config, same_bytes


def _arrays(rng):
    return {
        "b.weight": rng.standard_normal((7, 33)).astype(np.float32),
        "a.codes": rng.integers(0, 256, (5, 3, 17), dtype=np.uint8),
        "c.index": rng.integers(-9, 9, (11,), dtype=np.int64),
        "d.half": rng.standard_normal((3, 5)).astype(np.float16),
    }


def test_our_writer_read_by_safetensors(tmp_path):
    arrays = _arrays(np.random.default_rng(0))
    path = tmp_path / "ours.safetensors"
    write_safetensors(path, [(n, dtype_name(a.dtype), a.shape) for n, a in arrays.items()], arrays.__getitem__,
                      {"format": "pt"})
    got = load_file(path)
    assert got.keys() == arrays.keys()
    for n, a in arrays.items():
        assert got[n].dtype == a.dtype and np.array_equal(got[n], a), n


def test_safetensors_writer_read_by_ours(tmp_path):
    arrays = _arrays(np.random.default_rng(1))
    path = tmp_path / "theirs.safetensors"
    save_file(arrays, path, metadata={"format": "pt"})
    infos, meta = read_header(path)
    assert meta == {"format": "pt"} and {t.name for t in infos} == arrays.keys()
    for t in infos:
        assert np.array_equal(read_tensor(t), arrays[t.name]) and read_tensor(t).dtype == arrays[t.name].dtype


def test_rewriting_a_safetensors_file_is_byte_identical(tmp_path):
    path = tmp_path / "theirs.safetensors"
    save_file(_arrays(np.random.default_rng(3)), path, metadata={"format": "pt"})
    infos, meta = read_header(path)
    again = tmp_path / "ours.safetensors"
    write_safetensors(again, [(t.name, t.dtype, t.shape) for t in infos], {t.name: read_tensor(t) for t in infos}.get, meta)
    assert again.read_bytes() == path.read_bytes()


def test_dense_mlp_alias_block_sparse_moe(tmp_path):
    folder = tmp_path / "released"
    _, params = write_synthetic(folder, linear_config(), seed=6)
    old = "model.layers.0.mlp."
    edit_tensors(folder, lambda t: {n.replace(old, "model.layers.0.block_sparse_moe."): a for n, a in t.items()})
    out = convert(folder, tmp_path / "k3jax", quiet=True)
    got = read_params(out)
    assert same_bytes(got["layers.0.mlp.down_proj.weight"], params["layers.0.mlp.down_proj.weight"])
    back = export_checkpoint(out, tmp_path / "back")
    for p in folder.iterdir():
        assert (back / p.name).read_bytes() == p.read_bytes(), p.name


def test_header_overlap_and_trailing_bytes(tmp_path):
    path = tmp_path / "x.safetensors"
    a = np.arange(6, dtype=np.float32)
    write_safetensors(path, [("x", "F32", (6,))], {"x": a}.__getitem__)
    path.write_bytes(path.read_bytes() + b"\0" * 4)
    with pytest.raises(CheckpointError, match=r"x.safetensors: corrupt: 4 unexpected trailing bytes"):
        read_header(path)
    header = b'{"p":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"q":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}'
    path.write_bytes(len(header).to_bytes(8, "little") + header + bytes(12))
    with pytest.raises(CheckpointError, match=r"tensors 'p' and 'q' overlap"):
        read_header(path)
    header = b'{"p":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}'
    path.write_bytes(len(header).to_bytes(8, "little") + header + bytes(8))
    with pytest.raises(CheckpointError, match=r"tensor 'p': data_offsets \[0, 8\] span 8 bytes but F32 \(3,\) needs 12"):
        read_header(path)


@pytest.mark.parametrize("shape", [(128,), (1, 1, 5, 1)])
def test_a_log_layouts_round_trip(shape):
    released = np.random.default_rng(2).standard_normal(shape).astype(np.float32)
    canonical, tail = a_log_to_canonical(released, 5)
    assert canonical.shape == (5,)
    assert np.array_equal(a_log_to_released(canonical, shape, tail), released)


def test_load_onto_mesh_splits_experts(tmp_path):
    folder = tmp_path / "released"
    write_synthetic(folder, k3_config(), seed=4)
    script = textwrap.dedent(f"""
        import jax, numpy as np
        from jax.sharding import Mesh, PartitionSpec as P
        from k3jax.checkpoint import load
        mesh = Mesh(np.array(jax.devices()).reshape(1, 2), ("data", "expert"))
        model = load({str(folder)!r}, mesh=mesh)
        w1 = model.layers[1].block_sparse_moe.experts.w1.get_value()
        w1 = getattr(w1, "codes", w1)
        assert w1.sharding.spec == P("expert", None, None), w1.sharding
        assert w1.addressable_shards[0].data.shape[0] == 3
        q = model.layers[0].self_attn.q_proj.weight[...]
        assert q.sharding.spec == P(None, None) and q.sharding.mesh.shape == {{"data": 1, "expert": 2}}
        print("ok")
    """)
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, env=env, timeout=300)
    assert proc.returncode == 0 and b"ok" in proc.stdout, proc.stderr.decode()[-3000:]


def test_stored_arrays_read_the_rows_asked_for(tmp_path):
    from convert.orbax_io import map_part, write_part

    rng = np.random.default_rng(5)
    arrays = {"p.w": rng.standard_normal((7, 5, 3)).astype(np.dtype("bfloat16")),
              "q": rng.integers(0, 256, (11, 9), dtype=np.uint8), "r": rng.standard_normal(13).astype(np.float32)}
    write_part(tmp_path / "part", arrays)
    mapped = map_part(tmp_path / "part")
    assert mapped.keys() == arrays.keys()
    for key, want in arrays.items():
        got = mapped[key]
        assert got.shape == want.shape and got.dtype == want.dtype
        assert same_bytes(np.asarray(got), want)
        for index in ((slice(2, 5),), (slice(None), slice(1, 4)), (slice(3, 4), slice(None)), (slice(5, None),)):
            index = index[:want.ndim]
            assert same_bytes(got[index], want[index]), (key, index)
    zarray = tmp_path / "part" / "q" / ".zarray"
    zarray.write_text(zarray.read_text().replace("[11,9]", "[12,9]").replace("[11, 9]", "[12, 9]"))
    with pytest.raises(CheckpointError, match=r"q/0\.0: 99 bytes but its \.zarray says uint8 \[12, 9\]"):
        map_part(tmp_path / "part")


def test_k3jax_checkpoint_onto_a_mesh_equals_one_device(tmp_path):
    folder = tmp_path / "released"
    write_synthetic(folder, k3_config(), seed=6)
    ckpt = convert(folder, tmp_path / "ckpt", quiet=True, part_bytes=40_000)
    script = textwrap.dedent(f"""
        import jax, jax.numpy as jnp, numpy as np
        from flax import nnx
        from k3jax.checkpoint import load
        from k3jax.sharding import make_mesh
        mesh = make_mesh("expert=2,tensor=2")
        for kw in ({{}}, {{"verify": True}}, {{"packed_experts": False}}, {{"dtype": jnp.float32}}):
            one = jax.tree.leaves(nnx.state(load({str(ckpt)!r}, **kw)))
            split = jax.tree.leaves(nnx.state(load({str(ckpt)!r}, mesh=mesh, **kw)))
            assert len(one) == len(split) and any(not a.sharding.is_fully_replicated for a in split)
            for a, b in zip(one, split):
                assert a.dtype == b.dtype and np.asarray(a).tobytes() == np.asarray(b).tobytes(), kw
        print("ok")
    """)
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, env=env, timeout=300)
    assert proc.returncode == 0 and b"ok" in proc.stdout, proc.stderr.decode()[-3000:]
