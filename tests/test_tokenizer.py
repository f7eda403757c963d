"""Tokenizers: the released tiktoken layout (a small BPE file written here), the byte-level one for folders without
it, and clear errors for a missing tiktoken package or malformed files."""

import base64
import json
import re
import sys

import pytest

from k3jax.tokenizer import ByteTokenizer, TiktokenTokenizer, TokenizerError, load_tokenizer


def write_bpe(folder, merges):
    ranks = [bytes([i]) for i in range(256)] + merges
    (folder / "tiktoken.model").write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(ranks)))
    added = {str(len(ranks)): {"content": "[BOS]"}, str(len(ranks) + 1): {"content": "[EOS]"}}
    (folder / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": added}))
    return len(ranks)


def test_tiktoken_file_is_loaded_with_special_tokens(tmp_path):
    n = write_bpe(tmp_path, [b"th", b"the", b" t", b"es"])
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, TiktokenTokenizer)
    assert tok.eos_id == n + 1 and tok.vocab_size == n + 2
    text = "the tests, 2026: 你好 K3!"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert n - 3 in ids  # the merge b"the" (rank 257) is used
    assert tok.encode("[EOS]") == [n + 1]


def test_byte_fallback_without_a_tokenizer_file(tmp_path):
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, ByteTokenizer) and isinstance(load_tokenizer(None), ByteTokenizer)
    text = "héllo ✓"
    assert tok.encode(text) == list(text.encode("utf-8")) and tok.decode(tok.encode(text)) == text
    assert tok.decode([104, 105, tok.eos_id]) == "hi"


def test_a_tiktoken_file_without_the_package_is_a_clear_error(tmp_path, monkeypatch):
    """No silent byte-level fallback for a BPE checkpoint (its ids would be wrong): one message naming the file and
    the fix, not chained to the ImportError."""
    write_bpe(tmp_path, [])
    monkeypatch.setitem(sys.modules, "tiktoken", None)  # `import tiktoken` fails as where it is not installed
    with pytest.raises(TokenizerError, match=re.escape(f"{tmp_path / 'tiktoken.model'} needs the 'tiktoken' "
                                                       "package: pip install tiktoken")) as caught:
        load_tokenizer(tmp_path)
    assert caught.value.__cause__ is None and caught.value.__suppress_context__


@pytest.mark.parametrize("line, number", [("YQ==", 2), ("YQ== one", 2), ("not*base64 1", 2)])
def test_a_malformed_tiktoken_line_is_named(tmp_path, line, number):
    (tmp_path / "tiktoken.model").write_text(f"YQ== 0\n{line}\n")
    with pytest.raises(TokenizerError, match=rf"tiktoken.model: line {number}: expected '<base64 token> <rank>'"):
        load_tokenizer(tmp_path)


def test_a_malformed_tokenizer_config_is_named(tmp_path):
    write_bpe(tmp_path, [])
    (tmp_path / "tokenizer_config.json").write_text('{"added_tokens_decoder": {"300": "[EOS]"}}')
    with pytest.raises(TokenizerError, match=r"tokenizer_config.json: cannot read added_tokens_decoder"):
        load_tokenizer(tmp_path)
