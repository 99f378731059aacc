"""Every request body gets an OpenAI answer or an OpenAI error object, never a 500: bad
Unicode, contexts overrun, out-of-range logit_bias, broken schemas (without C++ paths),
the seed each choice reports, and random bodies thrown at both endpoints (hypothesis)."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.serve.test_fields import JSON, auth, fields_server

CONTEXT = 2048  # the served checkpoint's max_seq_len: its own (max_position_embeddings)


@pytest.fixture(scope="module")
def server(checkpoint):
    # the app and its engine in one process: these bodies are the HTTP side's to answer
    # (test_fields.py's server: one start serves both modules; every request has its key)
    return fields_server(checkpoint)


def post(server, path: str, body, raw: bool = False) -> httpx.Response:
    content = body if raw else json.dumps(body)
    return httpx.post(f"{server.url}/v1/{path}", content=content, timeout=60, headers=JSON)


def assert_error(r: httpx.Response, status: int, param: str | None) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, err
    return err["message"]


@pytest.mark.parametrize("depth", [65, 990, 100_000])
def test_deeply_nested_bodies_are_a_400_not_a_500(server, depth) -> None:
    """Arrays nested past 64 levels, past Python's recursion limit, past the JSON
    decoder's: a 400 error object on every route that reads a body, and the server stays
    healthy."""
    nested = "[" * depth + "1" + "]" * depth
    for path, field in (("completions", "prompt"), ("chat/completions", "messages")):
        r = post(server, path, f'{{"{field}": {nested}, "max_tokens": 1}}', raw=True)
        assert "nests more than 64" in assert_error(r, 400, None)
    r = httpx.post(f"{server.url}/tokenize", content=f'{{"prompt": {nested}}}', timeout=60,
                   headers=JSON)  # fmt: skip
    assert "nests more than 64" in assert_error(r, 400, None)
    ok = "[" * 3 + "1" + "]" * 3  # shallow nesting is still judged by the fields
    assert "nests" not in assert_error(post(server, "completions", f'{{"prompt": {ok}}}',
                                            raw=True), 400, "prompt")  # fmt: skip
    assert server.health()["status"] == "ok"


def test_unknown_routes_and_wrong_methods_answer_error_objects(server) -> None:
    r = httpx.get(f"{server.url}/v1/nothing-here", timeout=60, headers=auth())
    assert "Invalid URL (GET /v1/nothing-here)" in assert_error(r, 404, None)
    r = httpx.get(f"{server.url}/v1/completions", timeout=60, headers=auth())
    assert "Method not allowed" in assert_error(r, 405, None)
    assert "POST" in r.headers["allow"]


def test_lone_surrogates_are_a_400_naming_the_field(server) -> None:
    chat = '{"messages": [{"role": "user", "content": "\\ud800 hi"}], "max_tokens": 2}'
    msg = assert_error(post(server, "chat/completions", chat, raw=True), 400, "messages")
    assert "messages[0].content" in msg and "surrogate" in msg
    comp = '{"prompt": "a \\udfff", "max_tokens": 2}'
    assert_error(post(server, "completions", comp, raw=True), 400, "prompt")
    stop = '{"prompt": "hi", "max_tokens": 2, "stop": ["\\ud83d"]}'
    assert_error(post(server, "completions", stop, raw=True), 400, "stop")
    # a surrogate pair is one valid character; NUL and RTL marks are text like any other
    ok = post(server, "completions", '{"prompt": "\\ud83d\\ude00 \\u0000 \\u202e x", '
              '"max_tokens": 2, "seed": 1}', raw=True)  # fmt: skip
    assert ok.status_code == 200, ok.text


def test_the_context_is_never_silently_overrun(server) -> None:
    prompt = [5 + i % 300 for i in range(CONTEXT - 48)]  # token ids (the vocabulary: 392)
    msg = assert_error(post(server, "completions", {"prompt": prompt, "max_tokens": 78}),
                       400, "max_tokens")  # fmt: skip
    assert str(CONTEXT) in msg and str(CONTEXT + 30) in msg
    assert_error(post(server, "completions", {"prompt": "hi", "max_tokens": 5000}), 400,
                 "max_tokens")  # fmt: skip
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 5000}
    assert_error(post(server, "chat/completions", chat), 400, "max_completion_tokens")
    full = [5 + i % 300 for i in range(CONTEXT)]
    assert_error(post(server, "completions", {"prompt": full, "max_tokens": 1}), 400, "prompt")
    r = post(server, "completions", {"prompt": prompt, "max_tokens": 24, "seed": 3,
                                     "ignore_eos": True})  # fmt: skip
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 24


def test_logit_bias_is_openais_range(server) -> None:
    for bias in (200, -100.5, "5", True):
        assert_error(post(server, "completions", {"prompt": "hi", "max_tokens": 1,
                                                  "logit_bias": {"7": bias}}), 400,
                     "logit_bias")  # fmt: skip
    for bias in (100, -100, 0.5):
        r = post(server, "completions", {"prompt": "hi", "max_tokens": 1, "seed": 1,
                                         "logit_bias": {"7": bias}})  # fmt: skip
        assert r.status_code == 200, r.text


def test_a_bad_schema_says_what_is_wrong_without_cpp_paths(server) -> None:
    for schema in ({"type": "no-such-type"}, {"type": "object", "properties": 5},
                   {"$ref": "#/definitions/missing"}):  # fmt: skip
        rf = {"type": "json_schema", "json_schema": {"schema": schema}}
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                "response_format": rf}  # fmt: skip
        r = post(server, "chat/completions", body)
        assert r.status_code == 400, r.text
        msg = r.json()["error"]["message"]
        assert ".cc:" not in msg and ".h:" not in msg and "/project" not in msg, msg
        assert len(msg) > len("response_format: "), msg


def test_each_choice_reports_the_seed_that_replays_it(server) -> None:
    base = {"prompt": "Once upon", "max_tokens": 6, "temperature": 1.0, "ignore_eos": True}
    r = post(server, "completions", {**base, "n": 3, "seed": 11}).json()
    seeds = [c["seed"] for c in r["choices"]]
    assert seeds[0] == 11 and len(set(seeds)) == 3
    for c in r["choices"]:
        alone = post(server, "completions", {**base, "seed": c["seed"]}).json()
        assert alone["choices"][0]["text"] == c["text"] and alone["choices"][0]["seed"] == c["seed"]
    # unseeded: the server draws a seed, and it replays the answer too
    r = post(server, "completions", {**base}).json()
    again = post(server, "completions", {**base, "seed": r["choices"][0]["seed"]}).json()
    assert again["choices"][0]["text"] == r["choices"][0]["text"]
    # a chat stream's first chunk (the role) carries the seed already
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=60, headers=auth(),
                      json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True,
        "seed": 9, "n": 2}) as s:  # fmt: skip
        chunks = [json.loads(line[6:]) for line in s.iter_lines()
                  if line.startswith("data: {")]  # fmt: skip
    assert all(c["choices"][0]["seed"] is not None for c in chunks)
    assert {c["choices"][0]["seed"] for c in chunks if c["choices"][0]["index"] == 0} == {9}


# ------------------------------------------------------------------ random bodies

TEXT = st.text(st.characters(codec=None, exclude_categories=()), max_size=12)
SCALAR = st.one_of(st.none(), st.booleans(), st.integers(-3, 40), st.floats(-3, 3), TEXT)
VALUE = st.recursive(SCALAR, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                     st.dictionaries(TEXT, inner, max_size=3)),
                     max_leaves=6)  # fmt: skip
FIELDS = ["prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
          "top_k", "min_p", "seed", "n", "stop", "logit_bias", "logprobs", "top_logprobs",
          "stream", "stream_options", "response_format", "guided_regex", "guided_json",
          "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens",
          "ignore_eos", "model", "echo", "tools", "tool_choice", "user", "stop_token_ids",
          "bad_words", "allowed_token_ids", "skip_special_tokens"]  # fmt: skip
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", 3]),
                                 "content": st.one_of(TEXT, VALUE)})  # fmt: skip
BODY = st.dictionaries(st.sampled_from(FIELDS), VALUE, max_size=6).flatmap(
    lambda d: st.fixed_dictionaries({**{k: st.just(v) for k, v in d.items()},
                                     "messages": st.lists(MESSAGE, max_size=2),
                                     "prompt": st.one_of(TEXT, st.lists(st.integers(-2, 400),
                                                                        max_size=5)),
                                     "max_tokens": st.integers(-1, 4)}))  # fmt: skip


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture,
                                 HealthCheck.too_slow])  # fmt: skip
@given(body=BODY, chat=st.booleans(), raw=st.sampled_from([None, "[1]", "{", '"x"', "null"]))
def test_random_bodies_get_an_answer_or_an_error_object_never_a_500(server, body, chat,
                                                                    raw) -> None:  # fmt: skip
    path = "chat/completions" if chat else "completions"
    try:
        content = raw if raw is not None else json.dumps(body)
    except (TypeError, ValueError):
        return
    r = httpx.post(f"{server.url}/v1/{path}", content=content.encode("utf-8", "surrogatepass"),
                   headers=JSON, timeout=60)  # fmt: skip
    assert r.status_code in (200, 400, 404, 503), (r.status_code, r.text, body)
    if r.status_code != 200:
        err = r.json()["error"]
        assert isinstance(err["message"], str) and err["type"]
    elif r.headers["content-type"].startswith("text/event-stream"):
        assert r.text.rstrip().endswith("data: [DONE]"), r.text
    else:
        assert r.json()["choices"], r.text
    assert server.health()["status"] == "ok"
