"""Training: any preset on a byte corpus, with optax AdamW and orbax checkpoints of the whole train state.

    from k3jax.train import TrainConfig, train
    result = train(TrainConfig(steps=200), "runs/nano")       # or: k3jax train --out runs/nano

One optimizer step reads ``batch`` windows of ``seq_len + 1`` bytes (``k3jax.batches``), split into
``accumulate`` micro-batches whose gradients are summed (``lax.scan``) before AdamW (warmup, then cosine
decay to ``min_lr_ratio`` of the peak; global-norm clipping; weight decay on matrices only). Master weights
are float32; ``compute_dtype="bfloat16"`` runs the forward and backward in bfloat16 (the parameters the
model keeps in float32 stay so) and the loss in float32. After each step the routers' correction biases
move toward under-loaded experts (``objective.balance_router_bias``; spec section 5's bias-only
balancing). The step is one jitted function of (state, tokens, mask) with the state donated: it compiles
once per shape.

A run folder holds ``metrics.jsonl`` (one JSON object per logged step and per evaluation),
``checkpoints/<step>/`` (orbax: params, optimizer state, step, data position and RNG key; the last two
kept) and, at the end, ``model/``: the trained model in the released layout with routed experts in MXFP4
(``k3jax.load`` reads it), and ``summary.json`` with the held-out loss before and after quantization.
Calling ``train`` again on the same folder resumes from its last checkpoint and continues exactly (same
batches, same updates) as if it had never stopped.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, TextIO

import jax
import jax.numpy as jnp
import optax
import orbax.checkpoint as ocp
from flax import nnx

from convert.progress import clock
from k3jax.batches import TrainWindows, eval_windows
from k3jax.config import K3Config
from k3jax.corpus import Corpus, load_corpus
from k3jax.implementation import use_implementation
from k3jax.model import K3Model
from k3jax.objective import (
    LossParts, Params, balance_router_bias, bits_per_byte, compute_dtypes, cross_entropy, loss_parts,
)
from k3jax.presets import preset, preset_hf_config

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclass(frozen=True)
class TrainConfig:
    """Everything a run depends on; the defaults train the shipped ``nano`` (k3jax/data/nano)."""

    preset: str = "nano"
    steps: int = 800
    batch: int = 16  # sequences per optimizer step
    seq_len: int = 128  # tokens (bytes) per sequence
    accumulate: int = 1  # micro-batches per step (batch must be a multiple)
    learning_rate: float = 2e-3  # peak
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1  # the cosine decay's end, as a fraction of the peak
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    clip_norm: float = 1.0
    compute_dtype: str = "float32"  # or "bfloat16"
    router_bias_rate: float = 1e-3  # the bias-only balancing step (0: off)
    implementation: str = "reference"  # or "pallas"
    scan_layers: bool = True
    seed: int = 0
    log_every: int = 10
    eval_every: int = 400
    eval_bytes: int = 0  # held-out bytes each evaluation reads (0: all of them)
    checkpoint_every: int = 200

    def check(self) -> None:
        """ValueError naming the field of a setting that cannot run."""
        for name in ("steps", "batch", "seq_len", "accumulate", "log_every", "eval_every", "checkpoint_every"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name}: {getattr(self, name)!r}, expected a positive integer")
        if self.batch % self.accumulate:
            raise ValueError(f"accumulate: {self.accumulate} does not divide batch {self.batch}")
        if self.compute_dtype not in DTYPES:
            raise ValueError(f"compute_dtype: {self.compute_dtype!r}, expected one of {sorted(DTYPES)}")
        if self.implementation not in ("reference", "pallas"):
            raise ValueError(f"implementation: {self.implementation!r}, expected 'reference' or 'pallas'")
        if not 0 <= self.warmup_steps < self.steps:
            raise ValueError(f"warmup_steps: {self.warmup_steps}, expected 0 <= warmup_steps < steps ({self.steps})")
        preset(self.preset)


def schedule(cfg: TrainConfig) -> optax.Schedule:
    """Linear warmup to the peak, then cosine decay to ``min_lr_ratio`` of it at the last step."""
    return optax.warmup_cosine_decay_schedule(0.0, cfg.learning_rate, cfg.warmup_steps, cfg.steps,
                                              cfg.learning_rate * cfg.min_lr_ratio)


def optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW with weight decay on parameters of two or more dimensions."""
    decay = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
    return optax.chain(optax.clip_by_global_norm(cfg.clip_norm),
                       optax.adamw(schedule(cfg), cfg.b1, cfg.b2, weight_decay=cfg.weight_decay, mask=decay))


def init_state(cfg: TrainConfig, model_cfg: K3Config | None = None) -> dict[str, Any]:
    """A fresh train state: float32 params (seeded by ``cfg.seed``), optimizer state, step 0, position 0,
    the RNG key's data; placed on the default device as a restored state is (so both meet one compiled step)."""
    model = K3Model(model_cfg or preset(cfg.preset), rngs=nnx.Rngs(cfg.seed), packed_experts=False)
    params = nnx.to_pure_dict(nnx.state(model))
    state = {"params": params, "opt_state": optimizer(cfg).init(params), "step": jnp.zeros((), jnp.int32),
             "position": jnp.zeros((), jnp.int32), "rng": jax.random.key_data(jax.random.key(cfg.seed))}
    return jax.device_put(state, jax.devices()[0])


class Trainer:
    """The jitted train and eval steps of one configuration (``graphdef`` is the model's structure)."""

    def __init__(self, cfg: TrainConfig, model_cfg: K3Config | None = None):
        cfg.check()
        self.cfg = cfg
        self.model_cfg = model_cfg or preset(cfg.preset)
        self.graphdef = nnx.graphdef(nnx.eval_shape(lambda: K3Model(self.model_cfg, rngs=nnx.Rngs(0),
                                                                    packed_experts=False)))
        self.dtypes = None if cfg.compute_dtype == "float32" else compute_dtypes(self.model_cfg,
                                                                                 DTYPES[cfg.compute_dtype])
        self.tx = optimizer(cfg)
        self.step = jax.jit(self._step, donate_argnums=0)
        self.eval_step = jax.jit(self._parts)

    def _parts(self, params: Params, tokens, mask) -> LossParts:
        with use_implementation(self.cfg.implementation):
            return loss_parts(self.graphdef, params, tokens, mask, self.dtypes, self.cfg.scan_layers)

    def _grads(self, params: Params, tokens, mask):
        """Summed nats' gradient, summed over the micro-batches of tokens [A, b, T + 1]."""
        def value(p, t, m):
            parts = self._parts(p, t, m)
            return parts.nll, parts

        grad = jax.grad(value, has_aux=True)
        if tokens.shape[0] == 1:
            return grad(params, tokens[0], mask[0])

        def micro(carry, batch):
            g, parts = grad(params, *batch)
            return jax.tree.map(jnp.add, carry, (g, parts)), None

        zeros = jax.tree.map(jnp.zeros_like, jax.eval_shape(grad, params, tokens[0], mask[0]))
        return jax.lax.scan(micro, zeros, (tokens, mask))[0]

    def _step(self, state: dict[str, Any], tokens, mask):
        """One optimizer step on tokens [A, b, T + 1] and mask [A, b, T]: (new state, metrics)."""
        params = state["params"]
        grads, parts = self._grads(params, tokens, mask)
        count = jnp.maximum(parts.count, 1.0)
        grads = jax.tree.map(lambda g: g / count, grads)
        updates, opt_state = self.tx.update(grads, state["opt_state"], params)
        params = balance_router_bias(optax.apply_updates(params, updates), parts.load, self.cfg.router_bias_rate)
        moe = parts.load.sum(axis=1) > 0
        imbalance = jnp.max(parts.load, axis=1) / jnp.maximum(jnp.mean(parts.load, axis=1), 1e-9)
        metrics = {"loss": parts.nll / count, "grad_norm": optax.tree.norm(grads),
                   "learning_rate": schedule(self.cfg)(state["step"]),
                   "expert_load_max_over_mean": jnp.max(jnp.where(moe, imbalance, 0.0))}
        new = {"params": params, "opt_state": opt_state, "step": state["step"] + 1,
               "position": state["position"] + tokens.shape[0] * tokens.shape[1], "rng": state["rng"]}
        return new, metrics

    def batch(self, windows: TrainWindows, position: int) -> tuple[jax.Array, jax.Array]:
        """The step's tokens [A, b, T + 1] and mask at a data position."""
        A, b = self.cfg.accumulate, self.cfg.batch // self.cfg.accumulate
        tokens = windows.at(position, self.cfg.batch).reshape(A, b, -1)
        return jnp.asarray(tokens), jnp.ones((A, b, tokens.shape[-1] - 1), jnp.float32)

    def evaluate(self, params: Params, data: bytes) -> dict[str, float]:
        """Mean held-out nats per byte and bits per byte over ``data``."""
        return evaluate(lambda t, m: self.eval_step(params, t, m), data, self.cfg.seq_len, self.cfg.batch)


@functools.lru_cache(maxsize=8)
def trainer_for(cfg: TrainConfig) -> Trainer:
    """The ``Trainer`` of a configuration, kept for the process: runs of one configuration (a resumed run, a
    notebook's re-run) reuse its compiled steps."""
    return Trainer(cfg)


def evaluate(parts: Callable[[Any, Any], LossParts | tuple], data: bytes, seq_len: int, batch: int
             ) -> dict[str, float]:
    """``parts(tokens, mask)`` -> (summed nats, count, ...) over the eval windows of ``data``: the mean
    loss (nats per byte) and bits per byte."""
    nll = count = 0.0
    for tokens, mask in eval_windows(data, seq_len, batch):
        out = parts(jnp.asarray(tokens), jnp.asarray(mask))
        nll, count = nll + float(out[0]), count + float(out[1])
    return {"eval_loss": nll / max(count, 1.0), "eval_bpb": bits_per_byte(nll, count), "eval_bytes": int(count)}


def model_parts(model: K3Model, scan_layers: bool = True) -> Callable:
    """``evaluate``'s function for a ready model (a loaded checkpoint, MXFP4 experts included)."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def parts(state, tokens, mask):
        logits = nnx.merge(graphdef, state)(tokens[:, :-1], scan_layers=scan_layers)
        return cross_entropy(logits, tokens[:, 1:], mask)

    return lambda tokens, mask: parts(state, tokens, mask)


class Checkpoints:
    """The run's orbax checkpoints of the whole train state, the last two kept."""

    def __init__(self, folder: Path):
        self.manager = ocp.CheckpointManager(folder.absolute(), options=ocp.CheckpointManagerOptions(
            max_to_keep=2, create=True))

    def latest(self) -> int | None:
        return self.manager.latest_step()

    def save(self, state: dict[str, Any]) -> None:
        self.manager.save(int(state["step"]), args=ocp.args.StandardSave(state))
        self.manager.wait_until_finished()

    def restore(self, target: dict[str, Any]) -> dict[str, Any]:
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
        return self.manager.restore(self.latest(), args=ocp.args.StandardRestore(abstract))


class _Report:
    """The progress line (step, loss, tokens/s, ETA) on ``stream``: rewritten in place on a terminal,
    else a line every ``log_every`` steps; and the JSONL metrics."""

    def __init__(self, metrics: Path, stream: TextIO | None, in_place: bool | None = None):
        self.metrics, self.stream = metrics.open("a"), stream
        self.in_place = stream is not None and (stream.isatty() if in_place is None else in_place)

    def record(self, entry: dict[str, Any]) -> None:
        self.metrics.write(json.dumps(entry) + "\n")
        self.metrics.flush()

    def line(self, text: str, final: bool = False) -> None:
        if self.stream is None:
            return
        self.stream.write(f"\r{text}\033[K" + ("\n" if final else "") if self.in_place else text + "\n")
        self.stream.flush()

    def close(self) -> None:
        self.metrics.close()


def train(cfg: TrainConfig, out: str | Path, *, corpus: Corpus | None = None, stop_at: int | None = None,
          stream: TextIO | None = sys.stderr, export: bool = True) -> dict[str, Any]:
    """Train ``cfg`` into the run folder ``out`` (resuming from its last checkpoint when it has one) up to
    step ``stop_at`` (default ``cfg.steps``; a run stopped early resumes where it stopped). At the last step
    it evaluates on the held-out split and, with ``export``, writes ``model/`` (MXFP4 experts) and
    ``summary.json``. Returns the summary: final train and held-out loss, bits per byte, time, device."""
    cfg.check()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    _remember_config(out, cfg)
    corpus = corpus or load_corpus()
    trainer = trainer_for(cfg)
    windows = TrainWindows(corpus.train, cfg.seq_len, cfg.seed)
    checkpoints = Checkpoints(out / "checkpoints")
    state = init_state(cfg, trainer.model_cfg)
    if checkpoints.latest() is not None:
        state = checkpoints.restore(state)
    report = _Report(out / "metrics.jsonl", stream)
    first, last = int(state["step"]), min(stop_at or cfg.steps, cfg.steps)
    tokens_per_step = cfg.batch * cfg.seq_len
    start = time.perf_counter()
    timed_from, timed_steps, metrics, final_eval = None, 0, {}, None
    held = corpus.held_out[:cfg.eval_bytes] if cfg.eval_bytes else corpus.held_out
    try:
        for step in range(first, last):
            tokens, mask = trainer.batch(windows, int(state["position"]))
            state, metrics = trainer.step(state, tokens, mask)
            done = step + 1
            if done % cfg.log_every == 0 or done == last:
                metrics = {k: float(v) for k, v in metrics.items()}
                now = time.perf_counter()
                if timed_from is None:  # the first logged step includes compilation: rates start after it
                    timed_from, timed_steps, rate = now, done, 0.0
                else:
                    rate = (done - timed_steps) * tokens_per_step / max(now - timed_from, 1e-9)
                eta = (cfg.steps - done) * tokens_per_step / rate if rate else 0.0
                report.record({"step": done, **metrics, "tokens_per_s": rate, "elapsed_s": now - start})
                report.line(f"step {done}/{cfg.steps}  loss {metrics['loss']:.4f}  {rate:,.0f} tokens/s  "
                            f"ETA {clock(eta)}")
            if done % cfg.eval_every == 0 or done == cfg.steps:
                result = trainer.evaluate(state["params"], held)
                final_eval = result if done == cfg.steps else None
                report.record({"step": done, **result})
                report.line(f"step {done}: held-out loss {result['eval_loss']:.4f}, {result['eval_bpb']:.4f} bits/byte",
                            final=True)
            if done % cfg.checkpoint_every == 0 or done == last:
                checkpoints.save(state)
    finally:
        report.close()
    summary = {"steps": int(state["step"]), "seconds": time.perf_counter() - start, "device": _device(),
               "train_loss": metrics.get("loss")}
    if int(state["step"]) == cfg.steps:
        summary |= _finish(cfg, trainer, state["params"], held, final_eval, out, export)
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _finish(cfg: TrainConfig, trainer: Trainer, params: Params, held: bytes, float32: dict | None, out: Path,
            export: bool):
    """Held-out loss of the trained float32 model (``float32``, the last step's evaluation, when this run
    made it), of the same with its routed experts through MXFP4
    (encoded and decoded: the quantization alone; K3-layout models) and, with ``export``, of the exported model as
    ``k3jax.load`` reads it (bf16 tensors, MXFP4 experts)."""
    from k3jax.mx import decode_compiled, quantize_compiled

    result = {"float32": float32 or trainer.evaluate(params, held)}
    if trainer.model_cfg.mx_experts:
        mx = jax.tree_util.tree_map_with_path(
            lambda path, p: decode_compiled(quantize_compiled(p), p.dtype) if "'experts'" in jax.tree_util.keystr(path)
            else p, params)
        result["float32_mxfp4_experts"] = trainer.evaluate(mx, held)
    if export:
        from k3jax.checkpoint import load

        folder = export_model(cfg, trainer.graphdef, params, out / "model")
        with use_implementation(cfg.implementation):
            result["exported"] = evaluate(model_parts(load(folder)), held, cfg.seq_len, cfg.batch)
    return {"held_out": result}


def export_model(cfg: TrainConfig, graphdef: nnx.GraphDef, params: Params, folder: Path) -> Path:
    """The trained model as a released-layout folder in the released dtypes: routed experts in MXFP4 (K3),
    A_log, dt_bias, conv weights and router biases float32, the rest bf16 (as K3 ships them). Replaces
    ``folder`` if it exists."""
    import shutil

    from convert.export import export, model_params
    from k3jax.mx import quantize_compiled

    values = model_params(nnx.merge(graphdef, params))
    if preset(cfg.preset).mx_experts:  # K3; Kimi Linear's experts stay arrays
        values = {k: quantize_compiled(jnp.asarray(v)) if ".experts.w" in k else v for k, v in values.items()}
    if folder.exists():
        shutil.rmtree(folder)
    return export(values, preset_hf_config(cfg.preset), folder)


def _remember_config(out: Path, cfg: TrainConfig) -> None:
    """Write ``out/train_config.json``, or refuse to resume a run made with another configuration."""
    path = out / "train_config.json"
    mine = dataclasses.asdict(cfg)
    if path.exists():
        theirs = json.loads(path.read_text())
        changed = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
        if changed:
            raise ValueError(f"{out}: a run made with other settings ({', '.join(changed)}); resume it with the "
                             f"same settings or choose another --out")
    else:
        path.write_text(json.dumps(mine, indent=2) + "\n")


def _device() -> str:
    d = jax.devices()[0]
    return f"{d.platform}: {getattr(d, 'device_kind', d.platform)}"


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """A run's ``metrics.jsonl`` as a list of dicts."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


__all__ = ["Checkpoints", "TrainConfig", "Trainer", "evaluate", "export_model", "init_state", "model_parts",
           "optimizer", "read_metrics", "schedule", "train", "trainer_for"]
