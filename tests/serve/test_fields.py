"""The fields and routes clients send beyond sampling: an API key, /tokenize and
/detokenize, the chat template's options, and what /metrics counts; with the openai
client where it has the call."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.serve.conftest import shared_server

KEY = "sk-test-0123"


def fields_server(checkpoint):
    """The app and its engine in one process (--api-servers 0): that path is served too;
    test_inputs.py's bodies go to the same server (one start for both modules)."""
    return shared_server(checkpoint, "--max-batch-size", "8", "--max-queue", "64", "--api-key",
                         KEY, "--api-servers", "0")  # fmt: skip


@pytest.fixture(scope="module")
def server(checkpoint):
    return fields_server(checkpoint)


def auth(key: str = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


JSON = {"content-type": "application/json", **auth()}


def test_the_api_key_guards_every_route_but_health_and_metrics(server, checkpoint) -> None:
    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.completions.create(model=checkpoint.name, prompt="hi", max_tokens=1)
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    for path in ("/v1/models", "/tokenize"):
        assert httpx.post(f"{server.url}{path}", json={"prompt": "x"}).status_code == 401
    good = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
    r = good.completions.create(model=checkpoint.name, prompt="hi", max_tokens=2, seed=1)
    assert r.choices[0].finish_reason in ("length", "stop")
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/metrics").status_code == 200


def test_tokenize_gives_the_ids_a_request_runs_and_detokenize_inverts_it(server) -> None:
    t = httpx.post(f"{server.url}/tokenize", json={"prompt": "Once upon a time"},
                   headers=auth()).json()  # fmt: skip
    assert t["count"] == len(t["tokens"]) > 3 and t["max_model_len"] == 2048
    d = httpx.post(f"{server.url}/detokenize", json={"tokens": t["tokens"]},
                   headers=auth()).json()  # fmt: skip
    assert d["prompt"].endswith("Once upon a time")
    # a completion's usage counts exactly the tokenized prompt
    r = httpx.post(f"{server.url}/v1/completions", headers=auth(), json={
        "prompt": "Once upon a time", "max_tokens": 1, "seed": 1}).json()  # fmt: skip
    assert r["usage"]["prompt_tokens"] == t["count"]
    msgs = [{"role": "user", "content": "hi"}]
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": msgs},
                      headers=auth()).json()  # fmt: skip
    r = httpx.post(f"{server.url}/v1/chat/completions", headers=auth(), json={
        "messages": msgs, "max_tokens": 1, "seed": 1}).json()  # fmt: skip
    assert r["usage"]["prompt_tokens"] == chat["count"]
    bad = httpx.post(f"{server.url}/detokenize", json={"tokens": [1, -4]}, headers=auth())
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_chat_template_options(server) -> None:
    def count(**extra) -> int:
        body = {"messages": [{"role": "user", "content": "hi"},
                             {"role": "assistant", "content": "Hello the"}], **extra}  # fmt: skip
        r = httpx.post(f"{server.url}/tokenize", json=body, headers=auth())
        assert r.status_code == 200, r.text
        return r.json()["tokens"]

    with_prompt, without = count(), count(add_generation_prompt=False)
    assert len(with_prompt) > len(without)  # "<assistant>" appended
    cont = count(add_generation_prompt=False, continue_final_message=True)
    # continued: the text ends with the last message's content (no eos after it)
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": cont},
                      headers=auth()).json()["prompt"]  # fmt: skip
    assert text.endswith("Hello the") and len(cont) < len(without)
    r = httpx.post(
        f"{server.url}/tokenize",
        headers=auth(),
        json={"messages": [{"role": "user", "content": "hi"}], "continue_final_message": True},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"
    r = httpx.post(
        f"{server.url}/tokenize",
        headers=auth(),
        json={"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": [1]},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"
    # template variables reach the template (bos_token cannot be overridden)
    same = count(chat_template_kwargs={"enable_thinking": False, "bos_token": "X"})
    assert same == with_prompt


def test_metrics_count_prompts_queue_latency_and_finish_reasons(server) -> None:
    before = httpx.get(f"{server.url}/metrics").text
    for max_tokens in (2, 3):
        httpx.post(f"{server.url}/v1/completions", headers=auth(), json={
            "prompt": "Once upon", "max_tokens": max_tokens, "seed": 1,
            "ignore_eos": True})  # fmt: skip
    m = httpx.get(f"{server.url}/metrics").text

    def value(text: str, name: str) -> float:
        line = [x for x in text.splitlines() if x.startswith(name + " ")]
        return float(line[0].split()[-1]) if line else 0.0

    assert value(m, "graphexec_prompt_tokens_total") > value(
        before, "graphexec_prompt_tokens_total"
    )
    assert (value(m, 'graphexec_request_finish_total{reason="length"}')
            >= value(before, 'graphexec_request_finish_total{reason="length"}') + 2)  # fmt: skip
    assert value(m, "graphexec_request_e2e_seconds_count") >= 2
    assert value(m, "graphexec_request_queue_seconds_count") >= 2


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the forecast",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
        "days": {"type": "integer", "enum": [1, 2, 3]}},
        "required": ["city", "days"], "additionalProperties": False}}}  # fmt: skip
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
    "required": ["zone"], "additionalProperties": False}}}  # fmt: skip


def valid_weather(args: dict) -> bool:
    return set(args) == {"city", "days"} and args["city"] in ("Paris", "Oslo", "Lima") \
        and args["days"] in (1, 2, 3)  # fmt: skip


def test_tool_calls_parse_against_their_schemas(server, checkpoint) -> None:
    """A named function and "required": the output is constrained in the step, so on
    this random model the arguments still parse and validate, streamed or not."""
    import json

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
    msgs = [{"role": "user", "content": "weather?"}]
    for seed in range(4):
        r = client.chat.completions.create(
            model=checkpoint.name, messages=msgs, tools=[WEATHER, TIME], seed=seed,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            max_tokens=60, temperature=1.0)  # fmt: skip
        (call,) = r.choices[0].message.tool_calls
        assert call.function.name == "get_weather" and r.choices[0].finish_reason == "tool_calls"
        assert valid_weather(json.loads(call.function.arguments)), call.function.arguments
        assert r.choices[0].message.content is None
        req = client.chat.completions.create(
            model=checkpoint.name, messages=msgs, tools=[WEATHER, TIME], seed=seed,
            tool_choice="required", parallel_tool_calls=False, max_tokens=120,
            temperature=1.0)  # fmt: skip
        assert req.choices[0].finish_reason == "tool_calls"
        for c in req.choices[0].message.tool_calls:
            args = json.loads(c.function.arguments)
            assert (c.function.name == "get_weather" and valid_weather(args)) or (
                c.function.name == "get_time" and args in ({"zone": "UTC"}, {"zone": "CET"})
            )
    # streamed: the same call as the non-streamed answer of the same seed, in one delta
    stream = client.chat.completions.create(
        model=checkpoint.name, messages=msgs, tools=[WEATHER], seed=3, stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=60, temperature=1.0)  # fmt: skip
    deltas = [ch.choices[0].delta for ch in stream if ch.choices]
    calls = [tc for d in deltas if d.tool_calls for tc in d.tool_calls]
    assert len(calls) == 1 and not any(d.content for d in deltas)
    once = client.chat.completions.create(
        model=checkpoint.name, messages=msgs, tools=[WEATHER], seed=3, max_tokens=60,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=1.0)  # fmt: skip
    assert calls[0].function.arguments == once.choices[0].message.tool_calls[0].function.arguments
    # cut by max_tokens: the text and "length", as OpenAI answers a cut; no broken call
    cut = client.chat.completions.create(
        model=checkpoint.name, messages=msgs, tools=[WEATHER, TIME], seed=0,
        tool_choice="required", max_tokens=4)  # fmt: skip
    assert cut.choices[0].finish_reason == "length" and not cut.choices[0].message.tool_calls
    assert cut.choices[0].message.content.startswith("[")


def test_bad_tool_requests_are_400s_naming_the_field(server) -> None:
    def err(**body) -> str | None:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **body}
        r = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=auth())
        assert r.status_code == 400, r.text
        return r.json()["error"]["param"]

    assert (
        err(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}})
        == "tool_choice"
    )
    assert err(tools=[{"type": "function"}], tool_choice="required") == "tools"
    assert err(tool_choice="required") == "tool_choice"
    r = httpx.post(f"{server.url}/v1/completions", headers=auth(), json={
        "prompt": "hi", "tools": [WEATHER], "tool_choice": "required"})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
    # tools alone mean "auto" (OpenAI's default), and a template with no tool-call format
    # answers both in plain text, the same text
    texts = []
    for choice in ({}, {"tool_choice": "auto"}):
        r = httpx.post(f"{server.url}/v1/chat/completions", headers=auth(), json={
            "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER],
            "max_tokens": 2, "seed": 1, **choice})  # fmt: skip
        assert r.status_code == 200, r.text
        texts.append(r.json()["choices"][0]["message"]["content"])
    assert texts[0] is not None and texts[0] == texts[1]


def test_echo_logprobs_equal_the_decoded_tokens_logprobs(server) -> None:
    """echo + logprobs with max_tokens 0 (how evaluation harnesses score a text): the
    prompt comes back with each token's logprob; each equals, bit for bit, the logprob
    the server reports when that token is decoded after the same prefix (forced by a
    +100 logit_bias, which raw logprobs do not see)."""
    url = f"{server.url}/v1/completions"
    prompt = "Once upon a time there"
    r = httpx.post(url, headers=auth(), json={"prompt": prompt, "echo": True, "logprobs": 2,
                                              "max_tokens": 0}).json()  # fmt: skip
    (c,) = r["choices"]
    assert c["text"] == prompt and r["usage"]["completion_tokens"] == 0
    lp = c["logprobs"]
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": prompt},
                     headers=auth()).json()["tokens"]  # fmt: skip
    assert len(lp["tokens"]) == len(ids) == r["usage"]["prompt_tokens"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(isinstance(x, float) for x in lp["token_logprobs"][1:])
    assert all(1 <= len(t) <= 2 for t in lp["top_logprobs"][1:])  # keyed by text: may merge
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][-1] < len(prompt)
    for k in range(1, len(ids)):
        d = httpx.post(url, headers=auth(), json={
            "prompt": ids[:k], "max_tokens": 1, "logprobs": 0, "temperature": 0,
            "logit_bias": {str(ids[k]): 100}}).json()["choices"][0]["logprobs"]  # fmt: skip
        assert d["token_logprobs"][0] == lp["token_logprobs"][k], k
    # with a completion: the prompt, then the completion, offsets running on
    r = httpx.post(url, headers=auth(), json={"prompt": prompt, "echo": True, "logprobs": 0,
                                              "max_tokens": 3, "seed": 2,
                                              "ignore_eos": True}).json()  # fmt: skip
    c = r["choices"][0]
    assert c["text"].startswith(prompt) and len(c["logprobs"]["tokens"]) == len(ids) + 3
    assert c["logprobs"]["text_offset"][len(ids)] == len(prompt)
    # streamed echo: the prompt is the first text
    with httpx.stream(
        "POST",
        url,
        headers=auth(),
        json={"prompt": prompt, "echo": True, "max_tokens": 2, "stream": True, "seed": 1},
    ) as s:
        texts = [json.loads(x[6:])["choices"][0]["text"] for x in s.iter_lines()
                 if x.startswith("data: {")]  # fmt: skip
    assert texts[0] == prompt


def test_prompt_logprobs_per_choice(server) -> None:
    r = httpx.post(f"{server.url}/v1/chat/completions", headers=auth(), json={
        "messages": [{"role": "user", "content": "hi there"}], "max_tokens": 1,
        "prompt_logprobs": 1, "seed": 1}).json()  # fmt: skip
    pl = r["choices"][0]["prompt_logprobs"]
    assert len(pl) == r["usage"]["prompt_tokens"] and pl[0] is None
    for entry in pl[1:]:
        assert 1 <= len(entry) <= 2
        assert all(set(v) == {"logprob", "rank", "decoded_token"} for v in entry.values())
