"""The command line: generation on a small random model with progress and a closing summary, the memory and info
reports, every flag checked before a model is built, and each user error as one line on stderr with a nonzero
status (no traceback)."""

import io
import math
import re
import sys

import pytest

from k3jax import cli
from k3jax.cli import main
from k3jax.memory import estimate
from k3jax.presets import preset
from small_models import build

PROMPT = "The delta rule, chunk by chunk: "  # 32 bytes: two prefill chunks of 16


def one_line_error(capsys, *flags: str) -> str:
    """The run's stderr, asserted to be one line that names each of ``flags``."""
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for flag in flags:
        assert flag in err, err
    return err


@pytest.fixture
def no_model(monkeypatch):
    """Building or loading a model fails the test: the errors under test come before it."""
    def refuse(args):
        raise AssertionError("a model was built before the arguments were checked")

    monkeypatch.setattr(cli, "_model", refuse)


def test_generate_streams_with_progress_and_a_summary(capsys):
    """Greedy on a small random model (tiny_linear, the quicker preset to build), byte-level tokenizer: the prefill
    reported chunk by chunk (--progress, stderr not a terminal: a line per chunk), then the prompt and one printed
    piece per new token; the last line counts them and gives their mean log-probability (within [-log V, 0] for a
    greedy pick)."""
    argv = ["generate", "--preset", "tiny_linear", "--prompt", PROMPT, "--max-tokens", "3", "--stream", "--progress",
            "--prefill-chunk", "16"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert out.startswith(PROMPT) and out.endswith("\n") and out.count(PROMPT) == 1
    lines = err.strip().splitlines()
    assert lines[1:3] == ["prefill 16/32 tokens", "prefill 32/32 tokens"], err
    summary = re.fullmatch(r"\[generated 3 tokens after a 32-token prompt \(--max-tokens 3 reached\); mean "
                           r"log-probability (-?[0-9.]+); .*decode not timed: one call, which compiled\]", lines[-1])
    assert summary, err
    assert -math.log(preset("tiny_linear").vocab_size) <= float(summary.group(1)) <= 0


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_rewrites_one_line_on_a_terminal_and_adds_lines_elsewhere():
    terminal, pipe = Terminal(), io.StringIO()
    for stream in (terminal, pipe):
        progress = cli._Progress(True, stream)
        progress.show("prefill 16/32 tokens")
        progress.show("decode 1/3 tokens", in_place_only=True)
        progress.clear()
    assert terminal.getvalue() == "\rprefill 16/32 tokens\033[K\rdecode 1/3 tokens\033[K\r\033[K"
    assert pipe.getvalue() == "prefill 16/32 tokens\n"
    silent = io.StringIO()
    cli._Progress(False, silent).show("prefill 16/32 tokens")
    assert silent.getvalue() == ""


@pytest.mark.parametrize("isatty, flag, shown", [(True, None, True), (False, None, False), (True, False, False),
                                                 (False, True, True)])
def test_progress_by_default_only_on_a_terminal(monkeypatch, isatty, flag, shown):
    stream = Terminal() if isatty else io.StringIO()
    monkeypatch.setattr(sys, "stderr", stream)
    argv = ["generate"] + ([] if flag is None else ["--progress" if flag else "--no-progress"])
    assert cli._progress(cli._parser().parse_args(argv)).enabled is shown


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
    "argv, flag",
    [
        (["--max-tokens", "-5"], "--max-tokens"),
        (["--max-tokens", "0"], "--max-tokens"),
        (["--max-tokens", "many"], "--max-tokens"),
        (["--temperature", "-1"], "--temperature"),
        (["--temperature", "inf"], "--temperature"),
        (["--temperature", "nan"], "--temperature"),
        (["--top-k", "-1"], "--top-k"),
        (["--top-k", "1.5"], "--top-k"),
        (["--top-p", "0"], "--top-p"),
        (["--top-p", "2"], "--top-p"),
        (["--seed", str(2**63)], "--seed"),
        (["--prefill-chunk", "0"], "--prefill-chunk"),
        (["--steps-per-call", "0"], "--steps-per-call"),
        (["--prompt", ""], "--prompt"),
        (["--model", "{tmp}/absent"], "--model"),
        (["--model", "{tmp}", "--preset", "tiny"], "--preset"),
        (["--preset", "huge"], "--preset"),
        (["--mesh", "expert=x"], "--mesh"),
        (["--mesh", "pipeline=2"], "--mesh"),
    ],
)
def test_generate_refuses_bad_flags_before_building_a_model(capsys, no_model, tmp_path, argv, flag):
    assert main(["generate", *(a.format(tmp=tmp_path) for a in argv)]) == 2
    assert one_line_error(capsys, flag).startswith("k3jax generate: error: ")


def test_a_folder_that_is_no_checkpoint_is_one_line(capsys, tmp_path):
    assert main(["generate", "--model", str(tmp_path)]) == 1
    one_line_error(capsys, "config.json: missing")


def test_a_missing_tokenizer_package_is_one_line_before_the_model(capsys, no_model, tmp_path, monkeypatch):
    (tmp_path / "tiktoken.model").write_text("YQ== 0\n")
    monkeypatch.setitem(sys.modules, "tiktoken", None)  # `import tiktoken` fails as where it is not installed
    assert main(["generate", "--model", str(tmp_path)]) == 1
    one_line_error(capsys, "tiktoken.model", "pip install tiktoken")


def test_prompt_ids_the_model_cannot_read_are_one_line(capsys, monkeypatch):
    """A tokenizer with more ids than the model (here a stand-in that makes id 999; tiny_linear has 320)."""
    class WideTokenizer:
        eos_id = None

        def encode(self, text):
            return [1, 999]

    monkeypatch.setattr(cli, "_model", lambda args, mesh: build("tiny_linear").model)
    monkeypatch.setattr("k3jax.tokenizer.load_tokenizer", lambda folder: WideTokenizer())
    assert main(["generate"]) == 1
    one_line_error(capsys, "--prompt: token id 999 outside the vocabulary [0, 320)")


def test_interrupt_ends_with_status_130_and_no_traceback(capsys, monkeypatch):
    def interrupted(args, mesh):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_model", interrupted)
    assert main(["generate"]) == 130
    assert capsys.readouterr().err.strip() == "k3jax generate: interrupted"


def test_help_returns_zero(capsys):
    assert main(["memory", "--help"]) == 0
    assert "--context" in capsys.readouterr().out


def test_convert_is_delegated_with_its_own_flags(tmp_path):
    """``convert`` runs the converter's command; no flag check of this module stands in its way (its namespace
    holds flags of its own, a ``--check`` among them)."""
    assert main(["convert", "--synthetic", "tiny", str(tmp_path / "k3-tiny")]) == 0
    assert (tmp_path / "k3-tiny" / "config.json").exists()


def test_memory_per_device_on_a_mesh(capsys):
    argv = ["memory", "--config", "tiny_mesh", "--mesh", "data=2,expert=2,tensor=2", "--context", "100", "--batch", "4"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("tiny_mesh on a mesh of 8 devices (data=2, expert=2, tensor=2): context 100 tokens, batch 4")
    assert "(1 sequence x 2 of 4 heads, float32)" in out  # batch over data x expert, heads over tensor
    # 2(t-1)/t x 2D bytes for each of the 1/e of a data group's tokens the device attends for
    assert "KDA attention: all-reduce over tensor                 48       3           144" in out
