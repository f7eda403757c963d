"""Tokenizers: the released tiktoken layout (a small BPE file written here) and the byte fallback."""

import base64
import json

from k3jax.tokenizer import ByteTokenizer, TiktokenTokenizer, load_tokenizer


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
