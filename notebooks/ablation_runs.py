"""The ablation behind notebooks/training_and_ablation.ipynb: nano against nano with plain residuals and
nano with Kimi Linear's unbounded gate, at equal compute (same steps, batch, length, schedule and seed).

    python notebooks/ablation_runs.py [--steps 1000] [--batch 16] [--eval-bytes 0] [--out notebooks/runs/ablation]
                                      [--variants nano,...]

Each variant trains with ``k3jax.train.train`` into ``OUT/<preset>/`` (``metrics.jsonl``, written as it
goes, ``train_config.json`` and ``summary.json``); its checkpoints are deleted once the run completes. Three runs of the default 1000 steps are GPU work (the shipped nano's 800 steps took 39 minutes
on a 2-core CPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import sys
from pathlib import Path

from k3jax.train import TrainConfig, train

VARIANTS = ("nano", "nano_plain_residual", "nano_softplus_gate")


def run(config: TrainConfig, out: Path, variants=VARIANTS, stream=sys.stderr, corpus=None) -> dict[str, dict]:
    """Train each variant with ``config`` (its preset replaced) into ``out/<variant>``; return the summaries."""
    summaries = {}
    for name in variants:
        summaries[name] = train(dataclasses.replace(config, preset=name), out / name, stream=stream, export=False,
                                corpus=corpus)
        shutil.rmtree(out / name / "checkpoints")
    return summaries


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=TrainConfig.batch)
    ap.add_argument("--eval-bytes", type=int, default=TrainConfig.eval_bytes,
                    help="held-out bytes each evaluation reads (0: all)")
    ap.add_argument("--out", default="notebooks/runs/ablation")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated presets (one process each "
                    "can run them side by side)")
    args = ap.parse_args()
    variants = args.variants.split(",")
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        ap.error(f"--variants: unknown {sorted(unknown)}; expected some of {', '.join(VARIANTS)}")
    config = TrainConfig(steps=args.steps, batch=args.batch, eval_bytes=args.eval_bytes,
                         eval_every=max(1, args.steps // 10), checkpoint_every=args.steps)
    for name, summary in run(config, Path(args.out), variants).items():
        print(name, summary["held_out"]["float32"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
