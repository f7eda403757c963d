"""The corpus (the shipped prepared KJV text, its fixed split) and the windows training and evaluation read."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from k3jax.batches import TrainWindows, eval_windows
from k3jax.corpus import load_corpus, prepare, shipped_text, split


def test_prepare_writes_a_verse_a_line_without_marks():
    verses = {"Genesis 1:1": "# In the beginning [was] light.", "Genesis 1:2": "And  it was good."}
    assert prepare(verses) == "Genesis 1:1 In the beginning was light.\nGenesis 1:2 And it was good.\n"
    with pytest.raises(ValueError, match="'Genesis one'"):
        prepare({"Genesis one": "x"})


def test_split_holds_out_every_twentieth_chapter():
    text = "".join(f"Book {c}:{v} verse {c}.{v}\n" for c in range(1, 45) for v in (1, 2))
    corpus = split(text)
    held = corpus.held_out.decode().splitlines()
    assert [line.split(":")[0] for line in held[::2]] == ["Book 11", "Book 31"]  # chapters 10 and 30 from 0
    assert len(corpus.train) + len(corpus.held_out) == len(text.encode())


def test_the_shipped_corpus():
    text = shipped_text()
    assert hashlib.sha256(text.encode()).hexdigest()[:16] == "5eb55e8675b48f71"
    assert text.count("\n") == 31102 and text.startswith("Genesis 1:1 In the beginning God created")
    corpus = load_corpus()
    assert (len(corpus.train), len(corpus.held_out)) == (4342515, 214922)
    assert b"Genesis 11:1 And the whole earth was of one language" in corpus.held_out
    assert b"Genesis 11:1 " not in corpus.train


def test_train_windows_are_a_function_of_position():
    data = bytes(np.random.default_rng(2).integers(0, 256, 10_000, dtype=np.uint8))
    a, b = TrainWindows(data, 16, seed=3), TrainWindows(data, 16, seed=3)
    first = a.at(0, 2 * a.windows_per_epoch)  # two epochs
    np.testing.assert_array_equal(b.at(5, 7), first[5:12])
    for row in first:  # each window is consecutive bytes of the data
        assert row.shape == (17,) and bytes(row.astype(np.uint8)) in data
    epoch = first[:a.windows_per_epoch]
    assert len({bytes(r.astype(np.uint8)) for r in epoch}) == a.windows_per_epoch  # no window twice in an epoch
    assert not np.array_equal(TrainWindows(data, 16, seed=4).at(0, 4), first[:4])


def test_eval_windows_read_every_target_once():
    data = bytes(np.random.default_rng(1).integers(0, 256, 1000, dtype=np.uint8))
    targets = []
    for tokens, mask in eval_windows(data, 64, 4):
        assert tokens.shape == (4, 65) and mask.shape == (4, 64)
        targets += [int(t) for row, m in zip(tokens, mask) for t, keep in zip(row[1:], m) if keep]
    assert targets == list(data[1:])
