"""Token masks the host writes: grammar, allowed_token_ids and bad_words.

Every step's sampler applies each row's bitmask (1 = allowed, int32 words, xgrammar's
layout) inside the captured step; the host writes the rows of requests that need one:

- grammar: the xgrammar matcher's next-token mask (`GrammarSlots`), refreshed every step;
- allowed_token_ids: a fixed row, ANDed in; alone (no grammar, no bad words) it is
  *static*: written once, at every offset, right after the flush that resets the slot
  (`write_static`), and the row is not a mask row of the step plan, so its steps pipeline
  as unmasked ones do;
- bad_words: a word of L tokens bans its last token wherever the request's last L - 1
  output tokens equal its first L - 1 (vLLM's rule: output tokens only), so the row is
  refreshed every step from the request's recent output.

min_tokens is not here: it is a per-slot count applied inside the step
(`SlotTable.min_token_masks`). Under speculation, masks come per offset (`fill_runs`):
offset j's mask is the one after drafts 0..j-1. The rows the host rewrites every step
(`has`: grammar, bad words) depend on the tokens before them: a draft model's drafts,
unknown to the host, cannot be masked for them, so they ride with zero drafts.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from graphexec.params import SamplingParams


@dataclass
class _SlotMasks:
    allowed: np.ndarray | None  # u32 [W]
    bad: list[tuple[int, ...]]  # token sequences
    recent: deque = field(default_factory=deque)  # the last (longest bad word - 1) tokens


def bad_word_ids(params: SamplingParams, tokenizer) -> list[tuple[int, ...]]:
    """The request's bad words as token sequences: a str is tokenised as is and with a
    leading space (as vLLM does; the two usually differ in BPE vocabularies)."""
    out: set[tuple[int, ...]] = set()
    for w in params.bad_words:
        if not isinstance(w, str):
            out.add(tuple(w))
            continue
        if tokenizer is None:
            raise ValueError("bad_words given as str need a tokenizer: pass tokenizer= to "
                             "DecodeExecutor, or give token-id sequences")  # fmt: skip
        for text in (w, " " + w.lstrip()):
            ids = tuple(tokenizer.encode(text))
            if ids:
                out.add(ids)
    return sorted(out)


class TokenMasks:
    """Host-written mask rows for `max_rows` rows (one per request of a step), K+1 per row
    under speculation. `grammar`: a `GrammarSlots` (None without a tokenizer)."""

    def __init__(self, vocab_size: int, max_rows: int, offsets: int, grammar=None) -> None:
        self.words = (vocab_size + 31) // 32
        self.grammar = grammar
        self._pin = pin = torch.cuda.is_available()
        self._host = torch.full((max_rows, self.words), -1, dtype=torch.int32, pin_memory=pin)
        self._host_runs = torch.full((max_rows, offsets, self.words), -1, dtype=torch.int32,
                                     pin_memory=pin)  # fmt: skip
        self._slots: dict[int, _SlotMasks] = {}  # rows rewritten every step
        self._static: dict[int, np.ndarray] = {}  # static rows (u32 [W]) not yet written
        self.offsets = offsets

    def add(self, slot: int, params: SamplingParams, bad: list[tuple[int, ...]]) -> None:
        if params.grammar is not None:
            self.grammar.add(slot, params.grammar)
        if params.allowed_token_ids is None and not bad:
            return
        allowed = None
        if params.allowed_token_ids is not None:
            allowed = np.zeros(self.words * 32, dtype=bool)
            allowed[list(params.allowed_token_ids)] = True
            allowed = np.packbits(allowed.reshape(-1, 8), axis=1, bitorder="little")
            allowed = allowed.reshape(-1).view(np.uint32)
            if params.grammar is None and not bad:
                self._static[slot] = allowed
                return
        keep = max((len(w) for w in bad), default=1) - 1
        self._slots[slot] = _SlotMasks(allowed, bad, deque(maxlen=max(keep, 1)))

    def remove(self, slot: int) -> None:
        if self.grammar is not None:
            self.grammar.remove(slot)
        self._slots.pop(slot, None)
        self._static.pop(slot, None)

    def has(self, slot: int) -> bool:
        """The host rewrites the slot's mask every step (a grammar or bad words): it
        depends on the tokens before it."""
        return slot in self._slots or (self.grammar is not None and self.grammar.has(slot))

    def write_static(self, slots) -> None:
        """Write the static rows of the slots admitted since the last call into `slots`
        (a SlotTable), at every offset: after its flush, which reset those slots' rows
        (from a fresh pinned buffer, which the caching host allocator keeps until the
        copy is done)."""
        if not self._static:
            return
        ids = list(self._static)
        pin = self._pin
        shape = (len(ids), self.offsets, self.words) if self.offsets > 1 else (len(ids), self.words)
        rows = torch.empty(shape, dtype=torch.int32, pin_memory=pin)
        u32 = rows.numpy().view(np.uint32).reshape(len(ids), -1, self.words)
        for b, s in enumerate(ids):
            u32[b] = self._static[s]
        self._static.clear()
        dev = slots.bitmask.device
        idx = torch.tensor(ids, dtype=torch.int64, pin_memory=pin)
        slots.write_masks(idx.to(dev, non_blocking=True), rows.to(dev, non_blocking=True))

    def _apply(self, row: np.ndarray, m: _SlotMasks, tail: list[int]) -> None:
        """AND the allowed ids into `row` (u32 [W]) and clear the bad words' completions
        after the output `tail` (most recent last)."""
        if m.allowed is not None:
            row &= m.allowed
        for w in m.bad:
            k = len(w) - 1
            if k == 0 or (len(tail) >= k and tuple(tail[len(tail) - k :]) == w[:-1]):
                row[w[-1] // 32] &= np.uint32(0xFFFFFFFF ^ (1 << (w[-1] % 32)))

    def fill(self, slots: list[int]) -> torch.Tensor:
        """[len(slots), W] int32 host rows (a view of a pinned buffer)."""
        rows = self.grammar.fill(slots) if self.grammar is not None else self._host[: len(slots)]
        if self.grammar is None:
            rows.fill_(-1)
        u32 = rows.numpy().view(np.uint32)
        for b, s in enumerate(slots):
            m = self._slots.get(s)
            if m is not None:
                self._apply(u32[b], m, list(m.recent))
        return rows

    def fill_runs(self, slots: list[int], drafts: list[list[int]]):
        """Masks per offset ([len(slots), K+1, W] host rows, drafts kept per row): offset j
        is the mask after drafts 0..j-1 (see `GrammarSlots.fill_runs` for grammars)."""
        if self.grammar is not None:
            rows, kept = self.grammar.fill_runs(slots, drafts)
        else:
            rows, kept = self._host_runs[: len(slots)], [len(d) for d in drafts]
            rows.fill_(-1)
        u32 = rows.numpy().view(np.uint32)
        for b, s in enumerate(slots):
            m = self._slots.get(s)
            if m is None:
                continue
            tail = list(m.recent)
            for j in range(rows.shape[1]):
                self._apply(u32[b, j], m, tail + list(drafts[b][:j]))
        return rows, kept

    def accept(self, slot: int, token_id: int) -> bool:
        """Record a sampled token; True when the slot's grammar has terminated."""
        m = self._slots.get(slot)
        if m is not None and m.bad:
            m.recent.append(int(token_id))
        return self.grammar is not None and self.grammar.accept(slot, token_id)


def grammar_slots(tokenizer, vocab_size: int, rows: int, offsets: int):
    """The grammar matchers of `rows` slots, `offsets` masks each (None without a
    tokenizer: no grammars). Imported here: xgrammar loads only when it can be used."""
    if tokenizer is None:
        return None
    from graphexec.text.grammar import GrammarCompiler, GrammarSlots

    return GrammarSlots(GrammarCompiler(tokenizer, vocab_size), rows, offsets)
