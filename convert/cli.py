"""``k3jax convert``: released safetensors -> k3jax checkpoint, ``--export`` back, ``--check``, ``--synthetic``.

    k3jax convert SRC OUT [--dtype {bf16,f16,f32}] [--dequantize bf16] [--resume] [--verify]
                      [--allow-unknown] [--part-mb N] [--inflight-mb N] [--quiet]
                      [--process-index K --process-count N [--wait-minutes M]]
    k3jax convert --export CKPT OUT [--quiet]
    k3jax convert --check CKPT [--quiet]
    k3jax convert --synthetic PRESET OUT [--dtype {bf16,f16,f32}] [--seed S] [--shard-mb N] [--lazy]

Also runnable as ``python -m convert.cli ...``. Progress goes to stderr, one summary line of what
was written or verified to stdout. Exit status 0 on success, 1 on a checkpoint, config, conversion
or file-system error, 2 on a bad command line, 130 when interrupted; each error is one line on
stderr naming the file, tensor or flag and what was expected.

With ``--process-count N``, N processes (one a host, OUT on a file system all share) each run the same
command with their own ``--process-index`` and write every N-th part; process 0 waits for the others'
parts and finishes OUT (docs/multi_host.md).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import NoReturn

from convert.progress import size

PROG = "k3jax convert"
_CONVERSION = ("dequantize", "resume", "verify", "allow_unknown", "part_mb", "inflight_mb", "process_index",
               "process_count", "wait_minutes")
_SYNTHETIC = ("seed", "shard_mb", "lazy")


def _positive(unit: str):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = 0.0
        if not value > 0:
            raise argparse.ArgumentTypeError(f"expected a positive number of {unit}, got {text!r}")
        return value

    return parse


_megabytes, _minutes = _positive("MB"), _positive("minutes")


def _configure(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("src", help="released checkpoint folder (a k3jax checkpoint with --export or --check, "
                               "a preset with --synthetic)")
    p.add_argument("out", nargs="?", help="output folder (must not exist; written as OUT.partial and renamed "
                                          "when complete); not with --check")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--export", action="store_true", help="k3jax checkpoint SRC -> released safetensors OUT")
    mode.add_argument("--check", action="store_true", help="verify the k3jax checkpoint SRC: files, sizes and "
                                                           "every array's CRC-32")
    mode.add_argument("--synthetic", action="store_true", help="write a synthetic released checkpoint of preset SRC")
    p.add_argument("--dtype", choices=["bf16", "f16", "f32"], default=None,
                   help="store the weights in this dtype (default: as the source stores them; the manifest says)")
    p.add_argument("--dequantize", choices=["bf16"], default=None, help="store MXFP4 experts as bf16")
    p.add_argument("--resume", action="store_true", help="continue an interrupted conversion from OUT.partial")
    p.add_argument("--verify", action="store_true", help="re-read the output and compare it bit for bit with the source")
    p.add_argument("--quiet", action="store_true", help="no progress bar (the summary line stays)")
    p.add_argument("--allow-unknown", action="store_true", help="skip (warn about) tensors without a k3jax parameter")
    p.add_argument("--part-mb", type=_megabytes, default=None, help="orbax part size in MB (the unit of --resume; 128)")
    p.add_argument("--inflight-mb", type=_megabytes, default=None,
                   help="MB of parts being assembled or written at once (peak memory ~ max(this, largest tensor); 768)")
    p.add_argument("--process-index", type=int, default=None, help="this process's index K among --process-count "
                                                                    "processes converting together (writes parts K, K+N, ...)")
    p.add_argument("--process-count", type=int, default=None, help="N processes convert together into OUT.partial; "
                                                                    "process 0 finishes OUT")
    p.add_argument("--wait-minutes", type=_minutes, default=None,
                   help="with --process-count: how long a process waits for the others (process 0: with no part "
                        "completed) before it fails (30)")
    p.add_argument("--seed", type=int, default=None, help="--synthetic: random seed (0)")
    p.add_argument("--shard-mb", type=_megabytes, default=None, help="--synthetic: shard size in MB (default: model/4)")
    p.add_argument("--lazy", action="store_true", help="--synthetic: stream random tensors (multi-GB checkpoints)")
    p.set_defaults(func=main)
    return p


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``convert`` command to a ``k3jax`` CLI's subparsers; it sets ``func=main``."""
    return _configure(subparsers.add_parser("convert", help="convert checkpoints (released <-> k3jax), check them",
                                            description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter))


def _mode(args: argparse.Namespace) -> str:
    return "export" if args.export else "check" if args.check else "synthetic" if args.synthetic else "convert"


def check(args: argparse.Namespace) -> None:
    """Raise ``ValueError`` naming the flag for options that do not go with the mode or each other."""
    from k3jax.presets import PRESETS

    mode = _mode(args)
    given = lambda names: [f"--{n.replace('_', '-')}" for n in names if getattr(args, n) not in (None, False)]
    wrong = []
    if mode != "convert":
        wrong += given(_CONVERSION)
    if mode != "synthetic":
        wrong += given(_SYNTHETIC)
    if mode in ("export", "check"):
        wrong += given(("dtype",))
    if wrong:
        raise ValueError(f"{wrong[0]} does not apply to {'a conversion' if mode == 'convert' else '--' + mode}")
    if (mode == "check") != (args.out is None):
        raise ValueError("--check takes one folder, CKPT" if mode == "check" else "OUT: missing; give the output folder")
    if (args.process_index is None) != (args.process_count is None):
        raise ValueError("--process-index and --process-count go together")
    if args.process_count is not None and not 0 <= args.process_index < args.process_count:
        raise ValueError(f"--process-index {args.process_index}: expected 0 <= K < --process-count "
                         f"({args.process_count})")
    if args.wait_minutes is not None and args.process_count is None:
        raise ValueError("--wait-minutes applies only with --process-count")
    if mode == "synthetic" and args.src not in PRESETS:
        raise ValueError(f"--synthetic {args.src}: unknown preset; choose one of {sorted(PRESETS)}")


def _run(args: argparse.Namespace) -> str:
    """Do what ``args`` ask; the summary line of what was written or verified."""
    from convert.conversion import convert
    from convert.export import export_checkpoint
    from convert.integrity import verify_checkpoint
    from convert.manifest import read_manifest
    from convert.synthetic import write_synthetic

    mode = _mode(args)
    if mode == "check":
        v = verify_checkpoint(args.src, quiet=args.quiet)
        return (f"verified {args.src}: {v.arrays} arrays in {v.parts} part(s), {size(v.nbytes)}, every CRC-32 matches "
                f"({v.seconds:.1f} s)")
    if mode == "export":
        out = export_checkpoint(args.src, args.out, quiet=args.quiet)
        return f"wrote {out}: {_files(out)}"
    if mode == "synthetic":
        shard = int(args.shard_mb * 2**20) if args.shard_mb else None
        write_synthetic(args.out, args.src, seed=args.seed or 0, shard_bytes=shard, lazy=args.lazy, quiet=args.quiet,
                        dtype=args.dtype and args.dtype.upper())
        return f"wrote {args.out}: synthetic {args.src} checkpoint, {_files(Path(args.out))}"
    out = convert(args.src, args.out, dtype=args.dtype, dequantize=args.dequantize, resume=args.resume,
                  verify=args.verify, quiet=args.quiet, allow_unknown=args.allow_unknown,
                  part_bytes=int((args.part_mb or 128) * 2**20), inflight_bytes=int((args.inflight_mb or 768) * 2**20),
                  process_index=args.process_index or 0, process_count=args.process_count or 1,
                  wait_s=(args.wait_minutes or 30) * 60)
    if args.process_index:
        return (f"wrote the parts of process {args.process_index} of {args.process_count} into {out}; process 0 "
                f"finishes {args.out}")
    man = read_manifest(out)
    stored = sum(sum(p["files"].values()) for p in man["parts"].values())
    dtypes = sorted({p["dtype"] for p in man["params"].values()})
    how = f"cast to {args.dtype}" if args.dtype else "as stored"
    checked = "; verified bit for bit against the source" if args.verify else ""
    return (f"wrote {out}: {len(man['params'])} parameters ({', '.join(dtypes)}, {how}) in {len(man['parts'])} parts, "
            f"{size(stored)}{checked}")


def _files(folder: Path) -> str:
    files = sorted(folder.glob("*.safetensors"))
    return f"{len(files)} safetensors file(s), {size(sum(f.stat().st_size for f in files))}"


def main(args: argparse.Namespace) -> int:
    """Run the command parsed by ``add_parser``; returns the exit status (see the module docstring)."""
    from convert.partial import ConversionError, partial_of
    from convert.safetensors_io import CheckpointError
    from k3jax.config import ConfigError

    try:
        check(args)
    except ValueError as e:
        print(f"{PROG}: error: {e} (see {PROG} --help)", file=sys.stderr)
        return 2
    try:
        print(_run(args))
    except (CheckpointError, ConversionError, ConfigError, OSError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        partial = partial_of(Path(args.out)) if args.out else None
        kept = f"; {partial} is kept: rerun with --resume" if _mode(args) == "convert" and partial.exists() else ""
        print(f"\n{PROG}: interrupted{kept}", file=sys.stderr)
        return 130
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse with a bad flag reported on one line (and exit status 2), not the usage text."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """A standalone parser (``python -m convert.cli``)."""
    return _configure(_Parser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter))


__all__ = ["add_parser", "build_parser", "check", "main"]

if __name__ == "__main__":
    sys.exit(main(build_parser().parse_args()))
