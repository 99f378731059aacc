"""A request's way to token ids: the body read within its size cap (`read_body`), then,
off the event loop (`Server` runs these in a thread), the JSON checked and the prompts
tokenized by the `ServedModel`'s tokenizer and chat template (`PromptReader`).

A text longer in bytes than the context's tokens could ever spell is refused before it is
tokenized: each token stands for at most `max_token_bytes` bytes of text, so a text of
more than max_seq_len x that (x2 for normalizers that shorten text) bytes has more tokens
than the context holds. Tokenizing megabytes costs seconds; refusing them costs nothing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from starlette.requests import Request

from graphexec.serve.chat import ChatTemplate
from graphexec.serve.errors import APIError
from graphexec.serve.request_fields import check_depth, check_unicode, model_not_found, too_deep
from graphexec.serve.responses import Echo

MAX_BODY_BYTES = 4 * 1024 * 1024  # --max-body-bytes: a 100k-token prompt is about 400 kB


@dataclass
class ServedModel:
    """What the routes need of the model: its id for clients (`aliases` are accepted
    too), tokenizer, prompt prefix (BOS), context length and chat template."""

    name: str
    tokenizer: Any
    max_seq_len: int
    prompt_prefix: tuple[int, ...] = ()
    chat: ChatTemplate = field(default_factory=ChatTemplate)
    aliases: tuple[str, ...] = ()

    @cached_property
    def max_token_bytes(self) -> int:
        """The most bytes of text one token stands for (a special token's: its name)."""
        tok = self.tokenizer
        return max(1, *(len(tok.token_bytes(i)) for i in range(tok.vocab_size)))


def too_large(size: int, limit: int) -> APIError:
    return APIError(413, f"the body is {size} bytes, more than this server takes ({limit}; "
                    "serve --max-body-bytes)", None, code="request_too_large")  # fmt: skip


async def read_body(request: Request, limit: int) -> bytes:
    """The body, or APIError(413) once it is known to exceed `limit` bytes (by its
    Content-Length, or while it streams in)."""
    size = request.headers.get("content-length", "")
    if size.isdigit() and int(size) > limit:
        raise too_large(int(size), limit)
    parts, got = [], 0
    async for chunk in request.stream():
        got += len(chunk)
        if got > limit:
            raise too_large(got, limit)
        parts.append(chunk)
    return b"".join(parts)


class PromptReader:
    """The body's JSON checked, and its prompts as token ids (synchronous: the server
    calls it in a worker thread)."""

    def __init__(self, model: ServedModel) -> None:
        self.model = model

    def body(self, raw: bytes) -> dict[str, Any]:
        try:
            body = json.loads(raw)
        except ValueError as e:
            raise APIError(400, f"the body is not valid JSON: {e}") from None
        except RecursionError:  # nested past the decoder's own limit
            raise too_deep() from None
        check_depth(body)
        if not isinstance(body, dict):
            raise APIError(400, "the body must be a JSON object")
        check_unicode(body)
        name = body.get("model")
        if name is not None and name != self.model.name and name not in self.model.aliases:
            raise model_not_found(name)
        return body

    def chat_text(self, body: dict[str, Any]) -> str:
        return self.model.chat.render(
            body.get("messages"), body.get("add_generation_prompt", True),
            body.get("continue_final_message", False), body.get("chat_template_kwargs"),
            body.get("tools"),
        )  # fmt: skip

    def encode(self, text: str, field: str, chat: bool = False) -> list[int]:
        """`text`'s ids (special-token names as tokens in chat); APIError(400) naming
        `field` for a text too long in bytes for the context, without tokenizing it."""
        m = self.model
        size = len(text.encode("utf-8", errors="replace"))
        if size > 2 * m.max_seq_len * m.max_token_bytes:
            raise APIError(400, f"This model's maximum context length is {m.max_seq_len} "
                           f"tokens; the {field} is {size} bytes of text, more tokens than "
                           "that", field)  # fmt: skip
        if chat:
            return m.tokenizer.encode(text, allowed_special="all")
        return m.tokenizer.encode(text)

    def prompts(self, body: dict[str, Any], chat: bool) -> list[list[int]]:
        m = self.model
        if chat:  # the template writes BOS itself, as transformers' apply_chat_template
            return [self.encode(self.chat_text(body), "messages", chat=True)]
        out = []
        for item in prompt_items(body):
            if isinstance(item, str):
                out.append([*m.prompt_prefix, *self.encode(item, "prompt")])
            elif isinstance(item, list) and item and all(type(t) is int for t in item):
                out.append(item)
            else:
                raise APIError(400, "prompt must be a str, a list of token ids, or a list of "
                               "those", "prompt")  # fmt: skip
        return out

    def echoes(self, body: dict[str, Any], prompts: list[list[int]]) -> list[Echo]:
        """Each completions prompt as echo shows it: the text given (ids: decoded), and
        where each token's text starts in it (the BOS prefix's tokens at 0)."""
        out = []
        tok = self.model.tokenizer
        for item, ids in zip(prompt_items(body), prompts, strict=True):
            skip = len(self.model.prompt_prefix) if isinstance(item, str) else 0
            stream = tok.decode_stream(skip_special_tokens=False)
            offsets, at = [0] * skip, 0
            for t in ids[skip:]:
                offsets.append(at)
                at += len(stream.push(t))
            text = item if isinstance(item, str) else tok.decode(ids)
            out.append(Echo(text, list(ids), offsets))
        return out

    def tokenize(self, body: dict[str, Any]) -> dict[str, Any]:
        """/tokenize: {"prompt": str} or {"messages": [...], chat fields},
        add_special_tokens -> {"tokens", "count", "max_model_len"}: the ids a generation
        request would run."""
        m = self.model
        chat = body.get("messages") is not None
        if not chat and not isinstance(body.get("prompt"), str):
            raise APIError(400, "tokenize takes prompt (a str) or messages", "prompt")
        special = body.get("add_special_tokens", True)
        if not isinstance(special, bool):
            raise APIError(400, "add_special_tokens must be a bool", "add_special_tokens")
        if chat:
            ids = m.tokenizer.encode(self.chat_text(body), allowed_special="all")
        else:
            ids = [*(m.prompt_prefix if special else ()), *m.tokenizer.encode(body["prompt"])]
        return {"tokens": list(ids), "count": len(ids), "max_model_len": m.max_seq_len}


def prompt_items(body: dict[str, Any]) -> list[Any]:
    """A completions body's prompts: a list of prompts (str or ids), or the one prompt."""
    p = body.get("prompt")
    return p if isinstance(p, list) and p and not isinstance(p[0], int) else [p]
