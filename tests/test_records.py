"""genspec.records.IncrementalText: the text of a growing token list, decoded a few tokens at a time (the
server's streams), against decoding every token at once."""
from __future__ import annotations

import random

import pytest

from tiny_models import byte_tokenizer

from genspec.records import IncrementalText

TEXTS = ["Voilà le café, déjà vu — naïve 日本語のテキスト 🙂 ok", "def f(x):\n    return x  # ü\n\n",
         "  spaces   and\ttabs ", "1,234.5 , ; ! ?"]


def _embedded_tokenizer():
    from transformers import AutoTokenizer

    from genspec.embedded import default_gguf_path

    return AutoTokenizer.from_pretrained(default_gguf_path(progress=False).parent, local_files_only=True)


@pytest.mark.parametrize("which", ["bytes", "embedded"])
def test_incremental_text_is_the_whole_decode(which):
    """Texts with multi-byte characters and 300 random token sequences, fed 3 tokens at a time: the text so far
    always begins the decode of every token so far and lacks at most its trailing incomplete character, its
    pieces join to it, and the final text is that decode exactly (U+FFFD for a character cut short)."""
    tokenizer = byte_tokenizer() if which == "bytes" else _embedded_tokenizer()
    vocabulary = len(tokenizer)

    def decode(ids):
        return tokenizer.decode(ids, skip_special_tokens=True)

    rng = random.Random(0)
    cases = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in TEXTS]
    cases += [[rng.randrange(vocabulary) for _ in range(rng.randrange(1, 40))] for _ in range(300)]
    held_back = 0
    for ids in cases:
        text, pieces = IncrementalText(decode), []
        for start in range(0, len(ids), 3):
            pieces += text.extend(ids[start:start + 3])
            whole = decode(text.tokens)
            assert whole.startswith(text.text) and whole[len(text.text):].strip("\ufffd") == ""
            held_back += whole != text.text
        assert "".join(pieces) == text.text
        assert text.final() == decode(ids)
    assert held_back > 0  # some sequences stopped inside a character: the hold-back was exercised


def test_a_character_split_over_two_tokens_comes_with_the_second():
    """Byte tokens: "é" is 0xC3 0xA9; the first adds no text, the second adds "é"; cut after the first, the
    final text ends in U+FFFD as a whole decode does."""
    tokenizer = byte_tokenizer()
    ids = tokenizer("café", add_special_tokens=False)["input_ids"]
    text = IncrementalText(lambda t: tokenizer.decode(t, skip_special_tokens=True))
    assert "".join(text.extend(ids[:-2])) == "caf"
    assert text.extend(ids[-2:-1]) == [""] and text.text == "caf" and text.final() == "caf\ufffd"
    assert text.extend(ids[-1:]) == ["é"] and text.text == text.final() == "café"
