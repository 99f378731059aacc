"""OpenAI function calling, forced: `tools` with `tool_choice` "required" or a named
function. The model's output is constrained inside the captured step by a JSON-schema
grammar (xgrammar), so its text always parses into the calls the answer reports:

    named    {"type": "function", "function": {"name": F}}: the output is F's arguments,
             an object valid against F's `parameters` schema; one call of F.
    required an array of at least one {"name": one of the tools, "parameters": its
             arguments} (the form vLLM constrains "required" with); one call per item;
             exactly one with `parallel_tool_calls: false`.
    none     (or no tool_choice with tools, or no tools): plain text; the tools still
             reach the chat template, which may describe them to the model.

"auto" would need the checkpoint's own tool-call format, which this server does not
parse: it is refused (400) rather than answered with unparsed text.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from graphexec.grammar import Grammar
from graphexec.serve.errors import APIError


@dataclass(frozen=True)
class ToolChoice:
    """A forced tool choice: `named` is the function's name, or None for "required"."""

    named: str | None
    grammar: Grammar

    def calls(self, text: str) -> list[dict[str, Any]]:
        """The answer's tool_calls from the constrained output `text`. Output cut short
        (by max_tokens) does not parse: it comes back as one call with the raw text, its
        finish_reason ("length") telling the client so."""
        try:
            value = json.loads(text)
        except ValueError:
            return [_call(self.named or "", text)]
        if self.named is not None:
            return [_call(self.named, json.dumps(value, ensure_ascii=False))]
        return [_call(item["name"], json.dumps(item["parameters"], ensure_ascii=False))
                for item in value]  # fmt: skip


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


def tool_choice(body: dict[str, Any]) -> ToolChoice | None:
    """The forced choice of a request, or None (plain text); APIError(400) naming
    `tools` or `tool_choice` for anything malformed or unsupported."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None:
        if choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools", "tool_choice")
        return None
    fns = _functions(tools)
    if choice is None or choice == "none":
        return None
    if choice == "auto":
        raise APIError(400, "tool_choice 'auto' needs the model's own tool-call format, "
                       "which this server does not parse; use 'required' or name a "
                       "function", "tool_choice")  # fmt: skip
    if choice == "required":
        items = [{"type": "object", "properties": {"name": {"const": name},
                                                   "parameters": schema},
                  "required": ["name", "parameters"]} for name, schema in fns.items()]  # fmt: skip
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        parallel = body.get("parallel_tool_calls", True)
        if not isinstance(parallel, bool):
            raise APIError(400, "parallel_tool_calls must be a bool", "parallel_tool_calls")
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
