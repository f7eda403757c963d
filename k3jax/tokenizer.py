"""Tokenizers: the released tiktoken BPE (``tiktoken.model``) when present, else a byte-level fallback."""

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
    ``tokenizer_config.json`` (``added_tokens_decoder``), if present."""

    def __init__(self, folder: str | Path):
        import tiktoken

        folder = Path(folder)
        ranks = {}
        for line in (folder / "tiktoken.model").read_text().splitlines():
            if line.strip():
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
        special = {}
        cfg_path = folder / "tokenizer_config.json"
        if cfg_path.exists():
            added = json.loads(cfg_path.read_text()).get("added_tokens_decoder", {})
            special = {v["content"]: int(k) for k, v in added.items()}
        self._enc = tiktoken.Encoding("kimi", pat_str=_KIMI_PATTERN, mergeable_ranks=ranks, special_tokens=special)
        self.vocab_size = max([*ranks.values(), *special.values()]) + 1
        self.eos_id = special.get("[EOS]", special.get("<|im_end|>"))

    def encode(self, text: str) -> list[int]:
        return self._enc.encode(text, allowed_special="all")

    def decode(self, ids: list[int]) -> str:
        return self._enc.decode(ids)


def load_tokenizer(folder: str | Path | None) -> Tokenizer:
    """The checkpoint folder's tiktoken tokenizer when it ships one (and ``tiktoken`` is installed),
    else the byte-level fallback."""
    if folder is not None and (Path(folder) / "tiktoken.model").exists():
        try:
            return TiktokenTokenizer(folder)
        except ImportError as err:
            raise ImportError(f"{folder}/tiktoken.model needs the 'tiktoken' package: pip install tiktoken") from err
    return ByteTokenizer()


__all__ = ["Tokenizer", "ByteTokenizer", "TiktokenTokenizer", "load_tokenizer"]
