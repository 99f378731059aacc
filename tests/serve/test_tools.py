"""tool_choice "auto" in the checkpoint's own format (`serve.tools`): the structural-tag
grammar lets free text through and holds every call to its tool's schema; the answer
splits the text into content and calls (streamed and not)."""

from __future__ import annotations

import json

import pytest
import xgrammar as xgr

import graphexec as gx
from graphexec.request import RequestOutput
from graphexec.serve.chat import ChatTemplate
from graphexec.serve.responses import Choice, Shape
from graphexec.serve.tools import HERMES_CLOSE, tool_choice, tool_format
from graphexec.text.grammar import GrammarCompiler
from tests.serve.test_fields import TIME, WEATHER

QWEN_LIKE = "{% for m in messages %}{{ m['content'] }}{% endfor %}<tool_call>{{ tools }}"
CALL = '<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


@pytest.fixture(scope="module")
def compiler():
    tok = gx.Tokenizer.cl100k()
    return GrammarCompiler(tok, tok.vocab_size)


def accepts(compiler, choice, text: str) -> bool:
    return xgr.GrammarMatcher(compiler.compile(choice.grammar)).accept_string(text)


def test_tools_alone_mean_auto_and_auto_without_a_format_is_text() -> None:
    """OpenAI's default with tools is "auto": tools alone get exactly what an explicit
    "auto" gets; on a template with no tool-call format both answer in plain text (the
    model has no way to call), never one a 400 and the other text."""
    assert tool_format(QWEN_LIKE) == "hermes"
    assert tool_format("{{ messages }}") is None and tool_format(None) is None
    for fmt in ("hermes", None):
        alone = tool_choice({"tools": [WEATHER, TIME]}, fmt)
        assert alone == tool_choice({"tools": [WEATHER, TIME], "tool_choice": "auto"}, fmt)
        assert (alone is None) == (fmt is None)
    assert tool_choice({"tools": [WEATHER], "tool_choice": "none"}, "hermes") is None
    # whether a template writes the tools into the prompt at all
    assert ChatTemplate(QWEN_LIKE).shows_tools and not ChatTemplate(None).shows_tools


def test_auto_grammar_allows_text_and_holds_calls_to_their_schemas(compiler) -> None:
    auto = tool_choice({"tools": [WEATHER, TIME], "tool_choice": "auto"}, "hermes")
    good = CALL.format(name="get_weather", args='{"city": "Oslo", "days": 2}')
    assert accepts(compiler, auto, "Let me look. " + good)
    assert accepts(compiler, auto, good + CALL.format(name="get_time", args='{"zone": "UTC"}'))
    assert accepts(compiler, auto, "No tool needed: it is sunny.")
    assert not accepts(compiler, auto, CALL.format(name="get_weather", args='{"city": "Rome"}'))
    assert not accepts(compiler, auto, CALL.format(name="get_news", args="{}"))


def test_the_answer_splits_content_and_calls_streamed_or_not() -> None:
    auto = tool_choice({"tools": [WEATHER, TIME], "tool_choice": "auto"}, "hermes")
    calls = (CALL.format(name="get_weather", args='{"city": "Lima", "days": 1}')
             + CALL.format(name="get_time", args='{"zone": "CET"}'))  # fmt: skip
    shape = Shape(True, "chatcmpl-x", "m", False, False, auto)

    def answered(text: str) -> tuple[dict, list[dict]]:
        c = Choice(0, seed=1)
        c.add(RequestOutput("r", 5, 0, 1, finished=True, finish_reason="stop", text=text),
              str)  # fmt: skip
        full = shape.full([c], 3)["choices"][0]
        events = [json.loads(x[6:]) for x in shape.tool_chunk(c).split("\n\n") if x]
        end = json.loads(shape.chunk(c, None, finish="stop")[6:])
        return full, [e["choices"][0] for e in [*events, end]]

    full, events = answered("Checking. " + calls)
    msg = full["message"]
    assert msg["content"] == "Checking." and full["finish_reason"] == "tool_calls"
    got = [(t["function"]["name"], json.loads(t["function"]["arguments"]))
           for t in msg["tool_calls"]]  # fmt: skip
    assert got == [("get_weather", {"city": "Lima", "days": 1}), ("get_time", {"zone": "CET"})]
    assert events[0]["delta"]["content"] == "Checking."
    assert [t["function"]["name"] for t in events[1]["delta"]["tool_calls"]] == [
        "get_weather", "get_time"]  # fmt: skip
    assert events[-1]["finish_reason"] == "tool_calls"

    full, events = answered("Sunny all week.")
    assert full["message"] == {"role": "assistant", "content": "Sunny all week."}
    assert full["finish_reason"] == "stop" and events[-1]["finish_reason"] == "stop"
    assert events[0]["delta"]["content"] == "Sunny all week."


STRINGS = {"type": "function", "function": {"name": "note", "parameters": {
    "type": "object", "properties": {
        "plain": {"type": "string"}, "short": {"type": "string", "maxLength": 6},
        "long": {"type": "string", "minLength": 2}, "code": {"type": "string",
                                                             "pattern": "[^x]+"}},
    "required": ["short", "long"]}}}  # fmt: skip
CHOICES = {
    "named": ({"tool_choice": {"type": "function", "function": {"name": "note"}}}, None),
    "required": ({"tool_choice": "required"}, None),
    "auto": ({"tool_choice": "auto"}, "hermes"),
}


@pytest.mark.parametrize("kind", CHOICES)
def test_tool_call_strings_refuse_raw_control_characters(compiler, kind) -> None:
    """JSON forbids unescaped control characters in strings, so strict json.loads rejects
    them: the grammar must never let one through, in any string a schema describes
    (xgrammar's own string rule for minLength / maxLength allows them)."""
    extra, fmt = CHOICES[kind]
    choice = tool_choice({"tools": [STRINGS, TIME], **extra}, fmt)

    def wrap(args: str) -> str:
        return {"named": args, "required": f'[{{"name": "note", "parameters": {args}}}]',
                "auto": CALL.format(name="note", args=args)}[kind]  # fmt: skip

    for field in ("plain", "short", "long", "code"):
        for bad in ("a\x07b", "a\nb", "\x1f\x00", "a\tb"):
            escaped = json.dumps({"short": "ab", "long": "abc", field: bad}, sort_keys=True)
            raw = escaped.replace(json.dumps(bad), f'"{bad}"')
            assert not accepts(compiler, choice, wrap(raw)), (field, bad)
            if field == "plain":  # escaped, it is fine (xgrammar's rules for the others
                assert accepts(compiler, choice, wrap(escaped))  # take no escapes at all)


@pytest.mark.parametrize("kind", CHOICES)
def test_tool_calls_always_parse_whatever_tokens_the_model_prefers(compiler, kind) -> None:
    """A model that prefers tokens with control characters can only ever produce calls
    whose arguments strict json.loads parses, naming a tool of the request: a walk
    through the grammar's masks that takes such a token whenever one is allowed (after
    40 tokens it closes what is open, so the walk ends)."""
    import random

    import numpy as np
    import torch

    tok = gx.Tokenizer.cl100k()
    v = tok.vocab_size
    odd = np.array([not tok.is_special(i) and any(b < 0x20 for b in tok.token_bytes(i))
                    for i in range(v)])  # fmt: skip
    closers = np.zeros(v, dtype=bool)
    closers[[tok.encode(s)[0] for s in ('"', "}", "]", '"}', "}]", "a")]] = True
    extra, fmt = CHOICES[kind]
    choice = tool_choice({"tools": [STRINGS, TIME], **extra}, fmt)
    compiled = compiler.compile(choice.grammar)
    mask = torch.zeros((1, (v + 31) // 32), dtype=torch.int32)
    for seed in range(3):
        rng = random.Random(seed)
        m, text = xgr.GrammarMatcher(compiled), ""
        if kind == "auto":  # open a call of the tool with the string fields
            text = '<tool_call>\n{"name": "note", "arguments": '
            assert m.accept_string(text)
        for step in range(400):
            if m.is_completed() or HERMES_CLOSE in text:
                break
            m.fill_next_token_bitmask(mask)
            allows = np.unpackbits(mask[0].numpy().view(np.uint8), bitorder="little")[:v] == 1
            for prefer in ((closers if step >= 40 else ~allows), odd, allows):
                allowed = np.flatnonzero(allows & prefer)
                if len(allowed):
                    break
            t = int(allowed[rng.randrange(min(len(allowed), 2048))])
            assert m.accept_token(t)
            text += tok.token_bytes(t).decode("utf-8", errors="replace")
        assert m.is_completed() or HERMES_CLOSE in text, (kind, seed, text)
        calls = choice.calls(text)
        assert len(calls) >= 1, text
        for c in calls:
            assert c["function"]["name"] in ("note", "get_time")
            json.loads(c["function"]["arguments"])


@pytest.mark.parametrize("kind", CHOICES)
def test_a_call_cut_by_max_tokens_is_text_with_finish_reason_length(kind) -> None:
    """As OpenAI answers output cut by max_tokens: finish_reason "length" and the text
    as it stands, never a tool call with an empty name or arguments that do not parse;
    with auto, the calls completed before the cut, the cut one left as content."""
    extra, fmt = CHOICES[kind]
    choice = tool_choice({"tools": [STRINGS, TIME], **extra}, fmt)
    shape = Shape(True, "chatcmpl-x", "m", False, False, choice)
    whole = CALL.format(name="get_time", args='{"zone": "UTC"}')
    cut = {"named": '{"long": "abc", "sh', "required": '[{"name": "note", "parameters": {"lo',
           "auto": f'Let me see. {whole}<tool_call>\n{{"name": "note", "argu'}[kind]  # fmt: skip
    c = Choice(0, seed=1)
    c.add(RequestOutput("r", 5, 0, 1, finished=True, finish_reason="length", text=cut), str)
    full = shape.full([c], 3)["choices"][0]
    events = [json.loads(x[6:])["choices"][0] for x in shape.tool_chunk(c).split("\n\n") if x]
    end = json.loads(shape.chunk(c, None, finish="length")[6:])["choices"][0]
    assert full["finish_reason"] == end["finish_reason"] == "length"
    streamed = "".join(e["delta"].get("content") or "" for e in events)
    calls = [t for e in events for t in e["delta"].get("tool_calls", [])]
    if kind != "auto":
        assert full["message"] == {"role": "assistant", "content": cut}
        assert streamed == cut and not calls
        return
    (call,) = full["message"]["tool_calls"]
    assert call["function"]["name"] == "get_time"
    assert json.loads(call["function"]["arguments"]) == {"zone": "UTC"}
    rest = 'Let me see. <tool_call>\n{"name": "note", "argu'
    assert full["message"]["content"] == rest == streamed
    assert [t["function"]["name"] for t in calls] == ["get_time"]


SHAPE = {"type": "json_schema", "json_schema": {"name": "answer", "schema": {
    "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}}}  # fmt: skip


@pytest.mark.parametrize("fmt", ["hermes", None])
def test_tools_with_response_format_shape_content_and_calls(compiler, fmt) -> None:
    """As OpenAI: response_format shapes the content, the tools the calls. "auto" answers
    either content of the format or calls (with no tool-call format: the content); "none"
    the content; "required" / a named function the calls (no content to shape). Never the
    400 that named a tool_choice the request did not give."""
    from graphexec.serve.request_fields import parse_request

    def parsed(**extra):
        body = {"messages": [], "tools": [WEATHER, TIME], "response_format": SHAPE, **extra}
        return parse_request(body, [[1, 2]], chat=True, max_seq_len=64, tool_format=fmt)

    ok, call = '{"ok": true}', CALL.format(name="get_time", args='{"zone": "UTC"}')
    auto = parsed()  # tools alone: "auto"
    g = _Grammar(auto.params.grammar)
    assert accepts(compiler, g, ok) and not accepts(compiler, g, "Plain text.")
    if fmt is None:  # no way to call: the content, in its format
        assert auto.tools is None and not accepts(compiler, g, call)
    else:
        assert accepts(compiler, g, call) and accepts(compiler, g, call + "\n" + call)
        assert not accepts(compiler, auto.tools, ok + call)  # one or the other
        assert auto.tools.calls(ok) == [] and auto.tools.content(ok) == ok
        assert [c["function"]["name"] for c in auto.tools.calls(call)] == ["get_time"]
    none = parsed(tool_choice="none")
    assert none.tools is None and none.fields["grammar"] == "response_format"
    assert accepts(compiler, _Grammar(none.params.grammar), ok)
    required = parsed(tool_choice="required")
    assert required.fields["grammar"] == "tools"
    calls = '[{"name": "get_time", "parameters": {"zone": "UTC"}}]'
    assert accepts(compiler, required.tools, calls)
    assert not accepts(compiler, required.tools, ok)


class _Grammar:
    """A bare grammar where `accepts` takes a choice."""

    def __init__(self, grammar) -> None:
        self.grammar = grammar
