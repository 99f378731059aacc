"""OpenAI function calling: `tools` with `tool_choice`. The model's output is
constrained inside the captured step by a grammar (xgrammar), so its text always parses
into the calls the answer reports:

    named    {"type": "function", "function": {"name": F}}: the output is F's arguments,
             an object valid against F's `parameters` schema; one call of F.
    required an array of at least one {"name": one of the tools, "parameters": its
             arguments} (the form vLLM constrains "required" with); one call per item;
             exactly one with `parallel_tool_calls: false`.
    auto     (also tools without tool_choice: OpenAI's default) the checkpoint's own
             tool-call format, where its chat template declares one (`tool_format`): free
             text, and wherever the model opens a call, a call of one of the tools whose
             arguments follow that tool's schema (an xgrammar structural tag). The answer
             is the text around the complete calls as content, and the calls; text alone
             when the model called nothing. A template that declares no format answers
             "auto" in plain text (the model has no way to call): `tool_notes` says so.
    none     (or no tools): plain text; the tools still reach the chat template, which
             may describe them to the model.

With an output format of the request's own (`response_format`, or vLLM's guided_json /
guided_regex / guided_grammar), as OpenAI: that format shapes the message's content, the
tools its calls. So "none" (and "auto" without a tool-call format) answers text of that
format; "auto" answers either text of that format or one or more calls (never both);
"required" and a named function answer calls, which have no content to shape.

Tool-call formats known (`FORMATS`): "hermes", the `<tool_call>` JSON blocks of Qwen2.5,
Hermes and many others. Output cut by max_tokens holds no call that does not parse: it
comes back as text, finish_reason "length", as OpenAI answers a cut.
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
        """The message's content beside the calls: None when forced; with auto, the text
        around the complete calls (None when empty). Output that does not parse (cut by
        max_tokens) is all content."""
        if self.auto:
            return _hermes(text)[0]
        return None if self._forced(text) else text

    def calls(self, text: str) -> list[dict[str, Any]]:
        """The answer's tool_calls from the constrained output `text`: each one names a
        tool of the request and its arguments parse as JSON. Forced output cut short (by
        max_tokens) does not parse: no calls (OpenAI answers such a cut with its text and
        finish_reason "length"). With auto: one per complete `<tool_call>` block."""
        return _hermes(text)[1] if self.auto else (self._forced(text) or [])

    def _forced(self, text: str) -> list[dict[str, Any]] | None:
        try:
            value = json.loads(text)
        except ValueError:
            return None
        if self.named is not None:
            return [_call(self.named, json.dumps(value, ensure_ascii=False))]
        return [_call(item["name"], json.dumps(item["parameters"], ensure_ascii=False))
                for item in value]  # fmt: skip


def _hermes(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(the text around the complete calls, stripped, or None; the calls). A block cut
    short stays in the text."""
    head, *blocks = text.split(HERMES_OPEN)
    rest, calls = [head], []
    for block in blocks:
        body, closed, after = block.partition(HERMES_CLOSE)
        try:
            value = json.loads(body)
        except ValueError:
            value = None
        if not closed or not isinstance(value, dict) or "name" not in value:
            rest.append(HERMES_OPEN + block)
            continue
        calls.append(_call(value["name"], json.dumps(value.get("arguments", {}),
                                                     ensure_ascii=False)))  # fmt: skip
        rest.append(after)
    return "".join(rest).strip() or None, calls


def _hermes_grammar(fns: dict[str, dict[str, Any]], parallel: bool,
                    text: Grammar | None = None) -> Grammar:  # fmt: skip
    """Free text; at `<tool_call>`, one call of a tool with arguments of its schema (at
    most one whitespace character in a row: a model cannot loop on whitespace). With
    `text`: either text of that grammar, or calls one after another (one per line)."""
    tags = [{"type": "tag", "begin": f'{HERMES_OPEN}\n{{"name": {json.dumps(name)}, '
             '"arguments": ', "content": _json_format(schema),
             "end": f"}}\n{HERMES_CLOSE}"} for name, schema in fns.items()]  # fmt: skip
    if text is None:
        fmt = {"type": "triggered_tags", "triggers": [HERMES_OPEN], "tags": tags,
               "at_least_one": False, "stop_after_first": not parallel}  # fmt: skip
    else:
        calls = {"type": "tags_with_separator", "tags": tags, "separator": "\n",
                 "at_least_one": True, "stop_after_first": not parallel}  # fmt: skip
        fmt = {"type": "or", "elements": [_text_format(text), calls]}
    return Grammar.structural_tag({"type": "structural_tag", "format": fmt})


def _json_format(schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": 1}


def _text_format(g: Grammar) -> dict[str, Any]:
    """A request's output grammar as an element of a structural tag."""
    if g.kind == "json":
        return _json_format({"type": ["object", "array"]})  # what Grammar.json() allows
    if g.kind == "json_schema":
        try:
            return _json_format(json.loads(g.text))
        except ValueError:
            raise APIError(400, "the response's JSON schema does not parse as JSON",
                           "response_format") from None  # fmt: skip
    if g.kind == "regex":
        return {"type": "regex", "pattern": g.text}
    if g.kind == "ebnf":
        return {"type": "grammar", "grammar": g.text}
    raise APIError(400, f"a {g.kind} grammar does not combine with tools", "tools")


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


def tool_choice(body: dict[str, Any], fmt: str | None = None,
                text: Grammar | None = None) -> ToolChoice | None:  # fmt: skip
    """The constrained choice of a request, or None (its text: plain, or `text`); `fmt`
    the chat template's tool-call format (`tool_format`); `text` the request's own output
    grammar (module docstring: with "auto", the answer's other branch). APIError(400)
    naming `tools` or `tool_choice` for anything malformed or unsupported."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None:
        if choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools", "tool_choice")
        return None
    fns = _functions(tools)
    if choice is None:  # OpenAI's default with tools
        choice = "auto"
    if choice == "none" or (choice == "auto" and fmt is None):
        return None
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise APIError(400, "parallel_tool_calls must be a bool", "parallel_tool_calls")
    if choice == "auto":
        return ToolChoice(None, _hermes_grammar(fns, parallel, text), auto=True)
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


def tool_notes(body: dict[str, Any], fmt: str | None, shows_tools: bool) -> list[str]:
    """Warnings for a chat request with tools on this template: it does not show the tools
    to the model (`shows_tools` False), or it has no tool-call format, so "auto" (or tools
    alone) gets plain text."""
    if body.get("tools") is None:
        return []
    notes = []
    if not shows_tools:
        notes.append("the chat template does not show the tools to the model: a request's "
                     "tools constrain tool_choice 'required' or a named function, but the "
                     "model is never told about them")  # fmt: skip
    if fmt is None and body.get("tool_choice", "auto") == "auto":
        notes.append("the chat template declares no tool-call format (known: "
                     f"{', '.join(FORMATS)}): tool_choice 'auto' (the default with tools) "
                     "answers in plain text; 'required' or a named function still call"
                     )  # fmt: skip
    return notes
