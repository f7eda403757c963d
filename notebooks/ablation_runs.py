"""The ablation behind notebooks/training_and_ablation.ipynb: nano against nano with plain residuals and
nano with Kimi Linear's unbounded gate, at equal compute (same steps, batch, length, schedule and seed).

    python notebooks/ablation_runs.py [--steps 1000] [--out notebooks/runs/ablation]

Each variant trains with ``k3jax.train.train`` into a temporary folder; its ``metrics.jsonl``,
``summary.json`` and ``train_config.json`` are copied to ``OUT/<preset>/`` (the checkpoints are not
kept). Three runs of the default 1000 steps are GPU work (the shipped nano's 800 steps took 39 minutes
on a 2-core CPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import sys
import tempfile
from pathlib import Path

from k3jax.train import TrainConfig, train

VARIANTS = ("nano", "nano_plain_residual", "nano_softplus_gate")


def run(config: TrainConfig, out: Path, variants=VARIANTS, stream=sys.stderr, corpus=None) -> dict[str, dict]:
    """Train each variant with ``config`` (its preset replaced); copy the metrics and summary to ``out``."""
    summaries = {}
    for name in variants:
        cfg = dataclasses.replace(config, preset=name)
        with tempfile.TemporaryDirectory() as folder:
            summaries[name] = train(cfg, folder, stream=stream, export=False, corpus=corpus)
            target = out / name
            target.mkdir(parents=True, exist_ok=True)
            for file in ("metrics.jsonl", "summary.json", "train_config.json"):
                shutil.copy(Path(folder) / file, target / file)
    return summaries


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--out", default="notebooks/runs/ablation")
    args = ap.parse_args()
    config = TrainConfig(steps=args.steps, eval_every=args.steps // 10, checkpoint_every=args.steps)
    for name, summary in run(config, Path(args.out)).items():
        print(name, summary["held_out"]["float32"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
