"""The ``k3jax`` command.

    k3jax generate [--model PATH | --preset tiny] [--prompt TEXT] [sampling flags] [--stream] [--steps-per-call N]
                   [--deterministic]
    k3jax memory --config kimi-k3 --context 1048576 [--batch N]
    k3jax info [--config kimi-k3]
    k3jax convert ...            (see ``k3jax convert --help``)

With no model path, ``generate`` runs the embedded default: the ``tiny`` preset (every K3 feature,
toy widths) with random weights and the byte-level tokenizer.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from convert.cli import add_parser as add_convert_parser
from convert.safetensors_io import CheckpointError
from k3jax.config import ConfigError
from k3jax.presets import PRESETS, preset


def _model(args):
    from flax import nnx

    from k3jax.checkpoint import load
    from k3jax.model import K3Model

    if args.model is None:
        return K3Model(preset(args.preset), rngs=nnx.Rngs(args.seed)), None
    try:
        return load(args.model), Path(args.model)
    except (CheckpointError, ConfigError) as err:
        raise SystemExit(f"error: --model {args.model}: {err}")


def _generate(args) -> int:
    from k3jax.inference import DEFAULT_PREFILL_CHUNK, DEFAULT_STEPS_PER_CALL, Generator
    from k3jax.sampling import Sampling
    from k3jax.tokenizer import load_tokenizer

    try:
        sampling = Sampling(args.temperature, args.top_k, args.top_p)
    except ValueError as err:
        raise SystemExit(f"error: {err}")
    start = time.perf_counter()
    model, path = _model(args)
    tokenizer = load_tokenizer(path)
    prompt = tokenizer.encode(args.prompt)
    eos = model.cfg.extra.get("eos_token_id", tokenizer.eos_id)
    chunk = DEFAULT_PREFILL_CHUNK if args.prefill_chunk is None else args.prefill_chunk
    steps = DEFAULT_STEPS_PER_CALL if args.steps_per_call is None else args.steps_per_call
    try:
        generator = Generator(model, max_len=len(prompt) + args.max_tokens, prefill_chunk=chunk, steps_per_call=steps,
                              deterministic=args.deterministic)
    except ValueError as err:
        raise SystemExit(f"error: {err}")
    print(f"[{model.cfg.name}: {model.cfg.num_layers} layers, loaded in {time.perf_counter() - start:.1f} s]",
          file=sys.stderr)
    print(args.prompt, end="", flush=True)
    streamed: list[int] = []

    def show(tokens, active):
        if active[0]:
            streamed.append(int(tokens[0]))
            print(tokenizer.decode([int(tokens[0])]), end="", flush=True)

    try:
        out = generator.generate([prompt], args.max_tokens, sampling, seed=args.seed, eos_id=eos,
                                 on_token=show if args.stream else None)
    except ValueError as err:
        raise SystemExit(f"error: {err}")
    if not args.stream:
        print(tokenizer.decode(out.tokens[0]), end="")
    print()
    mean_logprob = sum(out.logprobs[0]) / len(out.logprobs[0])
    decode = (f"decode {out.decode_tokens_per_second:.1f} tokens/s after the first call" if out.decode_tokens
              else "decode not timed: one call, which compiled")
    print(f"[{len(out.tokens[0])} tokens, mean log-probability {mean_logprob:.3f}; "
          f"prefill {out.prefill_seconds:.2f} s (compile included); {decode}]", file=sys.stderr)
    return 0


def _memory(args) -> int:
    from k3jax.memory import report

    print(report(preset(args.config), args.context, args.batch))
    return 0


def _info(args) -> int:
    from k3jax.param_count import count_params

    cfg = preset(args.config)
    counts = count_params(cfg)
    print(f"{cfg.name}: {cfg.num_layers} layers ({cfg.layer_types.count('kda')} KDA, "
          f"{cfg.layer_types.count('mla')} MLA), width {cfg.hidden_size}")
    print(f"  parameters: total {counts.total / 1e9:,.2f}B, active per token {counts.active / 1e9:,.2f}B "
          f"(output head counted, embedding table not)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="k3jax", description="Kimi K3 in JAX: generate, convert, inspect.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text (default: the embedded tiny random model)")
    gen.add_argument("--model", default=None, help="checkpoint folder (k3jax or released safetensors)")
    gen.add_argument("--preset", default="tiny", choices=sorted(PRESETS), help="random-weight preset without --model")
    gen.add_argument("--prompt", default="Kimi K3 in JAX: ")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-k", type=int, default=0, help="0 = off")
    gen.add_argument("--top-p", type=float, default=1.0, help="1.0 = off")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--prefill-chunk", type=int, default=None,
                     help="prompt tokens per prefill call (default: k3jax.inference.DEFAULT_PREFILL_CHUNK, 2048)")
    gen.add_argument("--steps-per-call", type=int, default=None,
                     help="decode steps per compiled call; --stream prints tokens in bursts of this many (default: "
                     "k3jax.inference.DEFAULT_STEPS_PER_CALL, 8; 1 prints each token as it is made, at the host's "
                     "cost of a dispatch per token)")
    gen.add_argument("--stream", action="store_true", help="print tokens as they come")
    gen.add_argument("--deterministic", action="store_true",
                     help="on a GPU, the same tokens in every process for a seed, not only within one (slower: "
                     "k3jax.inference.DETERMINISTIC_GPU_OPTIONS)")
    gen.set_defaults(func=_generate)

    mem = sub.add_parser("memory", help="memory for weights and caches at a context length")
    mem.add_argument("--config", default="kimi-k3", choices=sorted(PRESETS))
    mem.add_argument("--context", type=int, default=131072)
    mem.add_argument("--batch", type=int, default=1)
    mem.set_defaults(func=_memory)

    info = sub.add_parser("info", help="layers and parameter counts of a preset")
    info.add_argument("--config", default="kimi-k3", choices=sorted(PRESETS))
    info.set_defaults(func=_info)

    add_convert_parser(sub)
    args = parser.parse_args(argv)
    return args.func(args)


__all__ = ["main"]
