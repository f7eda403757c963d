"""``k3jax train``: every ``TrainConfig`` field is a flag of the same name (``--seq-len`` for ``seq_len``),
its default the field's, so ``k3jax train`` with no flags reproduces the shipped ``nano``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from k3jax.presets import PRESETS
from k3jax.train import DTYPES, TrainConfig

_CHOICES = {"preset": sorted(PRESETS), "compute_dtype": sorted(DTYPES), "implementation": ["reference", "pallas"]}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``train`` to the ``k3jax`` command's subparsers."""
    p = subparsers.add_parser("train", help="train a preset on the King James Bible (defaults: the shipped nano)")
    p.add_argument("--out", default="runs/nano", help="the run folder: metrics.jsonl, checkpoints/, model/; a "
                   "folder with checkpoints resumes from the last (default: %(default)s)")
    p.add_argument("--stop-at", type=int, default=None, help="stop after this step (resume later with the same flags)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                   help="a progress line on stderr: step, loss, tokens/s, ETA (default: on)")
    for field in dataclasses.fields(TrainConfig):
        kind = type(field.default)
        if kind is bool:
            p.add_argument(_flag(field.name), action=argparse.BooleanOptionalAction, default=field.default,
                           help="(default: %(default)s)")
        else:
            p.add_argument(_flag(field.name), type=kind, default=field.default, choices=_CHOICES.get(field.name),
                           help="(default: %(default)s)")
    p.set_defaults(func=_train, check_flags=_check)
    return p


def _config(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})


def _check(args: argparse.Namespace) -> None:
    """The flags as a ``TrainConfig`` (ValueError naming the flag)."""
    try:
        _config(args).check()
    except ValueError as err:
        field, _, rest = str(err).partition(":")
        raise ValueError(f"{_flag(field)}:{rest}" if field.isidentifier() else str(err)) from None
    if args.stop_at is not None and args.stop_at < 1:
        raise ValueError(f"--stop-at: {args.stop_at}, expected a positive step")


def _train(args: argparse.Namespace) -> int:
    from k3jax.train import train

    summary = train(_config(args), args.out, stop_at=args.stop_at, stream=sys.stderr if args.progress else None)
    print(json.dumps(summary, indent=2))
    return 0


__all__ = ["add_parser"]
