"""The ``k3jax`` command.

    k3jax generate [--model PATH | --preset NAME] [--prompt TEXT] [--max-tokens N] [sampling flags] [--stream]
                   [--progress | --no-progress] [--prefill-chunk N] [--steps-per-call N] [--deterministic]
                   [--mesh expert=4,tensor=2]
    k3jax train [--out FOLDER] [--preset NAME] [--steps N] ...   (every ``TrainConfig`` field is a flag)
    k3jax memory [--config NAME] [--context N] [--batch N] [--mesh expert=8,tensor=8]
    k3jax info [--config NAME]
    k3jax convert ...            (see ``k3jax convert --help``)

With no model, ``generate`` runs the embedded default: ``nano`` (every K3 mechanism, 6.0M parameters)
trained on the King James Bible, shipped in ``k3jax/data/nano`` with routed experts in MXFP4, and the
byte-level tokenizer. ``--preset`` builds a preset with random weights instead.

Every flag is checked right after parsing, before any model is built. A user error (a bad flag, a checkpoint
or tokenizer that does not load, a prompt the model cannot read) is one line on stderr, ``k3jax COMMAND: error:
...``, with exit status 2 for a flag and 1 for anything found later; Ctrl-C ends with status 130. ``generate``
writes the text to stdout and the rest to stderr: the model it runs, progress (the prefill chunk by chunk; by
default only when stderr is a terminal) and a last line saying what it generated.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import NoReturn, TextIO

from convert.cli import add_parser as add_convert_parser
from convert.safetensors_io import CheckpointError
from k3jax.arguments import ids, integer, real
from k3jax.config import ConfigError
from k3jax.inference import DEFAULT_PREFILL_CHUNK, DEFAULT_STEPS_PER_CALL
from k3jax.presets import PRESETS, preset
from k3jax.sharding.mesh import parse_mesh
from k3jax.tokenizer import TokenizerError
from k3jax.train_cli import add_parser as add_train_parser

SHIPPED_MODEL = Path(__file__).parent / "data" / "nano"
DEFAULT_PROMPT = "And it came to pass, when the king"


class CommandError(Exception):
    """A user error found while a command runs, past the flag checks: reported on one line, exit status 1."""


# What a command may raise for a user's mistake rather than a bug: each is reported on one line, no traceback.
USER_ERRORS = (CommandError, CheckpointError, ConfigError, TokenizerError, OSError)


class _Parser(argparse.ArgumentParser):
    """argparse with each error on one line (what is wrong, where to read more) instead of the usage text."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class _Progress:
    """Progress reports on stderr: on a terminal one line rewritten in place, elsewhere a line per report."""

    def __init__(self, enabled: bool, stream: TextIO):
        self.enabled, self.stream = enabled, stream
        self.in_place = enabled and stream.isatty()
        self._showing = False

    def show(self, text: str, in_place_only: bool = False) -> None:
        """Report ``text``; ``in_place_only`` reports (a count per token) are left out where they would each take
        a line."""
        if self.in_place:
            self.stream.write(f"\r{text}\033[K")
            self._showing = True
        elif self.enabled and not in_place_only:
            self.stream.write(f"{text}\n")
        self.stream.flush()

    def clear(self) -> None:
        """Erase the line being rewritten, if any, before other output."""
        if self._showing:
            self.stream.write("\r\033[K")
            self.stream.flush()
            self._showing = False


def _progress(args: argparse.Namespace) -> _Progress:
    """``--progress`` or ``--no-progress``; without either, progress only where stderr is a terminal."""
    return _Progress(sys.stderr.isatty() if args.progress is None else args.progress, sys.stderr)


def _check_generate(args: argparse.Namespace) -> None:
    """Every ``generate`` flag's value, before anything is built: TypeError or ValueError naming the flag."""
    if not args.prompt:
        raise ValueError("--prompt: empty; give some text for the model to continue")
    if args.model is not None and not Path(args.model).is_dir():
        raise ValueError(f"--model: {args.model}: no such folder")
    integer("--max-tokens", args.max_tokens, minimum=1)
    real("--temperature", args.temperature, minimum=0.0)
    integer("--top-k", args.top_k, minimum=0)
    real("--top-p", args.top_p, maximum=1.0, above=0.0)
    integer("--seed", args.seed, minimum=-2**63, maximum=2**63 - 1)
    integer("--prefill-chunk", args.prefill_chunk, minimum=1)
    integer("--steps-per-call", args.steps_per_call, minimum=1)
    if args.mesh is not None:
        try:
            parse_mesh(args.mesh)
        except ValueError as err:
            raise ValueError(f"--{err}") from None


def _check_memory(args: argparse.Namespace) -> None:
    """``memory``'s flags: a positive context length and batch, and a mesh of known axes and positive sizes."""
    integer("--context", args.context, minimum=1)
    integer("--batch", args.batch, minimum=1)
    if args.mesh is not None:
        try:
            parse_mesh(args.mesh)
        except ValueError as err:
            raise ValueError(f"--{err}") from None  # parse_mesh's message starts 'mesh: '


def _model(args: argparse.Namespace, mesh=None):
    """The checkpoint of ``--model``, the ``--preset`` with random weights (seeded by ``--seed``), or by
    default the shipped trained ``nano``; placed on ``mesh`` when given."""
    from flax import nnx

    from k3jax.checkpoint import load
    from k3jax.model import K3Model
    from k3jax.sharding import place

    if args.preset is not None:
        model = K3Model(preset(args.preset), rngs=nnx.Rngs(args.seed))
        return model if mesh is None else place(model, mesh)
    return load(args.model or SHIPPED_MODEL, mesh=mesh, verify=args.verify)


def _mesh(text: str):
    """``--mesh``'s devices as a ``k3jax.sharding`` mesh; CommandError if they are not this machine's."""
    from k3jax.sharding import make_mesh

    try:
        return make_mesh(text)
    except ValueError as err:
        raise CommandError(f"--{err}") from None


def _prompt_ids(args: argparse.Namespace, tokenizer, vocab_size: int) -> list[int]:
    """``--prompt`` as token ids the model can read (a tokenizer may hold more ids than the model)."""
    try:
        return ids("--prompt", tokenizer.encode(args.prompt), vocab_size, ("T",)).tolist()
    except ValueError as err:
        raise CommandError(f"{err} (is the tokenizer the model's?)") from None


def _generate(args: argparse.Namespace) -> int:
    """Continue ``--prompt``: the text on stdout (streamed with ``--stream``); the model, progress and a summary on
    stderr."""
    from k3jax.inference import Generator
    from k3jax.sampling import Sampling
    from k3jax.tokenizer import load_tokenizer

    start = time.perf_counter()
    tokenizer = load_tokenizer(args.model)  # before the model: a tokenizer that cannot load fails in a moment
    mesh = None if args.mesh is None else _mesh(args.mesh)
    model = _model(args, mesh)
    prompt = _prompt_ids(args, tokenizer, model.cfg.vocab_size)
    eos = model.cfg.extra.get("eos_token_id", tokenizer.eos_id)
    generator = Generator(model, max_len=len(prompt) + args.max_tokens, prefill_chunk=args.prefill_chunk,
                          steps_per_call=args.steps_per_call, deterministic=args.deterministic, mesh=mesh)
    source = ("random weights" if args.preset is not None else args.model if args.model is not None
              else "trained on the King James Bible, shipped")
    print(f"[{model.cfg.name}: {model.cfg.num_layers} layers, {source}; ready in {time.perf_counter() - start:.1f} s]",
          file=sys.stderr)
    progress = _progress(args)
    steps = 0

    def on_chunk(done: int, total: int) -> None:
        progress.show(f"prefill {done}/{total} tokens")

    def on_token(tokens, active) -> None:
        nonlocal steps
        if steps == 0:
            progress.clear()
            if args.stream:
                print(args.prompt, end="", flush=True)
        steps += 1
        if not args.stream:
            progress.show(f"decode {steps}/{args.max_tokens} tokens", in_place_only=True)
        elif active[0]:
            print(tokenizer.decode([int(tokens[0])]), end="", flush=True)

    out = generator.generate([prompt], args.max_tokens, Sampling(args.temperature, args.top_k, args.top_p),
                             seed=args.seed, eos_id=eos, on_token=on_token,
                             on_chunk=on_chunk if progress.enabled else None)
    progress.clear()
    if not args.stream:
        print(args.prompt + tokenizer.decode(out.tokens[0]), end="")
    print(flush=True)
    print(_summary(out, len(prompt), eos, args.max_tokens), file=sys.stderr)
    return 0


def _summary(out, prompt_tokens: int, eos: int | None, max_tokens: int) -> str:
    """The last line of ``generate``: what was generated, why it stopped, how sure the model was, how fast."""
    new = out.tokens[0]
    stop = "stopped at EOS" if eos is not None and new[-1] == eos else f"--max-tokens {max_tokens} reached"
    decode = (f"decode {out.decode_tokens_per_second:.1f} tokens/s after the first call" if out.decode_tokens
              else "decode not timed: one call, which compiled")
    return (f"[generated {len(new)} tokens after a {prompt_tokens}-token prompt ({stop}); mean log-probability "
            f"{sum(out.logprobs[0]) / len(new):.3f}; prefill {out.prefill_seconds:.2f} s (compile included); {decode}]")


def _memory(args: argparse.Namespace) -> int:
    from k3jax.memory import report

    print(report(preset(args.config), args.context, args.batch, mesh=args.mesh))
    return 0


def _info(args: argparse.Namespace) -> int:
    from k3jax.param_count import count_params

    cfg = preset(args.config)
    counts = count_params(cfg)
    print(f"{cfg.name}: {cfg.num_layers} layers ({cfg.layer_types.count('kda')} KDA, "
          f"{cfg.layer_types.count('mla')} MLA), width {cfg.hidden_size}")
    print(f"  parameters: total {counts.total / 1e9:,.2f}B, active per token {counts.active / 1e9:,.2f}B "
          f"(output head counted, embedding table not)")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="k3jax", description="Kimi K3 in JAX: generate, convert, inspect.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text (default: the shipped nano, trained on the King James Bible)")
    source = gen.add_mutually_exclusive_group()
    source.add_argument("--model", default=None, help="checkpoint folder (k3jax or released safetensors; default: "
                        "the shipped nano)")
    source.add_argument("--preset", default=None, choices=sorted(PRESETS), help="a preset with random weights")
    gen.add_argument("--verify", action=argparse.BooleanOptionalAction, default=True,
                     help="check every array of a k3jax --model against its CRC-32 as it loads (default: on; it adds "
                     "about a tenth to the load)")
    gen.add_argument("--prompt", default=DEFAULT_PROMPT, help="the text to continue (default: %(default)r)")
    gen.add_argument("--max-tokens", type=int, default=200, help="new tokens at most (default: %(default)s; the "
                     "shipped nano's tokens are bytes)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-k", type=int, default=0, help="0 = off")
    gen.add_argument("--top-p", type=float, default=1.0, help="1.0 = off")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--prefill-chunk", type=int, default=DEFAULT_PREFILL_CHUNK,
                     help="prompt tokens per prefill call (default: k3jax.inference.DEFAULT_PREFILL_CHUNK, "
                     "%(default)s)")
    gen.add_argument("--steps-per-call", type=int, default=DEFAULT_STEPS_PER_CALL,
                     help="decode steps per compiled call; --stream prints tokens in bursts of this many (default: "
                     "k3jax.inference.DEFAULT_STEPS_PER_CALL, %(default)s; 1 prints each token as it is made, at the "
                     "host's cost of a dispatch per token)")
    gen.add_argument("--stream", action="store_true", help="print tokens as they come")
    gen.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                     help="report the prefill chunk by chunk (and, on a terminal without --stream, the tokens made) "
                     "on stderr (default: only when stderr is a terminal)")
    gen.add_argument("--deterministic", action="store_true",
                     help="on a GPU, the same tokens in every process for a seed, not only within one (slower: "
                     "k3jax.inference.DETERMINISTIC_GPU_OPTIONS)")
    gen.add_argument("--mesh", default=None, help="run on several devices, e.g. 'expert=4,tensor=2' (axes data, "
                     "expert, tensor; their product = the device count; docs/scaling.md)")
    gen.set_defaults(func=_generate, check_flags=_check_generate)

    add_train_parser(sub)

    mem = sub.add_parser("memory", help="memory for weights and caches at a context length (per device on a mesh)")
    mem.add_argument("--config", default="kimi-k3", choices=sorted(PRESETS))
    mem.add_argument("--context", type=int, default=131072, help="tokens per sequence (default: %(default)s)")
    mem.add_argument("--batch", type=int, default=1, help="sequences (default: %(default)s)")
    mem.add_argument("--mesh", default=None, help="mesh sizes, e.g. expert=8,tensor=8 (axes data, expert, tensor; "
                     "absent axes 1): print what one device holds and sends per token (no devices needed)")
    mem.set_defaults(func=_memory, check_flags=_check_memory)

    info = sub.add_parser("info", help="layers and parameter counts of a preset")
    info.add_argument("--config", default="kimi-k3", choices=sorted(PRESETS))
    info.set_defaults(func=_info)

    add_convert_parser(sub)
    return parser


def _fail(command: str, message: object, status: int) -> int:
    print(f"k3jax {command}: error: {message}", file=sys.stderr)
    return status


def main(argv: list[str] | None = None) -> int:
    """Run the ``k3jax`` command line on ``argv`` (default: ``sys.argv[1:]``) and return its exit status: 0 done,
    1 a user error found while running, 2 a bad flag, 130 interrupted, 141 output pipe closed."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as stop:  # --help, or a flag argparse refused (already reported on one line)
        return stop.code
    try:
        getattr(args, "check_flags", lambda _: None)(args)
    except (TypeError, ValueError) as err:
        return _fail(args.command, f"{err} (see k3jax {args.command} --help)", 2)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print(f"\nk3jax {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # stdout closed early (`| head`): stop quietly, as a pipeline expects
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except USER_ERRORS as err:
        return _fail(args.command, err, 1)


__all__ = ["CommandError", "USER_ERRORS", "main"]

if __name__ == "__main__":  # python -m k3jax.cli, as the installed k3jax command
    sys.exit(main())
