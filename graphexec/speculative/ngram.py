"""Prompt-lookup drafting (n-gram): drafts copied from the request's own history.

The history is the prompt followed by the output so far. The drafter takes the longest
suffix of it, from `ngram_max` down to `ngram_min` tokens, that also occurs earlier, and
proposes the (up to) K tokens that followed its latest earlier occurrence. No draft
probabilities: the drafts are deterministic, so strict verification accepts each with the
highest possible probability, p(draft).
"""

from __future__ import annotations

import numpy as np


class TokenHistory:
    """A request's prompt and output in one growing int64 array (appends are amortised
    O(1), lookups see a numpy view)."""

    __slots__ = ("_buf", "_n")

    def __init__(self, prompt: list[int], capacity: int) -> None:
        self._buf = np.empty(max(capacity, len(prompt), 1), dtype=np.int64)
        self._buf[: len(prompt)] = prompt
        self._n = len(prompt)

    def extend(self, tokens: list[int]) -> None:
        end = self._n + len(tokens)
        if end > self._buf.shape[0]:
            grown = np.empty(max(end, 2 * self._buf.shape[0]), dtype=np.int64)
            grown[: self._n] = self._buf[: self._n]
            self._buf = grown
        self._buf[self._n : end] = tokens
        self._n = end

    @property
    def tokens(self) -> np.ndarray:
        return self._buf[: self._n]


def ngram_drafts(history: np.ndarray, k: int, ngram_max: int, ngram_min: int) -> list[int]:
    """Up to k drafts for `history` (1-D int64): the tokens after the latest earlier
    occurrence of its longest matching suffix of ngram_min..ngram_max tokens; [] if none."""
    L = history.shape[0]
    if L < 2:
        return []
    # earlier occurrences of the last token end a candidate match at i (i <= L-2, so a
    # token follows); extend each backwards while it keeps matching the suffix
    ends = np.flatnonzero(history[: L - 1] == history[L - 1])
    if ends.size == 0:
        return []
    length = np.ones(ends.shape[0], dtype=np.int64)
    for t in range(1, min(ngram_max, L - 1)):
        back = ends - t
        ok = (length == t) & (back >= 0)
        ok[ok] = history[back[ok]] == history[L - 1 - t]
        length += ok
    best = int(length.max())
    if best < ngram_min:
        return []
    start = int(ends[np.flatnonzero(length == best)[-1]]) + 1
    return history[start : start + k].tolist()
