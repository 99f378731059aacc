"""A request's output text: incremental detokenisation and stop strings.

Text is produced token by token by the tokenizer's `decode_stream` (never a partial UTF-8
character). With stop strings, the last (longest stop - 1) characters are held back, since
they may be the start of a stop string that the next token completes; a match cuts the
text before the stop string (after it with include_stop_str_in_output) and ends the
request. As vLLM does, stop strings match only once min_tokens tokens exist.
"""

from __future__ import annotations


class OutputText:
    """The text side of one request; `push` per token in position order."""

    def __init__(
        self,
        tokenizer,
        *,
        stop: tuple[str, ...] = (),
        include_stop: bool = False,
        min_tokens: int = 0,
        skip_special_tokens: bool = True,
    ) -> None:
        self._stream = tokenizer.decode_stream(skip_special_tokens=skip_special_tokens)
        self._stop = stop
        self._include = include_stop
        self._min = min_tokens
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._unsent = ""
        self.stop_reason: str | None = None

    @property
    def needs_push(self) -> bool:
        """False when the next token's text is simply its plain text (`Tokenizer.
        plain_texts`): no stop strings to match and no partial character held."""
        return bool(self._stop) or self._stream.pending

    def push(self, token_id: int, generated: int) -> tuple[str, bool]:
        """(the text to report for this token, True when a stop string matched). `generated`
        counts the request's tokens including this one."""
        s = self._unsent + self._stream.push(int(token_id))
        if not self._stop:
            return s, False
        if generated >= self._min:
            hits = [(s.find(x), -len(x), x) for x in self._stop if x in s]
            if hits:
                i, _, x = min(hits)  # the earliest match; the longest at one start
                self.stop_reason = x
                self._unsent = ""
                return s[: i + (len(x) if self._include else 0)], True
        cut = max(0, len(s) - self._hold)
        self._unsent = s[cut:]
        return s[:cut], False

    def flush(self) -> str:
        """Everything held back (the request ended for another reason), but not the bytes
        of a character the last token left unfinished: the text ends before it."""
        self._stream.drop_pending()
        s = self._unsent
        self._unsent = ""
        return s
