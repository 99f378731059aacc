"""Grammar constraints for SamplingParams: what a request's output must match.

A `Grammar` is a description (kind + text). The executor compiles it with xgrammar
against its tokenizer (compiled grammars are cached by text) and keeps one matcher per
slot; the sampler only ever sees the resulting token bitmask.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

GRAMMAR_KINDS = ("json", "json_schema", "regex", "ebnf", "structural_tag")
_ANY_JSON = '{"type": ["object", "array"]}'  # what Grammar.json() compiles to


@dataclass(frozen=True)
class Grammar:
    """kind: "json", "json_schema", "regex", "ebnf" or "structural_tag"; text: its source.

    "json" is any JSON object or array (the top level xgrammar's builtin JSON grammar
    allows). Both JSON kinds compile to compact JSON (", " and ": " separators, no other
    whitespace between tokens): grammars that allow free whitespace let a model loop on
    spaces or newlines until max_tokens.
    """

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

    @classmethod
    def structural_tag(cls, tag: str | dict[str, Any]) -> Grammar:
        """xgrammar's structural tag (JSON): free text until a trigger, then the tag's
        constrained content (e.g. a tool call's arguments)."""
        text = tag if isinstance(tag, str) else json.dumps(tag, sort_keys=True)
        return cls("structural_tag", text)


class GrammarCompiler:
    """Compiles `Grammar`s with xgrammar against one tokenizer, cached by (kind, text).

    Args:
        tokenizer: a `graphexec.Tokenizer` (its raw token bytes form xgrammar's vocabulary;
            any of its EOS ids ends a grammar).
        vocab_size: the model's V (>= the tokenizer's; ids past it are never allowed).
    """

    def __init__(self, tokenizer, vocab_size: int) -> None:
        import xgrammar as xgr

        if vocab_size < tokenizer.vocab_size:
            raise ValueError(
                f"vocab_size ({vocab_size}) must be >= the tokenizer's ({tokenizer.vocab_size})"
            )
        eos = set(tokenizer.eos_token_ids)  # any EOS ends a grammar's text
        # special tokens get no bytes, so a grammar never spells text with them (their
        # names would vanish from the decoded output)
        vocab = [b"" if tokenizer.is_special(i) and i not in eos else tokenizer.token_bytes(i)
                 for i in range(tokenizer.vocab_size)]  # fmt: skip
        info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=vocab_size,
                                 stop_token_ids=sorted(eos))  # fmt: skip
        self.vocab_size = vocab_size
        self.has_stop_token = bool(eos)
        self._xgr = xgr
        self._compiler = xgr.GrammarCompiler(info, max_threads=4)
        self._cache: dict[tuple[str, str], Any] = {}

    def compile(self, grammar: Grammar):
        """The xgrammar CompiledGrammar of `grammar`; ValueError naming the grammar if bad."""
        key = (grammar.kind, grammar.text)
        if key not in self._cache:
            c = self._compiler
            try:
                if grammar.kind in ("json", "json_schema"):
                    # compact JSON: free whitespace lets a sampler loop on spaces forever (the
                    # builtin JSON grammar has no such option, hence the schema for "json")
                    text = _ANY_JSON if grammar.kind == "json" else grammar.text
                    g = self._xgr.Grammar.from_json_schema(text, any_whitespace=False)
                    compiled = c.compile_grammar(self._json_strings(g))
                elif grammar.kind == "regex":
                    compiled = c.compile_regex(grammar.text)
                elif grammar.kind == "structural_tag":
                    tag = self._xgr.Grammar.from_structural_tag(grammar.text)
                    compiled = c.compile_grammar(self._json_strings(tag))
                else:
                    compiled = c.compile_grammar(grammar.text)
            except Exception as e:  # xgrammar raises several types for bad sources
                raise ValueError(
                    f"grammar ({grammar.kind}) does not compile: {compile_error(e)}"
                ) from e
            self._cache[key] = compiled
        return self._cache[key]

    def _json_strings(self, g):
        """`g` with every negated character class (in JSON grammars: the characters of a
        string) refusing the control characters U+0000-U+001F, which JSON allows in a
        string only escaped. xgrammar's rule for strings with minLength / maxLength lets
        them through raw, and strict parsers (json.loads) reject such text."""
        text = str(g)
        fixed = no_raw_controls(text)
        return g if fixed == text else self._xgr.Grammar.from_ebnf(fixed)

    def matcher(self, grammar: Grammar):
        return self._xgr.GrammarMatcher(self.compile(grammar))


class GrammarSlots:
    """One xgrammar matcher per slot, and the step's bitmask rows.

    `fill(slots)` writes row b of a pinned host buffer for slots[b] (all ones where the slot
    has no grammar) and returns it; the executor copies it into its static device bitmask
    with non_blocking=True. `accept` feeds a sampled token back and reports termination.
    """

    def __init__(self, compiler: GrammarCompiler, max_rows: int, offsets: int = 1) -> None:
        import torch

        self.compiler = compiler
        self.words = (compiler.vocab_size + 31) // 32
        pin = torch.cuda.is_available()
        self.host = torch.full((max_rows, self.words), -1, dtype=torch.int32, pin_memory=pin)
        self.host_runs = None  # [max_rows, offsets, W]: masks per offset (speculation)
        if offsets > 1:
            self.host_runs = torch.full((max_rows, offsets, self.words), -1, dtype=torch.int32,
                                        pin_memory=pin)  # fmt: skip
        self._matchers: dict[int, Any] = {}

    def add(self, slot: int, grammar: Grammar) -> None:
        self._matchers[slot] = self.compiler.matcher(grammar)

    def remove(self, slot: int) -> None:
        self._matchers.pop(slot, None)

    def has(self, slot: int) -> bool:
        return slot in self._matchers

    def fill(self, slots: list[int]):
        """[len(slots), W] int32 host rows (a view of the pinned buffer)."""
        rows = self.host[: len(slots)]
        rows.fill_(-1)
        for b, s in enumerate(slots):
            m = self._matchers.get(s)
            if m is not None:
                m.fill_next_token_bitmask(self.host, b)
        return rows

    def fill_runs(self, slots: list[int], drafts: list[list[int]]):
        """Masks per offset for speculative runs: row b, offset j is slot b's mask after
        its drafts 0..j-1. A draft the grammar refuses (or one after it terminates) ends
        the row's drafts there. Matchers are rolled back to where they were. Returns
        ([len(slots), offsets, W] host rows, the number of drafts each row keeps)."""
        rows = self.host_runs[: len(slots)]
        rows.fill_(-1)
        flat = rows.view(-1, self.words)
        t = rows.shape[1]
        kept = []
        for b, s in enumerate(slots):
            m = self._matchers.get(s)
            if m is None:
                kept.append(len(drafts[b]))
                continue
            m.fill_next_token_bitmask(flat, b * t)
            n = 0
            for d in drafts[b]:
                # a draft the mask refuses ends the run before the matcher sees it:
                # xgrammar logs every refused token (special ones included) to stderr
                if m.is_terminated() or not _allows(flat[b * t + n], int(d)):
                    break
                if not m.accept_token(int(d)):
                    break
                n += 1
                if not m.is_terminated():
                    m.fill_next_token_bitmask(flat, b * t + n)
            if n:
                m.rollback(n)
            kept.append(n)
        return rows, kept

    def accept(self, slot: int, token_id: int) -> bool:
        """Feed `token_id` to the slot's matcher; True when the grammar has terminated
        (or rejects the token, which the mask should have made impossible). Without a
        stop token (a tokenizer with no EOS) nothing could end a complete match, so the
        request stops at the first point where the grammar is complete."""
        m = self._matchers.get(slot)
        if m is None:
            return False
        ok = m.accept_token(int(token_id))
        done = m.is_terminated() or (not self.compiler.has_stop_token and m.is_completed())
        return (not ok) or done


def _allows(row, token_id: int) -> bool:
    """Whether bitmask row [W] (int32, host) allows `token_id`."""
    word = token_id >> 5
    return 0 <= word < row.shape[0] and bool((int(row[word]) >> (token_id & 31)) & 1)


_CONTROLS = r"\0-\x1f"  # as xgrammar writes the range in a character class


def no_raw_controls(ebnf: str) -> str:
    """xgrammar EBNF text whose negated character classes ([^...], outside quoted
    literals) all exclude U+0000-U+001F too."""
    out, i, n = [], 0, len(ebnf)
    while i < n:
        ch = ebnf[i]
        if ch not in '"[':
            out.append(ch)
            i += 1
            continue
        # a literal or a class: copied whole (escapes included), a negated class widened
        j = i + 1
        head = ch
        if ch == "[" and ebnf.startswith("^", j):
            head, j = "[^", j + 1
            if not ebnf.startswith(_CONTROLS, j):
                head += _CONTROLS
        start, close = j, '"' if ch == '"' else "]"
        while j < n and ebnf[j] != close:
            j += 2 if ebnf[j] == "\\" else 1
        out.append(head + ebnf[start : j + 1])
        i = j + 1
    return "".join(out)


# xgrammar's C++ errors start with a time and a source location: "[12:00:01] /x/y.cc:42: "
_CPP_PREFIX = re.compile(r"\[\d{1,2}:\d{2}:\d{2}\]\s*|\S*\.(?:cc|cpp|cxx|h|hpp):\d+:\s*")


def compile_error(e: BaseException) -> str:
    """What is wrong in a grammar or schema, without the compiler's time, file and line."""
    msg = _CPP_PREFIX.sub("", str(e)).strip()
    return msg.splitlines()[0] if msg else type(e).__name__
