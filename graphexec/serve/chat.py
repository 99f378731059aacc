"""Chat prompts: the checkpoint's chat template rendered as transformers renders it
(`apply_chat_template(messages, add_generation_prompt=True)`: jinja2 in a sandbox, with
bos_token / eos_token and raise_exception), or a plain template when it has none."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

from graphexec.serve.protocol import APIError

# for checkpoints without a template (and TinyLM): role-prefixed lines
PLAIN_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def _tojson(x: Any, ensure_ascii: bool = False, indent=None, separators=None,
            sort_keys: bool = False) -> str:  # fmt: skip
    # transformers' filter: jinja2's own escapes HTML, which a prompt must not get
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)  # fmt: skip


def _raise(message: str):
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def read_tokenizer_config(folder: str | Path | None) -> tuple[str | None, dict[str, str]]:
    """(chat_template, {bos_token, eos_token}) from folder/tokenizer_config.json, when any."""
    p = Path(folder) / "tokenizer_config.json" if folder else None
    if p is None or not p.is_file():
        return None, {}
    cfg = json.loads(p.read_text(encoding="utf-8"))
    tpl = cfg.get("chat_template")
    if isinstance(tpl, list):  # named templates: the default one
        tpl = next((t.get("template") for t in tpl if t.get("name") == "default"), None)
    special = {}
    for name in ("bos_token", "eos_token"):
        v = cfg.get(name)
        v = v.get("content") if isinstance(v, dict) else v
        if isinstance(v, str):
            special[name] = v
    return (tpl if isinstance(tpl, str) else None), special


@dataclass
class ChatTemplate:
    """Renders messages to the prompt text; `source` None means PLAIN_TEMPLATE."""

    source: str | None = None
    special_tokens: dict[str, str] = field(default_factory=dict)

    @cached_property
    def _template(self):
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[loopcontrols])  # fmt: skip
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        return env.from_string(self.source or PLAIN_TEMPLATE)

    def render(self, messages: Any) -> str:
        """The prompt text for OpenAI `messages`; APIError(400, param "messages") when they
        are malformed or the template refuses them."""
        from jinja2.exceptions import TemplateError

        msgs = check_messages(messages)
        tokens = {"bos_token": "", "eos_token": "", **self.special_tokens}
        try:
            return self._template.render(messages=msgs, add_generation_prompt=True, **tokens)
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
