"""K3's routed MoE layer with its experts split over GPUs (``k3jax.sharding``), against the same layer on one
GPU, in one run.

    python3 benchmarks/expert_parallel.py [--tokens 1,8,64,256] [--shards 2,8] [--out results.json]

K3's shapes: 896 MXFP4 experts, 16 per token, latent 3584 -> hidden 3072 -> 3584, SiTU; random top-16
routing, bf16 x. Each device of a mesh over every local GPU holds 896 / n experts and runs the local MoE
the model's layer picks there (the tiled Mosaic GPU MoE in tiles of 8 pairs; the sorted dispatch through
the Triton grouped kernel for comparison) on the pairs routed to its experts, then one ``psum``. Rows:

- one GPU: both local MoEs over all 896 experts on GPU 0 (the single-GPU numbers of MX run 15);
- one shard of s (``--shards``), on GPU 0: what each of s devices runs under ``moe_expert_parallel`` before
  the ``psum``: the local MoE over experts [0, 896 / s) with every pair, the others' as expert 896 / s
  (``local_pairs``);
- n GPUs, where the host has n > 1: both under ``moe_expert_parallel``, and the ``psum`` of a [T, 3584]
  float32 alone;

each checked against ``per_expert_reference`` of the same pairs (float32 throughout, no grouped kernel and no
dispatch; relative error below 1e-2, the MoEs' bf16 roundings of their products are about 2e-3), then timed as
``MOE_LOOP`` calls in one jitted loop. Bandwidth: MXFP4 bytes of the experts the tokens touch over the time, summed
over the GPUs ("all") and per GPU.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from k3jax.functional.moe import moe_sorted, situ  # noqa: E402
from k3jax.mx import MXTensor  # noqa: E402
from k3jax.sharding import expert_sharding, local_pairs, moe_expert_parallel  # noqa: E402
from mx_matmul import looped, random_mx, rel_err, timed  # noqa: E402
from pallas_kernels.mx_matmul import grouped_mx_matmul, tiled_moe_mx  # noqa: E402

E, F, R, TOP_K = 896, 3072, 3584, 16
MOE_LOOP = 10


LOCAL_MOES = {  # moe_sorted's contract, as ``MoE._sorted_moe`` makes them
    "tiled Mosaic GPU MoE bm 8": functools.partial(tiled_moe_mx, act=situ, bm=8),
    "sorted dispatch": functools.partial(moe_sorted, act=situ, matmul=grouped_mx_matmul),
}


@jax.jit
def per_expert_reference(x, weights, experts, w1: MXTensor, w3: MXTensor, w2: MXTensor):
    """The routed layer one expert at a time, each decoded to float32 (the whole stack would take 118 GB):
    sum over experts e of (the weights of the pairs routed to e) * expert_e(x), all in float32. Pairs whose
    expert is outside the stacks add nothing."""
    hi = jax.lax.Precision.HIGHEST
    xf = x.astype(jnp.float32)

    def add_expert(e, out):
        w = [jax.tree.map(lambda a: a[e], stack).decode(jnp.float32) for stack in (w1, w3, w2)]
        h = situ(jnp.dot(xf, w[0].T, precision=hi), jnp.dot(xf, w[1].T, precision=hi))
        combine = jnp.sum(jnp.where(experts == e, weights, 0.0), axis=1)
        return out + combine[:, None] * jnp.dot(h, w[2].T, precision=hi)

    return jax.lax.fori_loop(0, w1.shape[0], add_expert, jnp.zeros(x.shape, jnp.float32))


def on_pairs(local_moe):
    """local_moe(x, w1, w3, w2, weights, experts) as (x, weights, experts, w1, w3, w2): the stacks last, as
    the timed loops (``looped``) pass them."""
    return lambda x, wt, ex, *w: local_moe(x, *w, wt, ex)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="1,8,64,256", help="comma-separated token counts")
    parser.add_argument("--shards", default="2,8", help="comma-separated shard counts to time one shard of")
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args()
    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("expert",), axis_types=(AxisType.Auto,))
    print(f"{n} x {jax.devices()[0].device_kind}, JAX {jax.__version__}", flush=True)
    keys = jax.random.split(jax.random.key(0), 5)
    whole = tuple(random_mx(k, shape) for k, shape in zip(keys[:3], [(E, F, R), (E, F, R), (E, R, F)]))
    split = jax.device_put(whole, expert_sharding(mesh, E))
    replicated = NamedSharding(mesh, PartitionSpec())
    per_expert = sum(w.nbytes for w in whole) / E
    rows = []

    def run(case, impl, fn, operands, expected, wbytes, gpus, note=""):
        try:
            out = jax.jit(fn)(*operands)
            err = rel_err(out, expected) if expected is not None else 0.0
            if err > 1e-2:
                raise AssertionError(f"rel err {err:.2e} against the per-expert float32 reference")
            seconds = timed(looped(fn, MOE_LOOP), *operands) / MOE_LOOP
        except Exception as e:  # noqa: BLE001 - a failing variant is reported and the run goes on
            print(f"  {case} {impl}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
            return
        row = dict(case=case, impl=impl, us=seconds * 1e6, tbs_all=wbytes / seconds / 1e12,
                   tbs_gpu=wbytes / seconds / 1e12 / gpus, err=err, note=note)
        rows.append(row)
        print(f"  {case:14s} {impl:44s} {row['us']:9.1f} us  {row['tbs_all']:5.2f} TB/s all  "
              f"{row['tbs_gpu']:5.2f} per GPU  err {err:.1e} {note}", flush=True)

    for tokens in (int(t) for t in args.tokens.split(",")):
        x = jax.random.normal(jax.random.fold_in(keys[3], tokens), (tokens, R)).astype(jnp.bfloat16)
        _, experts = jax.lax.top_k(jax.random.uniform(jax.random.fold_in(keys[4], tokens), (tokens, E)), TOP_K)
        experts = experts.astype(jnp.int32)
        weights = jnp.full((tokens, TOP_K), 1.0 / TOP_K, jnp.float32)
        active = np.unique(np.asarray(experts))
        wbytes = len(active) * per_expert
        busiest = max(np.bincount(active // (E // n), minlength=n))
        case = f"{tokens} tokens"
        note = f"{len(active)} experts, at most {busiest} on one GPU"
        expected = per_expert_reference(x, weights, experts, *whole)
        for impl, local in LOCAL_MOES.items():
            run(case, f"1 GPU: {impl}", on_pairs(local), (x, weights, experts, *whole), expected, wbytes, 1, note)
        for shards in (int(s) for s in args.shards.split(",")):
            local = E // shards
            mine = active[active < local]
            shard = tuple(jax.tree.map(lambda a: a[:local], w) for w in whole)
            wt, ex = local_pairs(weights, experts, 0, local)
            want = per_expert_reference(x, wt, ex, *shard)
            for impl, local_moe in LOCAL_MOES.items():
                run(case, f"1 shard of {shards}: {impl}", on_pairs(local_moe), (x, wt, ex, *shard), want,
                    len(mine) * per_expert, 1, f"{len(mine)} of its {local} experts")
            del shard
        if n == 1:
            continue
        xs, ws, es = jax.device_put((x, weights, experts), replicated)
        for impl, local_moe in LOCAL_MOES.items():
            sharded = lambda x, wt, ex, *w, local_moe=local_moe: moe_expert_parallel(x, *w, wt, ex, local_moe, mesh)
            run(case, f"{n} GPUs: {impl}", sharded, (xs, ws, es, *split), expected, wbytes, n, note)
        psum = jax.shard_map(lambda y: jax.lax.psum(y, "expert"), mesh=mesh, in_specs=PartitionSpec(),
                             out_specs=PartitionSpec())
        run(case, f"{n} GPUs: psum of [T, {R}] float32 alone", psum,
            (jax.device_put(x.astype(jnp.float32), replicated),), None, 0.0, n)

    print("\n| case | impl | us | TB/s all GPUs | TB/s per GPU | note |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['impl']} | {r['us']:.1f} | {r['tbs_all']:.2f} | {r['tbs_gpu']:.2f} | {r['note']} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
