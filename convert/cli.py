"""``k3jax convert``: released safetensors -> k3jax checkpoint, ``--export`` back, ``--synthetic``.

    k3jax convert SRC OUT [--dequantize bf16] [--resume] [--verify] [--quiet] [--allow-unknown]
                      [--part-mb N] [--inflight-mb N]
    k3jax convert --export CKPT OUT [--quiet]
    k3jax convert --synthetic PRESET OUT [--seed S] [--shard-mb N] [--lazy]

Also runnable as ``python -m convert.cli ...``. Exit status 0 on success, 1 on a checkpoint or
conversion error (the message names the file/tensor and what was expected).
"""

from __future__ import annotations

import argparse
import sys

from convert.conversion import ConversionError, convert
from convert.export import export_checkpoint
from convert.safetensors_io import CheckpointError
from convert.synthetic import write_synthetic
from k3jax.config import ConfigError


def _configure(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("src", help="released checkpoint folder (or a k3jax checkpoint with --export, a preset with --synthetic)")
    p.add_argument("out", help="output folder (must not exist; written as OUT.partial and renamed when complete)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--export", action="store_true", help="k3jax checkpoint SRC -> released safetensors OUT")
    mode.add_argument("--synthetic", action="store_true", help="write a synthetic released checkpoint of preset SRC")
    p.add_argument("--dequantize", choices=["bf16"], default=None, help="store MXFP4 experts as bf16")
    p.add_argument("--resume", action="store_true", help="continue an interrupted conversion from OUT.partial")
    p.add_argument("--verify", action="store_true", help="re-read the output and compare bit for bit")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--allow-unknown", action="store_true", help="skip (warn about) tensors without a k3jax parameter")
    p.add_argument("--part-mb", type=int, default=128, help="orbax part size in MB (the unit of --resume)")
    p.add_argument("--inflight-mb", type=int, default=768,
                   help="MB of parts being assembled or written at once (peak memory ~ max(this, largest tensor))")
    p.add_argument("--seed", type=int, default=0, help="--synthetic: random seed")
    p.add_argument("--shard-mb", type=int, default=None, help="--synthetic: shard size in MB (default: model/4)")
    p.add_argument("--lazy", action="store_true", help="--synthetic: stream random tensors (multi-GB checkpoints)")
    p.set_defaults(func=main)
    return p


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``convert`` command to a ``k3jax`` CLI's subparsers; it sets ``func=main``."""
    return _configure(subparsers.add_parser("convert", help="convert checkpoints (released <-> k3jax)",
                                            description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter))


def main(args: argparse.Namespace) -> int:
    """Run the command parsed by ``add_parser``; returns the exit status."""
    try:
        if args.export:
            export_checkpoint(args.src, args.out, quiet=args.quiet)
        elif args.synthetic:
            shard = args.shard_mb << 20 if args.shard_mb else None
            write_synthetic(args.out, args.src, seed=args.seed, shard_bytes=shard, lazy=args.lazy, quiet=args.quiet)
        else:
            convert(args.src, args.out, dequantize=args.dequantize, resume=args.resume, verify=args.verify,
                    quiet=args.quiet, allow_unknown=args.allow_unknown, part_bytes=args.part_mb << 20,
                    inflight_bytes=args.inflight_mb << 20)
    except (CheckpointError, ConversionError, ConfigError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    """A standalone parser (``python -m convert.cli``)."""
    return _configure(argparse.ArgumentParser(prog="convert", description=__doc__,
                                              formatter_class=argparse.RawDescriptionHelpFormatter))


__all__ = ["add_parser", "build_parser", "main"]

if __name__ == "__main__":
    sys.exit(main(build_parser().parse_args()))
