"""OpenAI's response shapes, built from `RequestOutput`s: the per-choice state of one
request (`Choice`), full responses, SSE chunks and logprobs."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from graphexec.request import RequestOutput

try:  # orjson: the events' JSON at a fraction of json's cost (the front end's hot path)
    import orjson

    def dumps(obj: Any) -> str:
        return orjson.dumps(obj).decode()

except ImportError:  # pragma: no cover (a dependency; kept optional for embedders)

    def dumps(obj: Any) -> str:
        return json.dumps(obj, ensure_ascii=False)


@dataclass
class Choice:
    """One stream of a request (one prompt x one of its n streams)."""

    index: int
    seed: int | None = None
    prompt: int = 0  # which of the request's prompts it continues
    text: list[str] = field(default_factory=list)
    tokens: int = 0
    finish_reason: str | None = None
    logprobs: list[dict[str, Any]] = field(default_factory=list)  # chat entries, per token
    last: float | None = None  # monotonic time of its last token
    prompt_logprobs: list | None = None  # [None, PromptLogprob, ...] when asked

    @staticmethod
    def shows(o: RequestOutput) -> bool:
        """Whether the answer shows this token (its text, logprobs and event): not the end-
        of-turn token that finishes a request by "stop" without text (EOS, a stop token id,
        a grammar's end), which OpenAI's answers never list. A stop string's token stays."""
        return o.token_id is not None and not (
            o.finish_reason == "stop" and not o.text and not isinstance(o.stop_reason, str)
        )

    def add(self, o: RequestOutput, token_text) -> str:
        """Take one output; the text it adds (an end without a token adds none)."""
        self.seed = o.seed
        if o.prompt_logprobs is not None:
            self.prompt_logprobs = o.prompt_logprobs
        piece = o.text or ""
        if o.token_id is not None:
            self.tokens += 1
            if o.logprob is not None and self.shows(o):
                self.logprobs.append(_entry(token_text(o.token_id), o.logprob,
                                            o.top_logprobs or [], token_text))  # fmt: skip
        self.text.append(piece)
        if o.finished:
            self.finish_reason = o.finish_reason
        return piece


def _entry(tok: str, logprob: float, top: list[tuple[int, float]], token_text) -> dict:
    return {"token": tok, "logprob": logprob, "bytes": list(tok.encode("utf-8")),
            "top_logprobs": [{"token": (t := token_text(i)), "logprob": lp,
                              "bytes": list(t.encode("utf-8"))} for i, lp in top]}  # fmt: skip


def chat_logprobs(entries: list[dict[str, Any]]) -> dict[str, Any]:
    return {"content": entries}


def completion_logprobs(entries: list[dict[str, Any]], texts: list[str]) -> dict[str, Any]:
    """Completions' legacy shape: tokens, token_logprobs, top_logprobs (dicts), text_offset."""
    offsets, at = [], 0
    for t in texts[: len(entries)]:
        offsets.append(at)
        at += len(t)
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
        "text_offset": offsets + [at] * (len(entries) - len(offsets)),
    }


def usage(prompt_tokens: int, choices: list[Choice]) -> dict[str, int]:
    done = sum(c.tokens for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": done,
            "total_tokens": prompt_tokens + done}  # fmt: skip


@dataclass(frozen=True)
class Echo:
    """A completions prompt shown before its completion: its text (as given, or its ids
    decoded), its ids, and where each token's text starts in that text."""

    text: str
    ids: list[int]
    offsets: list[int]


def prompt_logprobs_json(entries: list, token_text) -> list:
    """vLLM's prompt_logprobs: None for the first token, then {id: {logprob, rank,
    decoded_token}} holding the prompt's token and the top-N."""
    out: list = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        d = {str(e.token_id): {"logprob": e.logprob, "rank": e.rank,
                               "decoded_token": token_text(e.token_id)}}  # fmt: skip
        for r, (i, lp) in enumerate(e.top_logprobs, 1):
            d.setdefault(str(i), {"logprob": lp, "rank": r, "decoded_token": token_text(i)})
        out.append(d)
    return out


def echo_logprobs(echo: Echo, entries: list, token_text) -> dict[str, Any]:
    """Completions' logprobs of the echoed prompt: its first token has none (null)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for tok, e, at in zip(echo.ids, entries, echo.offsets, strict=False):
        out["tokens"].append(token_text(tok))
        out["token_logprobs"].append(None if e is None else e.logprob)
        out["top_logprobs"].append(None if e is None else
                                   {token_text(i): lp for i, lp in e.top_logprobs})  # fmt: skip
        out["text_offset"].append(at)
    return out


@dataclass
class Shape:
    """How one request is answered: chat or completions, its id, model and options."""

    chat: bool
    id: str
    model: str
    logprobs: bool
    include_usage: bool
    tools: Any = None  # a forced `tools.ToolChoice`: choices answer with tool_calls
    echo: list[Echo] | None = None  # completions' echo: per prompt
    echo_only: bool = False  # max_tokens 0: the prompt alone
    prompt_logprobs: bool = False  # report each choice's prompt logprobs
    token_text: Any = None  # token id -> its text, as logprobs show it
    created: int = field(default_factory=lambda: int(time.time()))
    # a token event of choice (index, seed), split around its text (`chunk`)
    _texts: dict[tuple[int, int | None], list[str]] = field(default_factory=dict)

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def full(self, choices: list[Choice], prompt_tokens: int) -> dict[str, Any]:
        """The non-streaming response."""
        out = []
        for c in choices:
            text = "".join(c.text)
            d: dict[str, Any] = {"index": c.index}
            if self.chat:
                d["message"] = {"role": "assistant", "content": text}
                calls = self.tools.calls(text) if self.tools is not None else []
                if calls:
                    d["message"] = {"role": "assistant", "content": self.tools.content(text),
                                    "tool_calls": calls}  # fmt: skip
                d["logprobs"] = chat_logprobs(c.logprobs) if self.logprobs else None
            else:
                d["text"] = text
                d["logprobs"] = completion_logprobs(c.logprobs, c.text) if self.logprobs else None
                if self.echo is not None:
                    self._echoed(d, c)
            if self.prompt_logprobs and c.prompt_logprobs is not None:
                d["prompt_logprobs"] = prompt_logprobs_json(c.prompt_logprobs, self.token_text)
            d.update(finish_reason=self.finish(c.finish_reason, text), seed=c.seed)
            out.append(d)
        obj = "chat.completion" if self.chat else "text_completion"
        use = usage(prompt_tokens, [] if self.echo_only else choices)
        return {**self._head(obj), "choices": out, "usage": use}

    def _echoed(self, d: dict[str, Any], c: Choice) -> None:
        """The prompt before the completion (the prompt alone with max_tokens 0), and its
        logprobs before the completion's, offsets continuing after the prompt's text."""
        e = self.echo[c.prompt]
        if self.echo_only:
            d["text"], c.finish_reason = e.text, "length"
        else:
            d["text"] = e.text + d["text"]
        if d["logprobs"] is None:
            return
        head = echo_logprobs(e, c.prompt_logprobs or [None] * len(e.ids), self.token_text)
        if not self.echo_only:
            tail = d["logprobs"]
            for k in head:
                add = tail[k] if k != "text_offset" else [len(e.text) + x for x in tail[k]]
                head[k] = head[k] + add
        d["logprobs"] = head

    def finish(self, reason: str | None, text: str = "") -> str | None:
        """OpenAI's finish_reason: output that ended by its grammar holding tool calls is
        "tool_calls"; a cut ("length") stays."""
        if self.tools is None or reason != "stop":
            return reason
        return "tool_calls" if self.tools.calls(text) else reason

    def tool_chunk(self, c: Choice) -> str:
        """A streamed choice's tool calls, whole, in one event (its text is held until
        the grammar completes it: only a complete call parses); its content first, or the
        whole text when it holds no complete call (cut by max_tokens)."""
        text = "".join(c.text)
        calls = self.tools.calls(text)
        if not calls:
            return self._chunk(c, text, None, None, False)
        head = self._chunk(c, self.tools.content(text), None, None, False) \
            if self.tools.content(text) else ""  # fmt: skip
        return head + self._chunk(
            c, None, None, None, False, tool_calls=[{"index": i, **x} for i, x in enumerate(calls)]
        )

    def chunk(self, c: Choice, piece: str | None, logprob: dict | None = None,
              finish: str | None = None, role: bool = False) -> str:  # fmt: skip
        """One SSE event for choice c: a token's text, its end (finish), or the chat role."""
        if logprob is None and finish is None and not role:  # a token: the hot path
            cut = self._texts.get((c.index, c.seed))
            if cut is None:  # the event with a marker for the text, split once per choice
                event = self._chunk(c, _MARK, None, None, False)
                cut = self._texts[(c.index, c.seed)] = event.split(_MARK_JSON)
            return cut[0] + dumps(piece or "") + cut[1]
        return self._chunk(c, piece, logprob, finish, role)

    def _chunk(self, c: Choice, piece: str | None, logprob: dict | None, finish: str | None,
               role: bool, tool_calls: list | None = None) -> str:  # fmt: skip
        d: dict[str, Any] = {"index": c.index}
        if self.chat:
            delta: dict[str, Any] = {} if finish else {"content": piece or ""}
            if role:
                delta = {"role": "assistant", "content": ""}
            elif tool_calls is not None:
                delta = {"tool_calls": tool_calls}
            d["delta"] = delta
            d["logprobs"] = chat_logprobs([logprob]) if logprob else None
        else:
            d["text"] = piece or ""
            d["logprobs"] = completion_logprobs([logprob], [piece or ""]) if logprob else None
        reason = self.finish(finish, "".join(c.text) if self.tools is not None else "")
        d.update(finish_reason=reason, seed=c.seed)
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        body = {**self._head(obj), "choices": [d]}
        if self.include_usage:
            body["usage"] = None
        return sse(body)

    def usage_chunk(self, choices: list[Choice], prompt_tokens: int) -> str:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return sse({**self._head(obj), "choices": [], "usage": usage(prompt_tokens, choices)})


_MARK = "\x00text\x00"  # never a token's text: the executor's text has no NUL
_MARK_JSON = dumps(_MARK)


def sse(body: dict[str, Any]) -> str:
    return f"data: {dumps(body)}\n\n"


DONE = "data: [DONE]\n\n"
