"""The model on several GPUs of one host (issue 57): every variant is checked against one device, then timed
beside its peer measured in the same run; the table is printed last.

    python3 benchmarks/multi_gpu.py [--parts moe,mini,slice] [--gpus 2,4,8] [--impl pallas] [--out table.md]
    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu python3 benchmarks/multi_gpu.py --quick

Each part runs on the first n of ``jax.devices()`` for each n in ``--gpus``; sizes above the device count are
skipped, and the script says so.

- ``moe``: one K3-shaped MoE layer (``preset("kimi-k3").moe``: 896 MXFP4 experts, R 3584, F 3072, top 16, with
  its shared experts and latent maps) on the largest n (``expert=n``, or ``--moe-mesh``), placed by the rules
  table (``param_spec``, as layer 1's ``block_sparse_moe``) and called under ``on_mesh`` at decode batches
  ``--moe-tokens`` and a ``--moe-prefill``-token chunk, in both MoE forms (replicated tokens, exchanged rows:
  ``KernelPolicy.expert_exchange_min_tokens`` above or below the call's tokens), against the layer on one GPU.
  Which form wins at each token count is what ``expert_exchange_min_tokens`` should follow. In the same run:
  the all-reduce bus bandwidth of those devices (a ``psum`` under ``shard_map`` of ``--collective-mib`` bf16 a
  device: 2(n-1)/n x bytes / time, NCCL's definition); an all-to-all of the same buffer (``jax.lax.all_to_all``:
  (n-1)/n x bytes, what leaves a device, / time); and the MoE's collectives alone (``moe_expert_parallel`` with
  each device's experts replaced by a scaling): the bytes a device sends, modelled by
  ``k3jax.memory.communication``, / their time.
- ``mini``: the ``--preset`` model through ``Generator(model, mesh=mesh)`` under expert parallelism
  (``expert=n``) and expert x tensor (``expert=n/t,tensor=t``, t = ``--tensor``): decode steps at ``--batches``
  and a ``--prefill``-token prefill, each in both MoE forms, against one GPU.
- ``slice``: one repeating group of K3 (KDA, KDA, KDA, MLA) at full width (D 7168, 96 heads, the 163,840-row
  embedding and head), every layer MoE as K3's are after its first, its routed experts cut to
  ``--slice-experts`` (64 of 896, top 16 kept) so that the one-GPU float32 check, which decodes every expert
  stack to float32 (8.4 GB a layer at 64), fits. A batch of 1 reads 16 experts a layer at any count; batches of
  8 and 64 read 58 and 64 where K3 would read 120 and 613. Decode steps under ``tensor=8`` against the
  per-device memory floor: the bytes a step must read on one device (its share of the weights, of the experts
  the batch is expected to touch, and its cache) / the copy rate of the same run (benchmarks/inference.py's).

Checks. A row is a token's logits, an MLA latent row a prefill cached, or a MoE output row; its error is its
largest difference over its largest magnitude on one device. A check passes when the median row error is within
the tolerance and at most a quarter of the rows exceed it: a router near-tie can flip one token's expert between
two runs, moving that token's rows by O(1), while a wrong split, route or exchange moves them all.

- The model (mini, slice) is checked in float32 on the reference path, at ``--check-tol`` (1e-3): each timed
  configuration (mesh, MoE form, decode batch; the prefill with a ``--check-prefill``-token prompt) runs the
  same ``Generator`` calls with the weights upcast (MXFP4 experts as stored) and full-precision matmuls, against
  one device doing the same. The timed bf16 run is reported against one device's, not judged: a random bf16
  model is chaotic. On 2 CPU devices a 12-layer mini-shaped model (D 512, 64 experts) gave one-device bf16
  logits a median 0.34 (up to 0.78) of the largest logit away from its own float32 logits, while the mesh's
  float32 logits matched one device's to 2e-6.
- The MoE layer is checked as timed (bf16), at ``--tol`` (2e-2): one layer has no depth to amplify rounding.
  The mesh reorders bf16 sums and rounds the routed sum once more (each rounding up to 2^-8 relative); a wrong
  split or exchange is off by O(1).

A failed check is printed and its row says so; its timing is skipped, and the script exits 1 at the end.

Timing. Decode steps as benchmarks/inference.py times them: chained calls dispatched ahead, the best of
``--rounds`` rounds of ``--calls``, after ``--warm-up`` seconds of steps, at position ``--prompt`` of a
``--prompt`` + 64 cache read whole (window None), after at least ``--check-steps`` steps from an empty cache on
fixed tokens placed as the rules place a batch. Prefill: the best of ``--rounds`` whole prompts, the cache made
each time, in one compiled chunk (``--attend-block``). Each timed configuration compiles its own programs (on a
tensor mesh the decode step twice: its first call returns the KDA conv cache split over tensor, unlike
``init_cache``). The default run compiles over a hundred programs: on GPUs run it in pieces (``--parts mini
--gpus 8``) within a command's time limit. ``--out`` writes the table to a file, also when SIGTERM stops a run.

``--quick`` is the smoke check on simulated CPU devices, with tiny stand-ins: ``tiny_mesh`` (one KDA, KDA, KDA,
MLA group) with 8 heads and every layer MoE for both ``mini`` and the slice, its 8-expert MoE for K3's. It runs
float32 on the reference path, where the timed runs are the checks, on 8 devices, one layout and form each, at
XLA's lowest optimization (its programs run a few times each: compiling is nearly all its time). The checks are
real; the times are meaningless (the simulated devices share the host's cores). The mini part runs its prefill
only: the slice runs the same decode calls.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import math
import os
import shlex
import signal
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from k3jax import (Generator, K3Config, K3Model, KernelPolicy, from_hf_config, preset, preset_hf_config,  # noqa: E402
                   use_implementation)
from k3jax.layers.mlp import activation  # noqa: E402
from k3jax.layers.moe import MoE  # noqa: E402
from k3jax.memory import MXFP4_BYTES, abstract_mesh, communication, device_weights, per_device  # noqa: E402
from k3jax.sharding import (expert_sharding, make_mesh, moe_expert_parallel, on_mesh, param_spec,  # noqa: E402
                            parse_mesh, place, place_batch)
from k3jax.sharding.rules import batch_spec, devices_over, mesh_axes, spec_bytes  # noqa: E402

# each MoE form as a policy selects it: the exchanged rows from this many tokens a call
FORMS = {"replicated": 2**31 - 1, "exchanged": 1}
# the smoke: the mini part's prefill only (the slice runs the same decode calls), each form once in the MoE part
QUICK = dict(gpus="8", dtype="float32", preset="quick", layouts="ep", batches="", prefill_forms="replicated",
             prefill=32, prefill_chunk=32, prompt=16, check_steps=2, moe_preset="tiny_mesh", moe_tokens="8",
             moe_prefill=0, collective_mib=1.0, slice_preset="quick", slice_batches="8", rounds=1, calls=2, warm_up=0.0)
ROWS: list[dict] = []
FAILED: list[str] = []
WINNERS: dict[str, dict[int, str]] = {}  # where -> {tokens a MoE call: the faster form}


# ----------------------------------------------------------------------------------------------- configs, models

def group_config(base: str, experts: int | None = None, heads: int | None = None) -> K3Config:
    """One repeating group of preset ``base``: layers KDA, KDA, KDA, MLA, each a MoE layer (first_k_dense_replace
    0). ``experts``: routed experts kept (top k unchanged). ``heads``: KDA and MLA heads."""
    hf = preset_hf_config(base)
    text = hf.get("text_config", hf)
    text.update(num_hidden_layers=4, first_k_dense_replace=0)
    text["linear_attn_config"] = {**text["linear_attn_config"], "full_attn_layers": [4], "kda_layers": [1, 2, 3]}
    if experts:
        text["num_experts"] = experts
    if heads:
        text.update(num_attention_heads=heads, num_key_value_heads=heads)
        text["linear_attn_config"]["num_heads"] = heads
    extras = "".join([f", {experts} experts" if experts else "", f", {heads} heads" if heads else ""])
    return from_hf_config(hf, name=f"{base} group (KDA x3 + MLA, all MoE{extras})")


def model_config(name: str) -> K3Config:
    return group_config("tiny_mesh", heads=8) if name == "quick" else preset(name)


def _name(path) -> str:
    """A state leaf's key path as a dotted name, without nnx's ``value`` step (an MXTensor keeps codes/scales)."""
    names = (str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)
    return ".".join(n for n in names if n not in ("value", "raw_value"))


def _random_leaf(name: str, leaf, seed: int) -> jax.Array:
    """Random values for an abstract leaf. MXFP4 codes are uniform bytes and E8M0 scales sit around 2^-7. Norms are
    ones and the router's bias zeros, as initialized. Other weights are normal, scaled by fan-in. Leaves up to
    64 MiB are drawn on the host (no compile); larger ones on the device, one expert at a time (K3's code stacks
    are 5 GB each)."""
    shape, dtype = tuple(leaf.shape), jnp.dtype(leaf.dtype)
    codes, scales = name.endswith(".codes"), name.endswith(".scales")
    if "norm" in name or "correction_bias" in name:
        return jnp.full(shape, 1.0 if "norm" in name else 0.0, dtype)
    if math.prod(shape) * dtype.itemsize <= 64 << 20:
        rng = np.random.default_rng(seed)
        if codes or scales:
            values = rng.integers(0, 256, shape) if codes else rng.integers(118, 122, shape)
        else:
            values = rng.standard_normal(shape, np.float32) * shape[-1] ** -0.5
        return jax.device_put(np.asarray(values).astype(dtype))
    key = jax.random.key(seed)
    if codes:
        one = lambda k: jax.random.bits(k, shape[1:], jnp.uint8)
    elif scales:
        one = lambda k: jax.random.randint(k, shape[1:], 118, 122).astype(jnp.uint8)
    else:
        one = lambda k: (jax.random.normal(k, shape[1:], jnp.float32) * shape[-1] ** -0.5).astype(dtype)
    return jax.jit(lambda k: jax.lax.map(one, jax.random.split(k, shape[0])))(key)


def random_moe(cfg: K3Config, seed: int, dtype) -> tuple:
    """A MoE layer of ``cfg`` with random weights and MXFP4 experts, built without bf16 expert stacks (K3's would
    be 59 GB) -> (graph, state on the default device)."""
    act = activation(cfg.hidden_act, cfg.situ_beta, cfg.situ_linear_beta)
    abstract = nnx.eval_shape(lambda: MoE(cfg.hidden_size, cfg.moe, act, cfg.rms_norm_eps, rngs=nnx.Rngs(0),
                                          param_dtype=dtype, packed_experts=True))
    graph, state = nnx.split(abstract)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
    return graph, jax.tree_util.tree_unflatten(treedef, [_random_leaf(_name(p), leaf, seed * 1000 + i)
                                                         for i, (p, leaf) in enumerate(leaves)])


def place_moe(cfg: K3Config, state, mesh):
    """A MoE layer's state placed as the rules table places a model's (``layers.1.block_sparse_moe.*``)."""
    shardings = jax.tree_util.tree_map_with_path(
        lambda path, leaf: NamedSharding(mesh, param_spec(cfg, "layers.1.block_sparse_moe." + _name(path),
                                                          tuple(leaf.shape), mesh)), state)
    return jax.device_put(state, shardings)


# ------------------------------------------------------------------------------------------------------- helpers

def policy(form: str) -> KernelPolicy:
    return dataclasses.replace(KernelPolicy(), expert_exchange_min_tokens=FORMS[form])


def default_form(tokens: int) -> str:
    return "exchanged" if tokens >= KernelPolicy().expert_exchange_min_tokens else "replicated"


def row_errors(got, want) -> np.ndarray:
    """Each row's (the last dim's) largest difference over its largest magnitude in ``want``. Rows of ``want``
    that are all zero (cache positions never written) are left out."""
    want = np.asarray(want, np.float64)
    want = want.reshape(-1, want.shape[-1])
    got = np.asarray(got, np.float64).reshape(want.shape)
    scale = np.max(np.abs(want), axis=1)
    kept = scale > 0
    return np.max(np.abs(got - want), axis=1)[kept] / scale[kept]


def errors(got: list, want: list) -> np.ndarray:
    return np.concatenate([row_errors(g, w) for g, w in zip(got, want)])


def best_of(fn, calls: int, rounds: int) -> float:
    """Seconds per call of ``fn()`` (which returns what to wait on): the best of ``rounds`` rounds of ``calls``
    calls dispatched back to back. Two calls run first: a call may compile, and the second may compile again for
    the shardings the first's outputs came back with."""
    for _ in range(2):
        jax.block_until_ready(fn())
    best = float("inf")
    for _ in range(rounds):
        start, out = time.perf_counter(), None
        for _ in range(calls):
            out = fn()
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def warm_up(fn, seconds: float) -> None:
    """Call ``fn()`` for ``seconds`` before timed rounds: a GPU's clocks ramp up for seconds after it wakes
    (benchmarks/inference.py's ``warm_up``)."""
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        jax.block_until_ready(fn())


def copy_rate(quick: bool) -> float:
    """Bytes per second of an in-place scale of a float32 array on device 0 (read and written), the best round.
    The array is 2 GiB on a GPU, as for benchmarks/inference.py's floors."""
    count = 1 << (16 if quick else 29 if jax.default_backend() == "gpu" else 24)
    scale = jax.jit(lambda x: x * 1.0001, donate_argnums=0)
    state = {"x": jax.device_put(jnp.ones((count,), jnp.float32), jax.devices()[0])}

    def once():
        state["x"] = scale(state["x"])
        return state["x"]

    return 2 * count * 4 / best_of(once, calls=10, rounds=5)


class Run:
    """What every row shares: the arguments, the devices' name, the date and the command."""

    def __init__(self, args):
        self.args = args
        device = jax.devices()[0]
        self.kind = "cpu (simulated)" if device.platform == "cpu" else device.device_kind
        self.date = datetime.date.today().isoformat()
        env = " ".join(f"{k}={shlex.quote(os.environ[k])}" for k in ("XLA_FLAGS", "JAX_PLATFORMS") if k in os.environ)
        self.command = f"{env} python3 benchmarks/multi_gpu.py {shlex.join(sys.argv[1:])}".strip()
        self.dtype = jnp.dtype(args.dtype)
        self.start = time.perf_counter()

    def clock(self) -> str:
        return f"[{time.perf_counter() - self.start:6.1f} s]"

    def say(self, text: str) -> None:
        print(f"{self.clock()} {text}", flush=True)

    def row(self, metric: str, value: str, peer: str, ratio: str, n: int) -> None:
        ROWS.append(dict(metric=metric, value=value, peer=peer, ratio=ratio, device=f"{n}x {self.kind}",
                         date=self.date, command=self.command))
        self.say(f"{metric}: {value} | {peer} | {ratio}")

    def check(self, what: str, errs: np.ndarray, n: int, tol: float | None = None) -> bool:
        """Rows' errors (``row_errors``) against ``tol`` (default ``--tol``): the median within it, and at most a
        quarter of the rows above it."""
        tol = self.args.tol if tol is None else tol
        median, over = float(np.median(errs)), int(np.sum(errs > tol))
        ok = median <= tol and over <= len(errs) / 4
        self.say(f"check {what}: row errors median {median:.1e}, max {float(np.max(errs)):.1e}; {over} of "
                 f"{len(errs)} rows over {tol:g}: {'ok' if ok else 'FAILED'}")
        if not ok:
            FAILED.append(f"{what}: median error {median:.2e}, {over} of {len(errs)} rows over {tol:g}")
            self.row(what, f"FAILED check: median error {median:.2e}, {over} of {len(errs)} rows over {tol:g}", "-",
                     "-", n)
        return ok


def guarded(run: Run, what: str, n: int, fn) -> None:
    """Run one variant. An exception is printed and recorded as a failed row, and the other variants still run."""
    try:
        fn()
    except Exception as e:  # one variant out of memory, or failing to lower, must not lose the others' numbers
        traceback.print_exc()
        FAILED.append(f"{what}: {type(e).__name__}")
        first = str(e).splitlines()[0][:120] if str(e) else ""
        run.row(what, f"ERROR {type(e).__name__}: {first}", "-", "-", n)


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.3f} ms"


def us(seconds: float) -> str:
    return f"{seconds * 1e6:,.1f} us"


def size(nbytes: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:,.1f} {unit}"
    return f"{nbytes:,.0f} B"


def describe(mesh) -> str:
    return ",".join(f"{a}={s}" for a, s in mesh.shape.items() if s > 1) or "one device"


def forms_of(text: str, fallback: str) -> list[str]:
    forms = [f for f in (text or fallback).split(",") if f]
    unknown = sorted(set(forms) - set(FORMS))
    if unknown:
        raise SystemExit(f"unknown MoE forms {unknown}; choose from {sorted(FORMS)}")
    return forms


# ------------------------------------------------------------------------------------------ decode and prefill

def upcast(model: K3Model) -> K3Model:
    """``model`` with every floating parameter in float32 (the same values; MXFP4 experts as stored)."""
    graph, state = nnx.split(model)
    floating = lambda a: jnp.issubdtype(a.dtype, jnp.floating) and a.dtype != jnp.float32
    return nnx.merge(graph, jax.tree.map(lambda a: a.astype(jnp.float32) if floating(a) else a, state))


@dataclasses.dataclass(frozen=True)
class Shape:
    """What a decode or prefill call runs: the implementation, decode batch (or prefill prompt and chunk), steps."""

    impl: str
    batch: int = 1
    prompt: int = 0  # prefill: prompt tokens
    chunk: int = 0  # prefill: tokens a call
    timed: bool = True


def decode(run: Run, model: K3Model, mesh, form: str | None, shape: Shape):
    """Decode on ``mesh`` (None: one device) with ``form``'s policy (None: the default). Returns (what is checked:
    the logits [S, B, V] float32 of S forced steps from an empty cache, at least ``--check-steps`` and 16 rows;
    seconds per step at position ``--prompt``, None untimed)."""
    args, batch = run.args, shape.batch
    steps = max(args.check_steps, -(-16 // batch))
    forced = np.random.default_rng(batch).integers(0, model.cfg.vocab_size, (steps + 1, batch)).astype(np.int32)
    put = (lambda a: jnp.asarray(a)) if mesh is None else (lambda a: place_batch(jnp.asarray(a), mesh))
    seconds = None
    with use_implementation(shape.impl, None if form is None else policy(form)), precision(shape):
        gen = Generator(model, max_len=args.prompt + 64, mesh=mesh)
        cache, key = gen.init_cache(batch), jax.random.key(0)
        logits = []
        for s in range(steps):
            _, step_logits, cache = gen.decode_step(put(forced[s]), cache, put(np.full(batch, s, np.int32)), key)
            logits.append(np.asarray(step_logits, np.float32))
        if shape.timed:
            state = {"token": put(forced[steps]), "cache": cache}
            position = put(np.full(batch, args.prompt, np.int32))

            def once():
                state["token"], _, state["cache"] = gen.decode_step(state["token"], state["cache"], position, key)
                return state["token"]

            warm_up(once, args.warm_up)
            seconds = best_of(once, args.calls, args.rounds)
    return [np.stack(logits)], seconds


def mla_latents(cache, length: int) -> list[np.ndarray]:
    """The MLA latents ``c_kv`` [B, S, R] a cache holds for positions below ``length``, float32, one per layer."""
    leaves = jax.tree_util.tree_flatten_with_path(cache)[0]
    return [np.asarray(leaf[..., :length, :], np.float32) for path, leaf in leaves
            if getattr(path[-1], "name", None) == "c_kv"]


def prefill(run: Run, model: K3Model, mesh, form: str | None, shape: Shape):
    """One ``shape.prompt``-token prompt in ``shape.chunk``-token chunks. Returns (what is checked: the last logits
    [1, V] float32 and the MLA latents cached for every prompt position, each token's state entering each MLA
    layer; the best seconds, None untimed)."""
    T = shape.prompt
    prompt = np.random.default_rng(T).integers(0, model.cfg.vocab_size, (1, T))
    seconds = None
    with use_implementation(shape.impl, None if form is None else policy(form)), precision(shape):
        gen = Generator(model, max_len=T + 16, prefill_chunk=shape.chunk, attend_block=run.args.attend_block or T + 16,
                        mesh=mesh)
        logits, cache = gen.prefill(prompt, gen.init_cache(1))
        checked = [np.asarray(logits, np.float32), *mla_latents(cache, T)]
        del cache
        if shape.timed:
            seconds = best_of(lambda: gen.prefill(prompt, gen.init_cache(1))[0], calls=1, rounds=run.args.rounds)
    return checked, seconds


def precision(shape: Shape):
    """The checks' matmuls in full float32 (a GPU's default for float32 is TF32, 10 bits of mantissa)."""
    return contextlib.nullcontext() if shape.timed else jax.default_matmul_precision("highest")


class Model:
    """A model as the mini and slice parts run it: the timed copy (``--dtype``, ``--impl``) and the checked one
    (float32, the reference implementation), each placed on a mesh once, and one device's results for each."""

    def __init__(self, run: Run, cfg: K3Config, label: str):
        self.run, self.label = run, label
        self.timed = K3Model(cfg, rngs=nnx.Rngs(0), param_dtype=run.dtype)
        # the timed runs are the checks where they already run float32 on the reference path (--quick)
        self.same = run.dtype == jnp.float32 and run.args.impl == "reference"
        self.checked = self.timed if self.same else upcast(self.timed)
        self.placed: dict = {}
        self.one: dict = {}

    def on(self, mesh, checked: bool) -> K3Model:
        model = self.checked if checked else self.timed
        if mesh is None:
            return model
        key = (describe(mesh), checked and not self.same)
        if key not in self.placed:
            self.placed[key] = place(model, mesh)
        return self.placed[key]

    def shapes(self, kind: str, batch: int = 1) -> tuple[Shape, Shape]:
        """(the checked shape, the timed shape) of a decode at ``batch`` or the prefill."""
        args = self.run.args
        if kind == "decode":
            timed = Shape(args.impl, batch)
            return (timed if self.same else Shape("reference", batch, timed=False)), timed
        chunk = min(args.prefill_chunk, args.prefill)
        timed = Shape(args.impl, 1, args.prefill, chunk)
        tokens = min(args.check_prefill, args.prefill)
        checked = Shape("reference", 1, tokens, min(chunk, max(16, tokens // 2)), timed=False)
        return (timed if self.same else checked), timed

    def one_device(self, kind: str, batch: int = 1) -> tuple:
        """One device's (checked output, timed output, timed seconds) for ``kind`` ('decode' at ``batch``, or
        'prefill'), computed once."""
        if (kind, batch) not in self.one:
            call = decode if kind == "decode" else prefill
            checked_shape, timed_shape = self.shapes(kind, batch)
            timed, seconds = call(self.run, self.timed, None, None, timed_shape)
            checked = timed if self.same else call(self.run, self.checked, None, None, checked_shape)[0]
            self.one[kind, batch] = checked, timed, seconds
            self.run.say(f"one device, {self.label} {kind}{f' B={batch}' if kind == 'decode' else ''}: {ms(seconds)}")
        return self.one[kind, batch]

    def variant(self, kind: str, mesh, form: str | None, batch: int = 1) -> float | None:
        """Check ``kind`` on ``mesh`` in ``form`` against one device (float32), then time it; None if it failed."""
        run, n = self.run, mesh.devices.size
        call = decode if kind == "decode" else prefill
        checked_shape, timed_shape = self.shapes(kind, batch)
        want, want_timed, _ = self.one_device(kind, batch)
        what = self.what(kind, mesh, form, batch)
        if self.same:
            got, seconds = call(run, self.on(mesh, False), mesh, form, timed_shape)
            return seconds if run.check(what, errors(got, want), n, tol=run.args.check_tol) else None
        got = call(run, self.on(mesh, True), mesh, form, checked_shape)[0]
        if not run.check(what, errors(got, want), n, tol=run.args.check_tol):
            return None
        got, seconds = call(run, self.on(mesh, False), mesh, form, timed_shape)
        drift = errors(got, want_timed)
        run.say(f"{run.args.dtype} on the mesh against {run.args.dtype} on one device (not judged: a random model's "
                f"{run.args.dtype} drifts): median row error {np.median(drift):.1e}")
        return seconds

    def what(self, kind: str, mesh, form: str | None, batch: int) -> str:
        where = describe(mesh) + (f", {form}" if form else "")
        if kind == "decode":
            return f"{self.label} decode step B={batch}, {where}"
        chunk = min(self.run.args.prefill_chunk, self.run.args.prefill)
        return f"{self.label} prefill of {self.run.args.prefill} tokens in chunks of {chunk}, {where}"


_RUNS: dict = {}


def model_for(run: Run, cfg: K3Config, label: str) -> Model:
    """The ``Model`` of ``cfg``, one per config: parts that run the same config share its one-device results."""
    if cfg not in _RUNS:
        _RUNS[cfg] = Model(run, cfg, label)
    return _RUNS[cfg]


def form_row(run: Run, what: str, where: str, tokens: int, times: dict[str, float], n: int) -> None:
    """Which MoE form was faster at ``tokens`` tokens a call, beside what the default policy picks."""
    if len(times) < 2:
        return
    rep, exc = times["replicated"], times["exchanged"]
    best = "exchanged" if exc < rep else "replicated"
    WINNERS.setdefault(where, {})[tokens] = best
    run.row(f"{what}: MoE form, exchanged rows against replicated tokens ({tokens} tokens a MoE call)",
            f"exchanged {us(exc)}", f"replicated {us(rep)}",
            f"{rep / exc:.2f}x: {best} wins (the default policy picks {default_form(tokens)})", n)


def part_mini(run: Run, counts: list[int]) -> None:
    args = run.args
    cfg = model_config(args.preset)
    label = "quick stand-in" if args.preset == "quick" else cfg.name
    model = model_for(run, cfg, label)
    batches = [int(b) for b in args.batches.split(",") if b]
    print(f"\n## {label} ({cfg.name}) on meshes of {counts} devices, impl {args.impl}", flush=True)
    for n in counts:
        layouts = {"ep": {"expert": n}, "ep_tp": {"expert": n // args.tensor, "tensor": args.tensor}}
        for layout in args.layouts.split(","):
            sizes = layouts[layout]
            if math.prod(sizes.values()) != n:
                print(f"  {layout} on {n} devices: no such mesh with tensor={args.tensor}; skipped", flush=True)
                continue
            mesh = make_mesh(sizes, devices=jax.devices()[:n])
            where = f"{label}, {describe(mesh)}"
            print(f"\n### {where}", flush=True)
            kinds = [("decode", b, forms_of(args.decode_forms, args.forms)) for b in batches]
            kinds += [("prefill", 1, forms_of(args.prefill_forms, args.forms))] if args.prefill else []
            for kind, batch, forms in kinds:
                times = {}
                for form in forms:
                    what = model.what(kind, mesh, form, batch)

                    def variant(kind=kind, batch=batch, form=form, what=what):
                        seconds = model.variant(kind, mesh, form, batch)
                        if seconds is None:
                            return
                        one = model.one_device(kind, batch)[2]
                        times[form] = seconds
                        rate = f", {args.prefill / seconds:,.0f} tok/s" if kind == "prefill" else ""
                        run.row(what, ms(seconds) + rate, f"one device {ms(one)}", f"{one / seconds:.2f}x one device",
                                n)

                    guarded(run, what, n, variant)
                tokens = batch if kind == "decode" else min(args.prefill_chunk, args.prefill)
                form_row(run, model.what(kind, mesh, None, batch), where, tokens, times, n)
            model.placed.clear()


# --------------------------------------------------------------------------------------------- the MoE layer

def collectives(run: Run, devices: list) -> tuple[float, float]:
    """(all-reduce bus bandwidth, all-to-all rate) over ``devices``, bytes per second, each result checked."""
    n = len(devices)
    mesh = make_mesh({"expert": n}, devices=devices)
    values = int(run.args.collective_mib * 2**20) // (2 * n * n) * n * n  # bf16 a device, [n, m] blocks
    spec = PartitionSpec("expert")
    rows = np.arange(n * n) % 128  # exact in bf16: each row's value names it
    x = jax.jit(lambda: jnp.broadcast_to(jnp.asarray(rows, jnp.bfloat16)[:, None], (n * n, values // n)),
                out_shardings=NamedSharding(mesh, spec))()  # made on the devices: 2 GiB in all for 8 GPUs
    nbytes = values * 2
    all_reduce = jax.jit(jax.shard_map(lambda a: jax.lax.psum(a, "expert") * (1 / n), mesh=mesh, in_specs=spec,
                                       out_specs=spec))
    all_to_all = jax.jit(jax.shard_map(lambda a: jax.lax.all_to_all(a, "expert", 0, 0, tiled=True), mesh=mesh,
                                       in_specs=spec, out_specs=spec))
    summed = rows.reshape(n, n).mean(axis=0)  # device d's block: the mean over sources of row i of each block
    got_sum = np.asarray(all_reduce(x)[:, 0], np.float32).reshape(n, n)
    got_a2a = np.asarray(all_to_all(x)[:, 0], np.float32).reshape(n, n)
    if not (np.allclose(got_sum, summed[None, :], rtol=1e-2) and np.array_equal(got_a2a, rows.reshape(n, n).T)):
        FAILED.append("collectives: wrong results")
        run.say("check collectives: FAILED")
    reduce_s = best_of(lambda: all_reduce(x), run.args.calls, run.args.rounds)
    a2a_s = best_of(lambda: all_to_all(x), run.args.calls, run.args.rounds)
    busbw, a2a = 2 * (n - 1) / n * nbytes / reduce_s, (n - 1) / n * nbytes / a2a_s
    run.row(f"all-reduce (psum under shard_map) of {size(nbytes)} bf16 a device over {n} devices: bus bandwidth "
            f"2(n-1)/n x bytes / time", f"{busbw / 1e9:,.1f} GB/s ({us(reduce_s)})", "-", "-", n)
    run.row(f"all-to-all (jax.lax.all_to_all) of {size(nbytes)} bf16 a device over {n} devices: (n-1)/n x bytes / time",
            f"{a2a / 1e9:,.1f} GB/s ({us(a2a_s)})", f"all-reduce bus bandwidth {busbw / 1e9:,.1f} GB/s",
            f"{a2a / busbw:.2f}x", n)
    return busbw, a2a


def _scaled(x, w1, w3, w2, weights, experts):
    """A device's experts replaced by the identity: each pair routed to one of them adds its weight times its row."""
    mine = jnp.where(experts < w1.shape[0], weights, 0.0)
    return (x.astype(jnp.float32) * jnp.sum(mine, axis=1, keepdims=True)).astype(x.dtype)


def collectives_alone(run: Run, cfg: K3Config, mesh, tokens: int, busbw: float, a2a: float) -> None:
    """The routed experts' collectives at ``tokens`` tokens without the experts' work, in both forms."""
    n, moe = mesh.devices.size, cfg.moe
    R, E, k = moe.latent_size or cfg.hidden_size, moe.num_experts, moe.experts_per_token
    keys = jax.random.split(jax.random.key(tokens), 3)
    x = jax.random.normal(keys[0], (tokens, R), run.dtype)
    weights = jax.random.uniform(keys[1], (tokens, k), jnp.float32, 0.5, 1.0)
    experts = jnp.argsort(jax.random.uniform(keys[2], (tokens, E)), axis=1)[:, :k].astype(jnp.int32)  # k distinct
    want = np.asarray(x, np.float32) * np.asarray(weights).sum(axis=1, keepdims=True)
    rows = NamedSharding(mesh, batch_spec(tokens, mesh, 2))  # the tokens as the attention holds them
    x, weights, experts = (jax.device_put(a, rows) for a in (x, weights, experts))
    stacks = jax.device_put(jnp.zeros((E, 1), run.dtype), expert_sharding(mesh, E) if mesh_axes("experts", E, mesh)
                            else NamedSharding(mesh, PartitionSpec()))
    comm = communication(cfg, abstract_mesh({a: int(s) for a, s in mesh.shape.items()}), tokens)
    for form in forms_of(run.args.forms, ""):
        what = f"MoE collectives alone (experts replaced by a scaling), {tokens} tokens, {describe(mesh)}, {form}"

        def variant(form=form, what=what):
            fn = jax.jit(lambda x, s, w, e: moe_expert_parallel(x, s, s, s, w, e, _scaled, mesh,
                                                                exchange=form == "exchanged"))
            if not run.check(what, row_errors(fn(x, stacks, weights, experts), want), n):
                return
            seconds = best_of(lambda: fn(x, stacks, weights, experts), run.args.calls, run.args.rounds)
            sent = (comm.moe_exchanged if form == "exchanged" else comm.moe_replicated) * tokens
            rate = sent / seconds
            run.row(what, f"{us(seconds)}; modelled {size(sent)} a device: {rate / 1e9:,.2f} GB/s",
                    f"all-to-all {a2a / 1e9:,.1f} GB/s; all-reduce bus bandwidth {busbw / 1e9:,.1f} GB/s",
                    f"{rate / a2a:.2f}x all-to-all, {rate / busbw:.2f}x all-reduce", n)

        guarded(run, what, n, variant)


def part_moe(run: Run, n: int) -> None:
    args = run.args
    cfg = preset(args.moe_preset)
    moe = cfg.moe
    sizes = parse_mesh(args.moe_mesh) if args.moe_mesh else {"expert": n}
    n = math.prod(sizes.values())
    if n > len(jax.devices()):
        print(f"\n## MoE layer: mesh {args.moe_mesh} needs {n} devices; skipped", flush=True)
        return
    mesh = make_mesh(sizes, devices=jax.devices()[:n])
    label = "K3 MoE layer" if args.moe_preset == "kimi-k3" else f"{args.moe_preset} MoE layer"
    print(f"\n## {label}: {moe.num_experts} MXFP4 experts, R {moe.latent_size}, F {moe.intermediate_size}, top "
          f"{moe.experts_per_token}, {moe.num_shared_experts} shared; {describe(mesh)}, impl {args.impl}", flush=True)
    busbw, a2a = collectives(run, jax.devices()[:n])
    graph, state = random_moe(cfg, 0, run.dtype)
    placed = place_moe(cfg, state, mesh)
    calls = [(int(t), 1) for t in args.moe_tokens.split(",") if t]
    calls += [(1, args.moe_prefill)] if args.moe_prefill else []
    for B, T in calls:
        tokens = B * T
        x = jax.random.normal(jax.random.key(tokens), (B, T, cfg.hidden_size), run.dtype)
        with use_implementation(args.impl):
            one_fn = jax.jit(lambda p, x: nnx.merge(graph, p)(x))
            want = np.asarray(one_fn(state, x), np.float32)
            one = best_of(lambda: one_fn(state, x), args.calls, args.rounds)
        run.say(f"one device, {tokens} tokens: {us(one)}")
        x_mesh = place_batch(x, mesh)
        times = {}
        kind = f"decode B={B}" if T == 1 else f"prefill chunk of {T} tokens"
        for form in forms_of(args.forms, ""):
            what = f"{label}, {kind}, {describe(mesh)}, {form}"

            def variant(form=form, what=what):
                with on_mesh(mesh), use_implementation(args.impl, policy(form)):
                    fn = jax.jit(lambda p, x: nnx.merge(graph, p)(x))
                    if not run.check(what, row_errors(fn(placed, x_mesh), want), n):
                        return
                    seconds = best_of(lambda: fn(placed, x_mesh), args.calls, args.rounds)
                times[form] = seconds
                run.row(what, us(seconds), f"one device {us(one)}", f"{one / seconds:.2f}x one device", n)

            guarded(run, what, n, variant)
        form_row(run, f"{label}, {kind}, {describe(mesh)}", f"{label}, {describe(mesh)}", tokens, times, n)
        collectives_alone(run, cfg, mesh, tokens, busbw, a2a)


# ------------------------------------------------------------------------------------------------ decoder slice

def floor_bytes(cfg: K3Config, sizes: dict[str, int], batch: int, context: int) -> float:
    """Bytes one device must read (and write) for a decode step on a mesh of ``sizes``, each part placed as
    ``k3jax.memory`` places it: its share of every weight but the embedding table (one row of it is read) and the
    routed experts; its share of the distinct experts the batch is expected to touch under uniform routing, in
    MXFP4; its sequences' KDA state, read and written; their MLA cache of ``context`` positions, read."""
    mesh = abstract_mesh(sizes)
    held = device_weights(cfg, mesh)
    V, D = cfg.vocab_size, cfg.hidden_size
    embedding = spec_bytes((V, D), 2, param_spec(cfg, "embed_tokens.weight", (V, D), mesh), mesh)
    moe = cfg.moe
    E, k = moe.num_experts, moe.experts_per_token
    per_expert = 3 * moe.intermediate_size * (moe.latent_size or D) * MXFP4_BYTES
    group = devices_over(mesh_axes("experts", E, mesh), mesh)
    distinct = E * (1 - (1 - k / E) ** batch)
    moe_layers = sum(map(cfg.is_moe_layer, range(cfg.num_layers)))
    caches = per_device(cfg, sizes, context, batch)
    return (held.total - held.routed_experts - embedding + moe_layers * distinct / group * per_expert
            + 2 * caches.kda_state + caches.mla_cache)


def part_slice(run: Run) -> None:
    args = run.args
    t = args.slice_tensor
    if t > len(jax.devices()):
        print(f"\n## slice: tensor={t} needs {t} devices, {len(jax.devices())} here; skipped", flush=True)
        return
    bandwidth = copy_rate(args.quick)
    quick = args.slice_preset == "quick"
    cfg = model_config("quick") if quick else group_config(args.slice_preset, experts=args.slice_experts or None)
    label = "quick stand-in" if quick else "K3 decoder slice" if args.slice_preset == "kimi-k3" else \
        f"{args.slice_preset} decoder slice"
    print(f"\n## {label}: {cfg.name}, tensor={t}; copy rate {bandwidth / 1e12:.3f} TB/s", flush=True)
    model = model_for(run, cfg, label)
    mesh = make_mesh({"tensor": t}, devices=jax.devices()[:t])
    context = args.prompt + 64
    for batch in (int(b) for b in args.slice_batches.split(",") if b):
        one = model.one_device("decode", batch)[2]
        one_floor = floor_bytes(cfg, {}, batch, context) / bandwidth
        run.row(f"{label} decode step B={batch}, one device", ms(one), f"floor {ms(one_floor)}",
                f"{one / one_floor:.1f}x floor", 1)
        what = model.what("decode", mesh, None, batch)

        def variant(batch=batch):
            seconds = model.variant("decode", mesh, None, batch)
            if seconds is None:
                return
            floor = floor_bytes(cfg, {"tensor": t}, batch, context) / bandwidth
            run.row(what, ms(seconds), f"per-device floor {ms(floor)}; one device {ms(one)}",
                    f"{seconds / floor:.1f}x floor; {one / seconds:.2f}x one device", t)

        guarded(run, what, t, variant)
    model.placed.clear()


# ------------------------------------------------------------------------------------------------------- main

def table() -> str:
    head = ["metric", "value", "peer (same run)", "ratio", "device", "date", "command"]
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join("---" for _ in head) + " |"]
    for r in ROWS:
        cells = [r[k].replace("|", "/") for k in ("metric", "value", "peer", "ratio", "device", "date")]
        lines.append("| " + " | ".join(cells + [f"`{r['command']}`"]) + " |")
    return "\n".join(lines)


def crossovers() -> list[str]:
    """Per mesh: the fewest tokens a MoE call from which the exchanged rows won at every larger count measured."""
    out = []
    for where, won in WINNERS.items():
        counts = sorted(won)
        from_here = [t for i, t in enumerate(counts) if all(won[u] == "exchanged" for u in counts[i:])]
        verdict = f"exchanged rows won from {from_here[0]} tokens a call up" if from_here else \
            f"replicated tokens won at {counts[-1]} tokens a call, the most measured"
        out.append(f"  {where}: {verdict} ({', '.join(f'{t}: {won[t]}' for t in counts)})")
    return out


def report() -> str:
    """What the run found, the table last."""
    lines = []
    if WINNERS:
        lines += ["", f"MoE form by tokens a call (KernelPolicy.expert_exchange_min_tokens is "
                      f"{KernelPolicy().expert_exchange_min_tokens}):", *crossovers()]
    if jax.default_backend() == "cpu":
        lines += ["", "The times are meaningless on CPU devices (the simulated devices share the host's cores). "
                      "The checks are real."]
    if FAILED:
        lines += ["", "FAILED: " + "; ".join(FAILED)]
    lines += ["", "ratio: peer / value for times (above 1: faster than the peer); value / peer for rates; "
                  "x floor: time / floor (lower is better)", table()]
    return "\n".join(lines)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", default="moe,mini,slice", help="comma-separated: moe, mini, slice")
    ap.add_argument("--gpus", default="2,4,8", help="device counts of the meshes (sizes above the devices: skipped)")
    ap.add_argument("--quick", action="store_true", help="the smoke check on simulated CPU devices (see above)")
    ap.add_argument("--impl", default=None, choices=["pallas", "reference"],
                    help="the implementation (default: pallas on a GPU, reference elsewhere)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="parameters' and inputs' dtype (--quick: float32)")
    ap.add_argument("--tol", type=float, default=2e-2, help="the MoE layer's check (bf16): a row's largest "
                    "difference over its largest |value|")
    ap.add_argument("--check-tol", type=float, default=1e-3, help="the model's checks (float32), the same measure")
    ap.add_argument("--forms", default="replicated,exchanged", help="MoE forms timed at each token count")
    ap.add_argument("--out", default="", help="also write the table (and what failed) to this file")
    mini = ap.add_argument_group("mini")
    mini.add_argument("--preset", default="mini", help="the model of the mini part")
    mini.add_argument("--layouts", default="ep,ep_tp", help="ep: expert=n; ep_tp: expert=n/t,tensor=t (t: --tensor)")
    mini.add_argument("--tensor", type=int, default=2, help="the tensor size of the ep_tp layout")
    mini.add_argument("--batches", default="1,8,64", help="decode batch sizes")
    mini.add_argument("--decode-forms", default="", help="MoE forms of the decode steps (default: --forms)")
    mini.add_argument("--prefill-forms", default="", help="MoE forms of the prefill (default: --forms)")
    mini.add_argument("--prompt", type=int, default=128, help="the timed decode position (the cache: prompt + 64)")
    mini.add_argument("--check-steps", type=int, default=3, help="checked decode steps from an empty cache (at least)")
    mini.add_argument("--prefill", type=int, default=8192, help="prompt tokens of the prefill (0: none)")
    mini.add_argument("--prefill-chunk", type=int, default=2048)
    mini.add_argument("--check-prefill", type=int, default=512, help="prompt tokens of the prefill's float32 check "
                      "(in chunks of half as many)")
    mini.add_argument("--attend-block", type=int, default=0, help="the prefill Generator's attend_block (0: the "
                      "whole cache, one compiled chunk; 256, Generator's default: a chunk per window, 3 at 8K)")
    moe = ap.add_argument_group("moe")
    moe.add_argument("--moe-mesh", default="", help="the MoE layer's mesh, e.g. 'expert=4,tensor=2' (default: "
                     "expert=n, n the largest of --gpus here)")
    moe.add_argument("--moe-preset", default="kimi-k3", help="the preset whose MoE layer is timed")
    moe.add_argument("--moe-tokens", default="1,8,32,64,128,256", help="decode batches of the MoE layer")
    moe.add_argument("--moe-prefill", type=int, default=2048, help="tokens of its prefill chunk (0: none)")
    moe.add_argument("--collective-mib", type=float, default=256.0, help="MiB a device of the collectives' buffer")
    part = ap.add_argument_group("slice")
    part.add_argument("--slice-preset", default="kimi-k3", help="the preset whose repeating group is the slice")
    part.add_argument("--slice-experts", type=int, default=64, help="routed experts of the slice (K3: 896; 0: "
                      "the preset's)")
    part.add_argument("--slice-tensor", type=int, default=8)
    part.add_argument("--slice-batches", default="1,8,64")
    timing = ap.add_argument_group("timing")
    timing.add_argument("--rounds", type=int, default=5)
    timing.add_argument("--calls", type=int, default=10, help="calls (decode steps) a timed round")
    timing.add_argument("--warm-up", type=float, default=2.0, help="seconds of decode steps before each decode timing")
    if "--quick" in (sys.argv[1:] if argv is None else argv):
        ap.set_defaults(**QUICK)
    args = ap.parse_args(argv)
    if args.impl is None:
        args.impl = "pallas" if jax.default_backend() == "gpu" else "reference"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.quick and jax.default_backend() == "cpu":
        jax.config.update("jax_disable_most_optimizations", True)  # its programs run a few times: compiles dominate
    run = Run(args)

    def finish(*_) -> int:
        text = report()
        print(text, flush=True)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text + "\n")
        return 1 if FAILED else 0

    # a run stopped at a time limit still prints and writes what it measured
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(finish() or 1))
    available = len(jax.devices())
    wanted = [int(n) for n in args.gpus.split(",") if n]
    counts = [n for n in wanted if n <= available]
    skipped = [n for n in wanted if n > available]
    print(f"{available} devices ({run.kind}); meshes of {counts} devices"
          f"{f'; skipped {skipped}: more than the devices' if skipped else ''}", flush=True)
    if jax.default_backend() == "cpu":
        print("The times are meaningless on CPU devices (the simulated devices share the host's cores). The checks "
              "are real.", flush=True)
    parts = args.parts.split(",")
    if "moe" in parts and counts:
        part_moe(run, max(counts))
    if "mini" in parts and counts:
        part_mini(run, counts)
    if "slice" in parts:
        part_slice(run)
    return finish()


if __name__ == "__main__":
    sys.exit(main())
