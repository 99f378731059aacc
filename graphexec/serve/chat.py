"""The server's chat prompts: OpenAI `messages` checked (`check_messages`) and rendered
by the checkpoint's template (`graphexec.text.chat_template`); a refusal is a 400 naming
"messages"."""

from __future__ import annotations

from functools import cached_property
from typing import Any

from graphexec.serve.errors import APIError
from graphexec.text.chat_template import PLAIN_TEMPLATE, read_tokenizer_config
from graphexec.text.chat_template import ChatTemplate as _Template

__all__ = ["PLAIN_TEMPLATE", "ChatTemplate", "check_messages", "read_tokenizer_config"]


class ChatTemplate(_Template):
    """`text.chat_template.ChatTemplate` for requests: APIError(400, param "messages")
    when the messages are malformed or the template refuses them."""

    @cached_property
    def shows_tools(self) -> bool:
        """Whether the template writes a request's tools into the prompt (a probe tool's
        name appears in it), so the model sees them."""
        probe = {"type": "function", "function": {"name": "graphexec_probe_tool",
                                                  "parameters": {"type": "object"}}}  # fmt: skip
        try:
            text = super().render([{"role": "user", "content": "hi"}], tools=[probe])
        except Exception:  # noqa: BLE001 (a template that refuses tools shows none)
            return False
        return "graphexec_probe_tool" in text

    def render(self, messages: Any, add_generation_prompt: Any = True,
               continue_final_message: Any = False, chat_template_kwargs: Any = None,
               tools: Any = None) -> str:  # fmt: skip
        """The request's prompt text. `continue_final_message` (vLLM's): the last message
        (the assistant's, unfinished) is continued: the text stops where its content
        ends, with no generation prompt and nothing the template closes it with."""
        from jinja2.exceptions import TemplateError

        msgs = check_messages(messages)
        for name, v in (("add_generation_prompt", add_generation_prompt),
                        ("continue_final_message", continue_final_message)):  # fmt: skip
            if not isinstance(v, bool):
                raise APIError(400, f"{name} must be a bool, got {v!r}", name)
        if chat_template_kwargs is None:
            chat_template_kwargs = {}
        if not isinstance(chat_template_kwargs, dict) or not all(
            isinstance(k, str) for k in chat_template_kwargs
        ):
            raise APIError(400, "chat_template_kwargs must be an object", "chat_template_kwargs")
        if continue_final_message and add_generation_prompt:
            raise APIError(400, "continue_final_message needs add_generation_prompt: false",
                           "continue_final_message")  # fmt: skip
        extra = dict(chat_template_kwargs)
        if tools is not None:
            extra.setdefault("tools", tools)
        try:
            text = super().render(msgs, add_generation_prompt, **extra)
        except TemplateError as e:
            raise APIError(400, f"messages: the chat template refused them: {e}",
                           "messages") from None  # fmt: skip
        if continue_final_message:
            last = msgs[-1]["content"]
            at = text.rfind(last) if last else -1
            if last and at < 0:
                raise APIError(400, "continue_final_message: the template does not show the "
                               "last message's content verbatim",
                               "continue_final_message")  # fmt: skip
            text = text[: at + len(last)] if last else text
        return text


ROLES = ("system", "developer", "user", "assistant", "tool", "function")  # OpenAI's


def check_messages(messages: Any) -> list[dict[str, Any]]:
    """Messages with string content (text parts joined), as chat templates expect. As
    OpenAI: a role of ROLES, and a content (a str or text parts) in every message but an
    assistant's with tool_calls."""
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(400, f"messages[{i}] must be an object with a str role", "messages")
        if m["role"] not in ROLES:
            raise APIError(400, f"messages[{i}].role must be one of {', '.join(ROLES)}, got "
                           f"{m['role']!r}", "messages")  # fmt: skip
        content = m.get("content")
        if content is None and not (m["role"] == "assistant" and m.get("tool_calls")):
            raise APIError(400, f"messages[{i}].content is required (a str or a list of text "
                           f"parts) in a {m['role']} message", "messages")  # fmt: skip
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
