"""OpenAI function calling: `tools` with `tool_choice`. The model's output is
constrained inside the captured step by a grammar (xgrammar), so its text always parses
into the calls the answer reports:

    named    {"type": "function", "function": {"name": F}}: the output is F's arguments,
             an object valid against F's `parameters` schema; one call of F.
    required an array of at least one {"name": one of the tools, "parameters": its
             arguments} (the form vLLM constrains "required" with); one call per item;
             exactly one with `parallel_tool_calls: false`.
    auto     the checkpoint's own tool-call format, where its chat template declares one
             (`tool_format`): free text, and wherever the model opens a call, a call of
             one of the tools whose arguments follow that tool's schema (an xgrammar
             structural tag). The answer is the text before the first call as content,
             and the calls; text alone when the model called nothing.
    none     (or no tool_choice with tools, or no tools): plain text; the tools still
             reach the chat template, which may describe them to the model.

Tool-call formats known (`FORMATS`): "hermes", the `<tool_call>` JSON blocks of Qwen2.5,
Hermes and many others. A template that declares none answers "auto" with a 400.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from graphexec.serve.errors import APIError
from graphexec.text.grammar import Grammar

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
FORMATS = ("hermes",)


def tool_format(template: str | None) -> str | None:
    """The tool-call format a chat template declares (it writes the format's open tag for
    the model to imitate), or None."""
    return "hermes" if template and HERMES_OPEN in template else None


@dataclass(frozen=True)
class ToolChoice:
    """A tool choice the output is constrained to: `named` is the function's name, or
    None for "required"; `auto` for the checkpoint's own format (named is None)."""

    named: str | None
    grammar: Grammar
    auto: bool = False

    def content(self, text: str) -> str | None:
        """The message's content beside the calls: None when forced; with auto, the
        text before the first call (None when empty)."""
        if not self.auto:
            return None
        head = text.split(HERMES_OPEN, 1)[0].strip()
        return head or None

    def calls(self, text: str) -> list[dict[str, Any]]:
        """The answer's tool_calls from the constrained output `text`. Output cut short
        (by max_tokens) does not parse: it comes back as one call with the raw text, its
        finish_reason ("length") telling the client so. With auto: one per complete
        `<tool_call>` block (none: a plain answer)."""
        if self.auto:
            return _hermes_calls(text)
        try:
            value = json.loads(text)
        except ValueError:
            return [_call(self.named or "", text)]
        if self.named is not None:
            return [_call(self.named, json.dumps(value, ensure_ascii=False))]
        return [_call(item["name"], json.dumps(item["parameters"], ensure_ascii=False))
                for item in value]  # fmt: skip


def _hermes_calls(text: str) -> list[dict[str, Any]]:
    out = []
    for block in text.split(HERMES_OPEN)[1:]:
        body, closed, _ = block.partition(HERMES_CLOSE)
        try:
            value = json.loads(body)
        except ValueError:
            value = None
        if not closed or not isinstance(value, dict) or "name" not in value:
            out.append(_call("", block))  # cut short: the raw text, as forced calls do
            continue
        out.append(_call(value["name"], json.dumps(value.get("arguments", {}),
                                                   ensure_ascii=False)))  # fmt: skip
    return out


def _hermes_grammar(fns: dict[str, dict[str, Any]], parallel: bool) -> Grammar:
    """Free text; at `<tool_call>`, one call of a tool with arguments of its schema (at
    most one whitespace character in a row: a model cannot loop on whitespace)."""
    tags = [{"type": "tag", "begin": f'{HERMES_OPEN}\n{{"name": {json.dumps(name)}, '
             '"arguments": ', "content": {"type": "json_schema", "json_schema": schema,
                                          "max_whitespace_cnt": 1},
             "end": f"}}\n{HERMES_CLOSE}"} for name, schema in fns.items()]  # fmt: skip
    fmt = {"type": "triggered_tags", "triggers": [HERMES_OPEN], "tags": tags,
           "at_least_one": False, "stop_after_first": not parallel}  # fmt: skip
    return Grammar.structural_tag({"type": "structural_tag", "format": fmt})


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}  # fmt: skip


def _functions(tools: Any) -> dict[str, dict[str, Any]]:
    """name -> parameters schema, checked."""
    if not isinstance(tools, list) or not tools:
        raise APIError(400, "tools must be a non-empty list of functions", "tools")
    out: dict[str, dict[str, Any]] = {}
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise APIError(400, f"tools[{i}] must be {{'type': 'function', 'function': "
                           "{'name': str, 'parameters': object}}", "tools")  # fmt: skip
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise APIError(400, f"tools[{i}].function.parameters must be a JSON schema object",
                           "tools")  # fmt: skip
        out[fn["name"]] = params
    return out


def tool_choice(body: dict[str, Any], fmt: str | None = None) -> ToolChoice | None:
    """The constrained choice of a request, or None (plain text); `fmt` the chat
    template's tool-call format (`tool_format`). APIError(400) naming `tools` or
    `tool_choice` for anything malformed or unsupported."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None:
        if choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools", "tool_choice")
        return None
    fns = _functions(tools)
    if choice is None or choice == "none":
        return None
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise APIError(400, "parallel_tool_calls must be a bool", "parallel_tool_calls")
    if choice == "auto":
        if fmt is None:
            raise APIError(400, "tool_choice 'auto' needs the model's own tool-call format, "
                           "and this model's chat template declares none (known: "
                           f"{', '.join(FORMATS)}); use 'required' or name a function",
                           "tool_choice")  # fmt: skip
        return ToolChoice(None, _hermes_grammar(fns, parallel), auto=True)
    if choice == "required":
        items = [{"type": "object", "properties": {"name": {"const": name},
                                                   "parameters": schema},
                  "required": ["name", "parameters"]} for name, schema in fns.items()]  # fmt: skip
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if not parallel:
            schema["maxItems"] = 1
        return ToolChoice(None, Grammar.json_schema(schema))
    fn = choice.get("function") if isinstance(choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise APIError(400, "tool_choice must be 'none', 'auto', 'required' or {'type': "
                       "'function', 'function': {'name': str}}", "tool_choice")  # fmt: skip
    if name not in fns:
        raise APIError(400, f"tool_choice names {name!r}, which is not in tools",
                       "tool_choice")  # fmt: skip
    return ToolChoice(name, Grammar.json_schema(fns[name]))
