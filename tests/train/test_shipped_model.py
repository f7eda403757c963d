"""The shipped trained `nano` (k3jax/data/nano, k3jax generate's default): it loads as released K3 checkpoints
do (routed experts in MXFP4), its held-out loss is the one the README states, and the default command prints
text made of the corpus's words."""

from __future__ import annotations

import re

from k3jax.checkpoint import load
from k3jax.cli import SHIPPED_MODEL, main
from k3jax.corpus import load_corpus, shipped_text
from k3jax.mx import MXTensor
from k3jax.train import TrainConfig, evaluate, model_parts

README = SHIPPED_MODEL.parent.parent.parent / "README.md"


def _readme_bits_per_byte() -> float:
    found = re.search(r"held-out\s+([0-9.]+) bits per byte", README.read_text())
    assert found, "README.md: no 'held-out N bits per byte' sentence for the shipped model"
    return float(found.group(1))


def test_held_out_loss_is_the_readme_s():
    model = load(SHIPPED_MODEL, verify=True)
    assert isinstance(model.layers[1].block_sparse_moe.experts.w1.get_value(), MXTensor)
    cfg = TrainConfig()  # the shipped run's settings: held-out windows of its sequence length
    result = evaluate(model_parts(model), load_corpus().held_out, cfg.seq_len, cfg.batch)
    print(result)
    assert abs(result["eval_bpb"] - _readme_bits_per_byte()) <= 0.01 * _readme_bits_per_byte()


def test_default_generate_prints_the_corpus_s_words(capsys):
    assert main(["generate", "--max-tokens", "120"]) == 0
    text = capsys.readouterr().out
    words = re.findall(r"[A-Za-z]+", text)
    known = set(re.findall(r"[A-Za-z]+", shipped_text()))
    print(text)
    assert len(words) >= 15 and sum(w in known for w in words) >= 0.9 * len(words)
