"""The command line: generation on the embedded default, memory and info reports, and clear errors for bad model
paths and settings."""

import math
import re

import pytest

from k3jax.cli import main
from k3jax.memory import estimate
from k3jax.presets import preset


def test_generate_streams_on_the_embedded_default(capsys):
    """Greedy on the tiny random model, byte-level tokenizer: the prompt, then one printed piece per new token; the
    summary counts them and gives their mean log-probability (within [-log V, 0] for a greedy pick)."""
    assert main(["generate", "--prompt", "K3", "--max-tokens", "3", "--stream", "--deterministic"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("K3") and out.endswith("\n")
    summary = re.search(r"\[3 tokens, mean log-probability (-?[0-9.]+);", err)
    assert summary, err
    assert -math.log(preset("tiny").vocab_size) <= float(summary.group(1)) <= 0
    assert "decode not timed: one call, which compiled" in err


def test_memory_report_for_a_million_tokens(capsys):
    assert main(["memory", "--config", "kimi-k3", "--context", "1048576", "--batch", "2"]) == 0
    out = capsys.readouterr().out
    assert "27,648 bytes per token" in out  # 24 MLA layers x 576 values x 2 bytes
    m = estimate(preset("kimi-k3"), 1048576, 2)
    assert m.mla_cache_per_token == 24 * 576 * 2
    assert m.kda_state_per_seq == 69 * 4 * (96 * 128 * 128 + 3 * 3 * 96 * 128)
    assert 1.3e12 < m.weights < 1.7e12  # ~2.72T MXFP4 experts at 4.25 bits + ~57B bf16


def test_info_prints_parameter_counts(capsys):
    assert main(["info", "--config", "kimi-linear-48b"]) == 0
    assert "27 layers (20 KDA, 7 MLA)" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, match",
    [
        (["generate", "--model", "{tmp}"], "config.json: missing"),
        (["generate", "--temperature", "-1"], "temperature"),
        (["generate", "--top-p", "2"], "top_p"),
        (["generate", "--steps-per-call", "0"], "steps_per_call: must be positive"),
        (["generate", "--prefill-chunk", "0"], "prefill_chunk: must be positive"),
    ],
)
def test_generate_refuses_bad_input(tmp_path, argv, match):
    with pytest.raises(SystemExit, match=match):
        main([a.format(tmp=tmp_path) for a in argv])
