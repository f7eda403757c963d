"""Tokenizers: the released tiktoken BPE (``tiktoken.model``) when a checkpoint ships one, else byte-level."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Protocol

# The split pattern of the Kimi tokenizers (tokenization_kimi.py), used with the released tiktoken.model.
_KIMI_PATTERN = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])


class TokenizerError(Exception):
    """A checkpoint's tokenizer cannot be used: ``tiktoken`` is not installed, or a tokenizer file is malformed."""


class Tokenizer(Protocol):
    vocab_size: int
    eos_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; 256 is BOS and 257 EOS (the synthetic and demo models' layout)."""

    vocab_size = 258
    bos_id, eos_id = 256, 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class TiktokenTokenizer:
    """The released BPE: ``tiktoken.model`` (base64 token, rank per line) plus the special tokens of
    ``tokenizer_config.json`` (``added_tokens_decoder``), if present. Raises ``TokenizerError`` naming the file and
    line of a malformed entry."""

    def __init__(self, folder: str | Path):
        import tiktoken

        folder = Path(folder)
        ranks = _ranks(folder / "tiktoken.model")
        special = _special_tokens(folder / "tokenizer_config.json")
        self._enc = tiktoken.Encoding("kimi", pat_str=_KIMI_PATTERN, mergeable_ranks=ranks, special_tokens=special)
        self.vocab_size = max([*ranks.values(), *special.values()]) + 1
        self.eos_id = special.get("[EOS]", special.get("<|im_end|>"))

    def encode(self, text: str) -> list[int]:
        return self._enc.encode(text, allowed_special="all")

    def decode(self, ids: list[int]) -> str:
        return self._enc.decode(ids)


def _ranks(path: Path) -> dict[bytes, int]:
    """``tiktoken.model``: one base64 token and its rank per line (blank lines skipped)."""
    ranks = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError:  # a wrong field count, bad base64 (binascii.Error) or a rank that is no integer
            raise TokenizerError(f"{path}: line {number}: expected '<base64 token> <rank>', "
                                 f"got {line[:60]!r}") from None
    return ranks


def _special_tokens(path: Path) -> dict[str, int]:
    """``tokenizer_config.json``'s ``added_tokens_decoder`` as {text: id}; none without the file."""
    if not path.exists():
        return {}
    try:
        added = json.loads(path.read_text()).get("added_tokens_decoder", {})
        return {entry["content"]: int(key) for key, entry in added.items()}
    except (ValueError, AttributeError, KeyError, TypeError) as err:
        raise TokenizerError(f"{path}: cannot read added_tokens_decoder, expected {{id: {{'content': text}}}} "
                             f"({type(err).__name__}: {err})") from None


def load_tokenizer(folder: str | Path | None) -> Tokenizer:
    """The checkpoint folder's tiktoken tokenizer when it ships ``tiktoken.model``, else (no folder, or none in it)
    the byte-level one. A folder that ships ``tiktoken.model`` on a machine without the ``tiktoken`` package raises
    ``TokenizerError`` rather than falling back: byte ids fed to a model trained on BPE ids give fluent-looking
    garbage."""
    if folder is not None and (Path(folder) / "tiktoken.model").exists():
        try:
            return TiktokenTokenizer(folder)
        except ImportError:
            raise TokenizerError(f"{Path(folder) / 'tiktoken.model'} needs the 'tiktoken' package: "
                                 f"pip install tiktoken") from None
    return ByteTokenizer()


__all__ = ["ByteTokenizer", "TiktokenTokenizer", "Tokenizer", "TokenizerError", "load_tokenizer"]
