"""tool_choice "auto" in the checkpoint's own format (`serve.tools`): the structural-tag
grammar lets free text through and holds every call to its tool's schema; the answer
splits the text into content and calls (streamed and not)."""

from __future__ import annotations

import json

import pytest
import xgrammar as xgr

import graphexec as gx
from graphexec.request import RequestOutput
from graphexec.serve.errors import APIError
from graphexec.serve.responses import Choice, Shape
from graphexec.serve.tools import tool_choice, tool_format
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


def test_the_format_comes_from_the_template_and_auto_needs_one() -> None:
    assert tool_format(QWEN_LIKE) == "hermes"
    assert tool_format("{{ messages }}") is None and tool_format(None) is None
    with pytest.raises(APIError) as e:
        tool_choice({"tools": [WEATHER], "tool_choice": "auto"}, None)
    assert e.value.param == "tool_choice"


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
