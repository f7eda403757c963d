"""The tiled MoE (``pallas_kernels/moe/mosaic_gpu_tiled.py``: the routed experts by the grouped Mosaic GPU kernel
in its tiled layout, interpret mode on CPU) against the sorted and dense dispatches; its pairs' slots, its expert
shards and its Mosaic GPU lowering."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.functional.moe import grouped_matmul, moe_dense, moe_sorted, situ
from k3jax.mx import MXTensor
from mx_inputs import bf16_normal, expert_stacks
from pallas_kernels.moe.mosaic_gpu_tiled import pair_slots, tiled_moe_mx
from pallas_kernels.mx_matmul.mosaic_gpu import MosaicBlocks
from reference_numpy import rel_err


@pytest.mark.parametrize("tokens,k,experts,bm", [(13, 3, 7, 8), (40, 8, 5, 64)])
def test_pair_slots_follow_the_stable_sort(tokens, k, experts, bm):
    """``pair_slots`` (counting) against a loop over the pairs in numpy's stable sort by expert: random ids
    with repeats within a token and ids past the experts (another device's), tiles of bm slots per expert."""
    ids = np.asarray(jax.random.randint(jax.random.key(tokens), (tokens, k), 0, experts + 2), np.int32)
    flat = ids.reshape(-1)
    bound = (-(-flat.size // bm) + min(experts, flat.size)) * bm
    expected, row, last = np.full(flat.size, bound), -bm, None
    for f in np.argsort(flat, kind="stable"):
        if flat[f] >= experts:
            continue
        row = row + 1 if flat[f] == last else -(-(row + 1) // bm) * bm  # a new expert starts a tile
        expected[f], last = row, flat[f]
    slot, tile_groups = pair_slots(jnp.asarray(ids), experts, bm)
    np.testing.assert_array_equal(np.asarray(slot), expected)
    sizes = np.bincount(flat[flat < experts], minlength=experts)
    groups = np.repeat(np.arange(experts), -(-sizes // bm))
    np.testing.assert_array_equal(np.asarray(tile_groups)[:groups.size], groups)
    assert (np.asarray(tile_groups)[groups.size:] == experts).all()


@pytest.mark.parametrize("T", [13, 1])
def test_tiled_moe_matches_references(T):
    """The routed experts by the grouped Mosaic GPU kernel in its tiled layout (interpret mode), 8-pair
    tiles: an expert with no pairs, one picked twice by a token, F = 96 and R = 160 not multiples of 64 and
    of bk; at one token (decode) fewer pairs than experts, so the layout's bound is set by the pairs.
    Against the sorted dispatch with every product rounded to bf16 as the kernel's are (float32 products
    of the decoded weights), and against every expert on every token in float32."""
    E, F, R, k = 6, 96, 160, 3
    keys = jax.random.split(jax.random.key(70), 6)
    w1, w3, w2 = expert_stacks(keys, E, F, R)
    x = bf16_normal(keys[3], (T, R)).astype(jnp.bfloat16)
    experts = jax.random.randint(keys[4], (T, k), 0, E - 1).at[0].set(jnp.array([2, 2, 4]))  # expert 5: none
    weights = jax.random.uniform(keys[5], (T, k))
    out = tiled_moe_mx(x, w1, w3, w2, weights, experts, situ, bm=8, blocks=MosaicBlocks(128, 2), interpret=True)
    decoded = [w.decode(jnp.float32) for w in (w1, w3, w2)]
    rounded = lambda xs, w, sizes: grouped_matmul(xs.astype(jnp.float32), w, sizes).astype(jnp.bfloat16)
    assert out.shape == (T, R) and out.dtype == jnp.bfloat16
    assert rel_err(out, moe_sorted(x, *decoded, weights, experts, situ, matmul=rounded)) < 1e-5
    assert rel_err(out, moe_dense(x.astype(jnp.float32), *decoded, weights, experts, situ)) < 1e-2
    with pytest.raises(ValueError, match="bf16"):
        tiled_moe_mx(x.astype(jnp.float32), w1, w3, w2, weights, experts, situ, interpret=True)


def test_tiled_moe_expert_parallel_shards():
    """Expert parallelism's shards on the tiled MoE (interpret mode): each of 2 shards of 3 experts gets the
    pairs of the other's experts as expert 3 (``local_pairs``), which must add nothing; the shards' sum
    equals the whole MoE, and a shard holding none of a token's experts gives that token zeros."""
    from k3jax.sharding import local_pairs
    E, F, R, k, T = 6, 64, 96, 2, 5
    keys = jax.random.split(jax.random.key(71), 6)
    w1, w3, w2 = expert_stacks(keys, E, F, R)
    x = bf16_normal(keys[3], (T, R)).astype(jnp.bfloat16)
    experts = jax.random.randint(keys[4], (T, k), 0, E).at[0].set(jnp.array([0, 1]))  # token 0: shard 0 only
    weights = jax.random.uniform(keys[5], (T, k))
    moe = jax.jit(lambda x, w1, w3, w2, weights, experts: tiled_moe_mx(
        x, w1, w3, w2, weights, experts, situ, bm=8, blocks=MosaicBlocks(128, 2), interpret=True))
    shard = lambda s, w: jax.tree.map(lambda a: a[3 * s:3 * s + 3], w)
    parts = [moe(x, shard(s, w1), shard(s, w3), shard(s, w2), *local_pairs(weights, experts, 3 * s, 3))
             for s in (0, 1)]
    decoded = [w.decode(jnp.float32) for w in (w1, w3, w2)]
    rounded = lambda xs, w, sizes: grouped_matmul(xs.astype(jnp.float32), w, sizes).astype(jnp.bfloat16)
    want = moe_sorted(x, *decoded, weights, experts, situ, matmul=rounded)
    assert bool(jnp.all(parts[1][0] == 0))
    assert rel_err(parts[0].astype(jnp.float32) + parts[1].astype(jnp.float32), want) < 1e-2


def test_tiled_moe_lowers_for_cuda():
    """The tiled MoE at mini's prefill chunk (2048 tokens, 8 of 64 experts) lowers for CUDA through Mosaic
    GPU; mismatched stacks raise."""
    E, F, R, k, T = 64, 768, 1024, 8, 2048
    w1 = MXTensor(jnp.zeros((E, F, R // 2), jnp.uint8), jnp.zeros((E, F, R // 32), jnp.uint8), "mxfp4")
    w2 = MXTensor(jnp.zeros((E, R, F // 2), jnp.uint8), jnp.zeros((E, R, F // 32), jnp.uint8), "mxfp4")
    fn = lambda x, weights, experts: tiled_moe_mx(x, w1, w1, w2, weights, experts, situ)
    args = [jax.ShapeDtypeStruct((T, R), jnp.bfloat16), jax.ShapeDtypeStruct((T, k), jnp.float32),
            jax.ShapeDtypeStruct((T, k), jnp.int32)]
    assert "mosaic_gpu" in jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    with pytest.raises(ValueError, match="disagree"):
        tiled_moe_mx(jnp.zeros((T, R), jnp.bfloat16), w1, w1, w1, jnp.zeros((T, k)), jnp.zeros((T, k), jnp.int32), situ)
