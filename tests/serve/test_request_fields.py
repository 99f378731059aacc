"""Request -> SamplingParams mapping and chat templates, without a server."""

from __future__ import annotations

import pytest

import graphexec as gx
from graphexec.serve.chat import ChatTemplate
from graphexec.serve.request_fields import APIError, param_of, parse_request


def parse(body, chat=False, prompts=((1, 2, 3),)):
    return parse_request(body, [list(p) for p in prompts], chat=chat, max_seq_len=100)


def test_fields_map_one_to_one() -> None:
    body = {"temperature": 0.5, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "seed": 7,
            "max_tokens": 9, "stop": "END", "n": 2, "logprobs": 3, "presence_penalty": 0.5,
            "frequency_penalty": -0.5, "repetition_penalty": 1.2, "logit_bias": {"5": -100},
            "min_tokens": 2, "ignore_eos": True, "stop_token_ids": [4],
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    r = parse(body)
    assert r.params == gx.SamplingParams(
        temperature=0.5, top_p=0.9, top_k=40, min_p=0.05, seed=7, max_tokens=9, stop=("END",),
        n=2, logprobs=3, presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.2,
        logit_bias={5: -100.0}, min_tokens=2, ignore_eos=True, stop_token_ids=(4,))  # fmt: skip
    assert r.stream and r.include_usage and r.logprobs
    # null fields are defaults; completions default to 16 tokens, chat to the context left
    assert parse({"temperature": None}).params == gx.SamplingParams()
    assert parse({}, chat=True).params.max_tokens == 97


def test_chat_logprobs_and_max_completion_tokens() -> None:
    r = parse({"logprobs": True, "top_logprobs": 4, "max_completion_tokens": 5,
               "max_tokens": 50}, chat=True)  # fmt: skip
    assert r.logprobs and r.params.logprobs == 4 and r.params.max_tokens == 5
    assert parse({"logprobs": True}, chat=True).params.logprobs == 0
    assert parse({"logprobs": False}, chat=True).params.logprobs is None


def test_grammars() -> None:
    schema = {"type": "object"}
    for body, want in [
        ({"response_format": {"type": "json_object"}}, gx.Grammar.json()),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": schema}}},
         gx.Grammar.json_schema(schema)),
        ({"guided_json": schema}, gx.Grammar.json_schema(schema)),
        ({"guided_regex": "[ab]+"}, gx.Grammar.regex("[ab]+")),
        ({"guided_grammar": 'root ::= "x"'}, gx.Grammar.ebnf('root ::= "x"')),
        ({"response_format": {"type": "text"}}, None),
    ]:  # fmt: skip
        assert parse(body).params.grammar == want, body


@pytest.mark.parametrize("body,param", [
    ({"temperature": "hot"}, "temperature"), ({"top_p": 0}, "top_p"), ({"seed": 2**64}, "seed"),
    ({"max_tokens": 1.5}, "max_tokens"), ({"logit_bias": {"1": "x"}}, "logit_bias"),
    ({"stop": [""]}, "stop"), ({"n": True}, "n"), ({"stream": 1}, "stream"),
    ({"guided_regex": 3}, "guided_regex"), ({"best_of": 3}, "best_of"),
    ({"guided_json": {}, "guided_regex": "a"}, "guided_regex"),
    ({"stream_options": []}, "stream_options"),
])  # fmt: skip
def test_bad_fields_name_themselves(body, param) -> None:
    with pytest.raises(APIError) as e:
        parse(body)
    assert e.value.status == 400 and e.value.param == param and e.value.body()["error"]["message"]


def test_executor_messages_map_back_to_request_fields() -> None:
    fields = parse({"logprobs": True, "top_logprobs": 2, "max_completion_tokens": 3},
                   chat=True).fields  # fmt: skip
    assert param_of("logprobs must be <= the vocabulary size", fields) == "top_logprobs"
    assert param_of("prompt_token_ids must be in [0, 9)", fields, "messages") == "messages"
    assert param_of("params.grammar needs a tokenizer", {"grammar": "guided_json"}) == "guided_json"
    assert param_of("max_tokens must be >= 1", fields) == "max_completion_tokens"


def test_chat_templates() -> None:
    msgs = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text",
                                                                        "text": "b"}]}]  # fmt: skip
    assert ChatTemplate().render(msgs) == "user: ab\nassistant:"
    tpl = ChatTemplate("{{ bos_token }}{% for m in messages %}{{ m.content | tojson }}"
                       "{% endfor %}{% if add_generation_prompt %}>{% endif %}",
                       {"bos_token": "<s>"})  # fmt: skip
    assert tpl.render(msgs) == '<s>"ab">'
    bad = ChatTemplate("{{ raise_exception('nope') }}")
    with pytest.raises(APIError, match="nope") as e:
        bad.render(msgs)
    assert e.value.param == "messages"
    sandboxed = ChatTemplate("{{ ''.__class__.__mro__ }}")
    with pytest.raises(Exception, match="unsafe|not safely|access"):  # the sandbox refuses
        sandboxed.render(msgs)


@pytest.mark.parametrize("message,says", [
    ({"role": "wizard", "content": "hi"}, "messages[1].role"),
    ({"role": "user"}, "messages[1].content"),
    ({"role": "user", "content": None}, "messages[1].content"),
    ({"role": "system"}, "messages[1].content"),
    ({"role": "tool"}, "messages[1].content"),
    ({"role": "assistant"}, "messages[1].content"),  # without tool_calls, content is due
])  # fmt: skip
def test_messages_need_openais_roles_and_a_content(message, says) -> None:
    """As OpenAI: roles system, developer, user, assistant, tool (and the old function);
    content is required but for an assistant message with tool_calls."""
    with pytest.raises(APIError) as e:
        ChatTemplate().render([{"role": "user", "content": "hi"}, message])
    assert e.value.status == 400 and e.value.param == "messages" and says in e.value.message
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    ok = [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"},
          {"role": "assistant", "tool_calls": calls}, {"role": "tool", "content": "{}",
                                                      "tool_call_id": "c1"}]  # fmt: skip
    assert ChatTemplate().render(ok).startswith("developer: be brief\n")


def test_the_context_error_reads_well() -> None:
    for chat, says in ((False, "the prompt is 100 tokens"), (True, "the messages are 100 tokens")):
        with pytest.raises(APIError) as e:
            parse({}, chat=chat, prompts=[range(100)])
        assert says in e.value.message, e.value.message
