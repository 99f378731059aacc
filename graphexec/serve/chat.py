"""The server's chat prompts: OpenAI `messages` checked (`check_messages`) and rendered
by the checkpoint's template (`graphexec.chat`); a refusal is a 400 naming "messages"."""

from __future__ import annotations

from typing import Any

from graphexec.chat import PLAIN_TEMPLATE, read_tokenizer_config
from graphexec.chat import ChatTemplate as _Template
from graphexec.serve.protocol import APIError

__all__ = ["PLAIN_TEMPLATE", "ChatTemplate", "check_messages", "read_tokenizer_config"]


class ChatTemplate(_Template):
    """`graphexec.chat.ChatTemplate` for requests: APIError(400, param "messages") when
    the messages are malformed or the template refuses them."""

    def render(self, messages: Any) -> str:
        from jinja2.exceptions import TemplateError

        msgs = check_messages(messages)
        try:
            return super().render(msgs)
        except TemplateError as e:
            raise APIError(400, f"messages: the chat template refused them: {e}",
                           "messages") from None  # fmt: skip


def check_messages(messages: Any) -> list[dict[str, Any]]:
    """Messages with string content (text parts joined), as chat templates expect."""
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(400, f"messages[{i}] must be an object with a str role", "messages")
        content = m.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise APIError(400, f"messages[{i}].content: only text parts are supported",
                               "messages")  # fmt: skip
            content = "".join(str(p.get("text", "")) for p in content)
        if content is not None and not isinstance(content, str):
            raise APIError(400, f"messages[{i}].content must be a str or a list of text "
                           "parts", "messages")  # fmt: skip
        out.append({**m, "content": content or ""})
    return out
