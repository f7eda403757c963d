"""The batch-1 routed MoE as the decode step runs it, over a sweep of its two kernels' tiles.

On the batch-1 step's critical path each MoE layer's routed experts (the pick and gate/up in the hidden
kernel, then the down kernel: ``pallas_kernels.mx_matmul.routed_moe_mx_split``) take 17.5 us for 10 MB at
`mini`'s shape, 0.57 TB/s, the chain's largest excess over its bytes (issue 4, benchmarks/RESULTS.md,
eighteenth session). The tiles were last swept before the pick moved into the hidden kernel, and with one
weight set in a loop (so from L2). Here every one of a step's MoE layers has its own weights (from DRAM, as
in the step), and the layers run as a chain in one jitted call with the decode step's command-buffer
options: router logits (an XLA einsum), the MoE, an RMS scaling of its output as the next layer's input.

    python3 benchmarks/moe_one_token.py [preset] [--hidden bn/bk/warps,...] [--down bn/bk/warps,...]
                                        (default mini; a CPU runs it in interpret mode, for a check only)

Variants: the default tiles; each ``--hidden`` tile (hidden units a program / contracted elements a tile /
warps) with the default down tiles; each ``--down`` tile (output rows a program / hidden units a tile /
warps) with the default hidden tiles; "h interleaved" (``moe_split.PLANAR_H_MAX_TOKENS`` 0: h stored as [T*k, F]
between the two kernels, not planar); and a probe, "experts given": ``fused_moe_mx_split`` with each layer's
pairs fixed ahead (no pick in the chain: what the pick costs there). Tiles are shrunk to fit the shape as the
library does. us per layer = (the chain's time - the same chain without the MoE) / layers, the best of 5
rounds, each a median of 20 calls. Every variant's output is checked against the default's (float32 sums in
another order: relative 1e-5), the default's against ``select_experts`` and the dense float32 reference
(relative 1e-2: the kernels round the hidden activations to bf16).
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from k3jax import preset
from k3jax.functional.moe import moe_dense, select_experts
from k3jax.inference import DECODE_GPU_OPTIONS, on_gpu
from k3jax.layers.mlp import activation
from launch_floor import ROUNDS, median_seconds
from mx_matmul import random_mx
from pallas_kernels.mx_matmul import fused_moe_mx_split, moe_split, routed_moe_mx_split
from pallas_kernels.mx_matmul.moe_split import SPLIT_MOE_BLOCKS, SPLIT_MOE_DOWN_BLOCKS_ONE_TOKEN

# Each variant's chain compiles its two Triton kernels once per layer (about 40 s a variant on the H200 at
# `mini`, nineteenth session: a sweep of 14 variants ran past a 10-minute call), so the default sweep is short.
HIDDEN = "8/1024/4,16/1024/8,32/512/8"
DOWN = "1/128/1,2/256/2"


def tiles(text: str, base):
    """'bn/bk/warps,...' -> MXBlocks like ``base`` with those fields ('' -> none)."""
    out = []
    for item in filter(None, text.split(",")):
        bn, bk, warps = (int(v) for v in item.split("/"))
        out.append(dataclasses.replace(base, bn=bn, bk=bk, num_warps=warps))
    return out


def chain(layers, moe):
    """The jitted chain over the layers' (router weight, bias, w1, w3, w2, pairs); ``moe(x, logits, layer)``
    -> float32 [1, R], or None for the chain without the MoE."""
    def run(x, layers):
        for layer in layers:
            logits = jnp.einsum("tr,er->te", x, layer[0], preferred_element_type=jnp.float32)
            y = x.astype(jnp.float32) + logits[:, :1] if moe is None else moe(x, logits, layer)
            x = (y * jax.lax.rsqrt(jnp.mean(y * y) + 1e-6)).astype(jnp.bfloat16)
        return x

    return jax.jit(lambda x: run(x, layers), compiler_options=on_gpu(DECODE_GPU_OPTIONS))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("preset", nargs="?", default="mini")
    ap.add_argument("--hidden", default=HIDDEN, help="hidden-kernel tiles: bn/bk/warps, comma-separated")
    ap.add_argument("--down", default=DOWN, help="down-kernel tiles: bn/bk/warps, comma-separated")
    args = ap.parse_args()
    cfg = preset(args.preset)
    moe_cfg, act = cfg.moe, activation(cfg.hidden_act, cfg.situ_beta, cfg.situ_linear_beta)
    E, k, F = moe_cfg.num_experts, moe_cfg.experts_per_token, moe_cfg.intermediate_size
    R = moe_cfg.latent_size or cfg.hidden_size
    count = sum(cfg.is_moe_layer(i) for i in range(len(cfg.layer_types)))
    key = jax.random.key(0)
    layers = []
    for i in range(count):
        kg, kb, k1, k3, k2, kp = jax.random.split(jax.random.fold_in(key, i), 6)
        router = (jax.random.normal(kg, (E, R), jnp.float32) * R ** -0.5).astype(jnp.bfloat16)
        bias = jax.random.normal(kb, (E,), jnp.float32) * 0.01
        pairs = jax.random.permutation(kp, E)[:k][None].astype(jnp.int32)
        layers.append((router, bias, random_mx(k1, (E, F, R)), random_mx(k3, (E, F, R)), random_mx(k2, (E, R, F)),
                       pairs))
    rule = dict(k=k, renormalize=moe_cfg.renormalize, scaling_factor=moe_cfg.routed_scaling_factor)

    def routed(blocks, down):
        return lambda x, logits, layer: routed_moe_mx_split(x, *layer[2:5], logits, layer[1], act, **rule,
                                                            blocks=blocks, down_blocks=down, out_dtype=jnp.float32)

    def interleaved(x, logits, layer):  # PLANAR_H_MAX_TOKENS is read while this traces
        previous, moe_split.PLANAR_H_MAX_TOKENS = moe_split.PLANAR_H_MAX_TOKENS, 0
        try:
            return routed(SPLIT_MOE_BLOCKS, None)(x, logits, layer)
        finally:
            moe_split.PLANAR_H_MAX_TOKENS = previous

    def given(x, logits, layer):
        weights = jnp.full((1, k), moe_cfg.routed_scaling_factor / k, jnp.float32)
        return fused_moe_mx_split(x, *layer[2:5], weights, layer[5], act, out_dtype=jnp.float32)

    label = lambda b: f"{b.bn}/{b.bk}/w{b.num_warps}"
    default_down = SPLIT_MOE_DOWN_BLOCKS_ONE_TOKEN
    moes = {f"default (hidden {label(SPLIT_MOE_BLOCKS)}, down {label(default_down)})": routed(SPLIT_MOE_BLOCKS, None)}
    moes |= {f"hidden {label(b)}": routed(b, None) for b in tiles(args.hidden, SPLIT_MOE_BLOCKS)}
    moes |= {f"down {label(d)}": routed(SPLIT_MOE_BLOCKS, d) for d in tiles(args.down, default_down)}
    moes["h interleaved"] = interleaved
    moes["probe: experts given (no pick)"] = given
    x = (jax.random.normal(jax.random.fold_in(key, count), (1, R), jnp.float32)).astype(jnp.bfloat16)
    print(f"device {jax.devices()[0].device_kind}; {args.preset}: {count} MoE layers, {E} experts, top {k}, "
          f"{R} -> {F} -> {R}", flush=True)

    router, bias, w1, w3, w2, _ = layers[0]
    logits = jnp.einsum("tr,er->te", x, router, preferred_element_type=jnp.float32)
    weights, experts = select_experts(logits, bias, **rule)
    dense = moe_dense(x.astype(jnp.float32), *(w.decode(jnp.float32) for w in (w1, w3, w2)), weights, experts, act)
    expected = np.asarray(dense, np.float64)  # float32 throughout: the kernels round h to bf16, as the layer does
    first = [np.asarray(moe(x, logits, layers[0]), np.float64) for moe in moes.values()]
    err = lambda got, want: float(np.linalg.norm(got - want) / np.linalg.norm(want))
    if err(first[0], expected) > 1e-2:  # h's bf16 rounding, as tests/test_mx_matmul.py bounds it
        raise SystemExit(f"default: {err(first[0], expected):.1e} from the reference MoE")
    for name, got in zip(list(moes)[1:-1], first[1:-1]):
        if err(got, first[0]) > 1e-5:
            raise SystemExit(f"{name}: {err(got, first[0]):.1e} from the default")
    print(f"default vs reference: rel err {err(first[0], expected):.1e}; the sweep's variants agree with it")

    fns = {"without the MoE": chain(layers, None)} | {n: chain(layers, m) for n, m in moes.items()}
    for name, fn in fns.items():
        start = time.perf_counter()
        jax.block_until_ready(fn(x))
        print(f"compiled: {name} ({time.perf_counter() - start:.0f} s)", flush=True)
    best = {name: min(median_seconds(fn, x) for _ in range(ROUNDS)) for name, fn in fns.items()}
    base = best.pop("without the MoE")
    mbytes = sum(a.nbytes for w in layers[0][2:5] for a in (w.codes, w.scales)) * k / E / 1e6
    print(f"\nvariant | us per layer | TB/s of its {mbytes:.1f} MB of expert weights")
    for name, seconds in best.items():
        per = (seconds - base) / count * 1e6
        print(f"{name} | {per:.1f} | {mbytes / per:.2f}")


if __name__ == "__main__":
    main()
