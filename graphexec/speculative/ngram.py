"""Prompt-lookup drafting (n-gram): drafts copied from the request's own history.

The history is the prompt followed by the output so far; the drafter searches its last
`ngram_window` tokens (a bound on the work per row and step). It takes the longest suffix
of them, from `ngram_max` down to `ngram_min` tokens, that also occurs earlier in the
window, and proposes the (up to) K tokens that followed its latest earlier occurrence. No draft
probabilities: the drafts are deterministic, so strict verification accepts each with the
highest possible probability, p(draft).

`ngram_drafts` defines it over an array. The executor drafts on the device, inside the
captured step (`ngram_device.NgramHistory`), so that a step needs nothing from the host
work of the step before; `TokenHistory.drafts` gives the same drafts on the host, from
the history kept as bytes, for rows whose token masks the host computes over the drafts
(a grammar's matcher).
"""

from __future__ import annotations

import numpy as np

TOKEN_WORD = np.dtype("<i4")  # a token's bytes in the searched copy


class TokenHistory:
    """A request's prompt and output as 4-byte words in one bytearray (appends are
    amortised O(1); `drafts` searches it as bytes)."""

    __slots__ = ("_bytes",)

    def __init__(self, prompt: list[int]) -> None:
        self._bytes = bytearray(np.asarray(prompt, dtype=TOKEN_WORD).tobytes())

    def extend(self, tokens) -> None:
        """Append token ids (a list or an integer array; a TOKEN_WORD array is not
        converted again)."""
        self._bytes += np.asarray(tokens, dtype=TOKEN_WORD).tobytes()

    @property
    def tokens(self) -> np.ndarray:
        return np.frombuffer(bytes(self._bytes), dtype=TOKEN_WORD).astype(np.int64)

    def drafts(self, k: int, ngram_max: int, ngram_min: int, window: int) -> list[int]:
        """`ngram_drafts(self.tokens, k, ngram_max, ngram_min, window)`: for n from the
        longest, the latest occurrence of the last n tokens ending before the last token
        (a backward byte search, kept to token boundaries, inside the window), and the k
        tokens after it."""
        data = self._bytes
        L = len(data) // 4
        lo = 4 * max(L - window, 0)
        for n in range(min(ngram_max, L - lo // 4 - 1), ngram_min - 1, -1):
            suffix = bytes(data[4 * (L - n) :])
            end = 4 * (L - 1)  # an occurrence lies in tokens 0..L-2
            while (at := data.rfind(suffix, lo, end)) >= 0:
                if at % 4 == 0:
                    start = at // 4 + n
                    words = bytes(data[4 * start : 4 * min(start + k, L)])
                    return np.frombuffer(words, dtype=TOKEN_WORD).tolist()
                end = at + len(suffix) - 1  # a match across token boundaries: earlier
        return []


def ngram_drafts(history: np.ndarray, k: int, ngram_max: int, ngram_min: int,
                 window: int | None = None) -> list[int]:  # fmt: skip
    """Up to k drafts for `history` (1-D int64): the tokens after the latest earlier
    occurrence of its longest matching suffix of ngram_min..ngram_max tokens, within its
    last `window` tokens (None: all of it); [] if none."""
    if window is not None:
        history = history[max(history.shape[0] - window, 0) :]
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
