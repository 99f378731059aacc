"""Chat prompts: a checkpoint's chat template rendered as transformers renders it
(`apply_chat_template(messages, add_generation_prompt=True)`: jinja2 in a sandbox with
trim_blocks, lstrip_blocks, loop controls, a `tojson` that does not escape HTML,
`raise_exception`, bos_token / eos_token), or a plain template when it has none. Used by
the demo and by the server (`serve.chat` adds the request checks)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

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


def _tokenizer_config(folder: Path) -> dict:
    try:
        cfg = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):  # absent or unreadable: a template is optional
        return {}
    return cfg if isinstance(cfg, dict) else {}


def read_tokenizer_config(folder: str | Path | None) -> tuple[str | None, dict[str, str]]:
    """(chat template, {"bos_token", "eos_token"} strings) of a checkpoint folder: the
    template from tokenizer_config.json ("chat_template": a string, or the one named
    "default" in a list), else from chat_template.jinja (transformers 5 keeps it there);
    a special token given as an AddedToken dict counts by its "content"."""
    if not folder:
        return None, {}
    folder = Path(folder)
    cfg = _tokenizer_config(folder)
    tpl = cfg.get("chat_template")
    if isinstance(tpl, list):  # [{"name": ..., "template": ...}, ...]
        tpl = next((t.get("template") for t in tpl if t.get("name") == "default"), None)
    if not isinstance(tpl, str):
        jinja = folder / "chat_template.jinja"
        tpl = jinja.read_text(encoding="utf-8") if jinja.is_file() else None
    special = {}
    for name in ("bos_token", "eos_token"):
        v = cfg.get(name)
        v = v.get("content") if isinstance(v, dict) else v
        if isinstance(v, str):
            special[name] = v
    return tpl, special


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

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               **kwargs: Any) -> str:  # fmt: skip
        """The prompt text of `messages`, with the generation prompt unless told otherwise;
        `kwargs` reach the template as variables (transformers' chat_template_kwargs:
        `enable_thinking`, `tools`, ...); jinja2's TemplateError when the template refuses
        them."""
        tokens = {"bos_token": "", "eos_token": "", **self.special_tokens}
        return self._template.render(
            **{
                **kwargs,
                **tokens,
                "messages": messages,
                "add_generation_prompt": add_generation_prompt,
            }
        )
