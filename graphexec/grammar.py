"""Grammar constraints for SamplingParams: what a request's output must match.

A `Grammar` is a description (kind + text). The executor compiles it with xgrammar
against its tokenizer (compiled grammars are cached by text) and keeps one matcher per
slot; the sampler only ever sees the resulting token bitmask.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

GRAMMAR_KINDS = ("json", "json_schema", "regex", "ebnf")


@dataclass(frozen=True)
class Grammar:
    """kind: "json" (any JSON), "json_schema", "regex" or "ebnf"; text: its source."""

    kind: str
    text: str = ""

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise ValueError(f"grammar kind must be one of {GRAMMAR_KINDS}, got {self.kind!r}")
        if not isinstance(self.text, str):
            raise ValueError(f"grammar text must be a str, got {type(self.text).__name__}")
        if self.kind != "json" and not self.text:
            raise ValueError(f"a {self.kind} grammar needs a non-empty text")

    @classmethod
    def json(cls) -> Grammar:
        return cls("json")

    @classmethod
    def json_schema(cls, schema: str | dict[str, Any]) -> Grammar:
        text = schema if isinstance(schema, str) else json.dumps(schema, sort_keys=True)
        return cls("json_schema", text)

    @classmethod
    def regex(cls, pattern: str) -> Grammar:
        return cls("regex", pattern)

    @classmethod
    def ebnf(cls, grammar: str) -> Grammar:
        return cls("ebnf", grammar)
