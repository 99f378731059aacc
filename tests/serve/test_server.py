"""The OpenAI-compatible server end to end: a subprocess on a tiny random Llama checkpoint
(two engine processes behind two API servers), driven by the official openai client (sync
and async); seeded outputs must equal the library's own (`DecodeExecutor` on the same
checkpoint in this process), whichever engine ran them."""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import openai
import pytest
import torch

import graphexec as gx
from graphexec.models.demo_model import choose_model
from graphexec.serve.chat import ChatTemplate, read_tokenizer_config
from tests.serve.conftest import shared_server

MODEL = None  # the served model id: the checkpoint folder's name


@pytest.fixture(scope="module")
def server(checkpoint):
    # as deployed with two GPUs: two engine processes behind two API server processes, so
    # every test here also checks that a request's tokens do not depend on which took it
    s = shared_server(checkpoint, "--max-batch-size", "16", "--max-queue", "64",
                      "--data-parallel", "2", "--api-servers", "2")  # fmt: skip
    global MODEL
    MODEL = checkpoint.name
    return s


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def direct(checkpoint):
    """Run requests through the library directly: {prompt ids, params} -> (text, n tokens)."""
    dm = choose_model(str(checkpoint), torch.device("cpu"))
    ex = gx.DecodeExecutor(dm.make(), max_batch_size=64, device="cpu", tokenizer=dm.tokenizer)

    def run(reqs: list[tuple[list[int], gx.SamplingParams]]) -> list[tuple[str, int]]:
        texts = {f"r{i}": [] for i in range(len(reqs))}
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # tiny tensors: a second thread only fights the server
        for i, (prompt, p) in enumerate(reqs):
            ex.add_request(f"r{i}", prompt, p)
        try:
            while not ex.idle:
                for o in ex.step():
                    texts[o.request_id].append(o)
        finally:
            torch.set_num_threads(threads)
        return [("".join(o.text or "" for o in outs), sum(o.token_id is not None for o in outs))
                for outs in texts.values()]  # fmt: skip

    tpl, special = read_tokenizer_config(checkpoint)
    chat = ChatTemplate(tpl, special)
    run.encode = dm.encode
    run.chat = lambda msgs: dm.tokenizer.encode(chat.render(msgs), allowed_special="all")
    return run


def test_models_health_metrics(server, client) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    h = server.health()
    assert h["status"] == "ok" and h["max_batch_size"] == 16 and h["free_slots"] == 32
    assert [e["free_slots"] for e in h["engines"]] == [16, 16]
    text = httpx.get(f"{server.url}/metrics").text
    for name in ("requests_running", "requests_waiting", "generation_tokens_total",
                 "generation_tokens_per_second", "time_to_first_token_seconds_bucket",
                 "inter_token_latency_seconds_count", "graph_replays_total",
                 "spec_drafted_tokens_total", "spec_accepted_tokens_total"):  # fmt: skip
        assert f"graphexec_{name}" in text, name
    # each of the 2 API servers answers on the port (new connections spread over them),
    # says which it is, and probes its event loop's lag
    probes: dict[str, int] = {}  # API server index -> its lag probe's count, at most
    for _ in range(200):
        text = httpx.get(f"{server.url}/metrics").text
        (index,) = re.findall(r'graphexec_api_server\{index="(\d+)"\} 1', text)
        lag = re.search(r"graphexec_event_loop_lag_seconds_count (\d+)", text)
        assert lag is not None
        probes[index] = max(probes.get(index, 0), int(lag.group(1)))
        if len(probes) == 2 and min(probes.values()) > 0:
            break
        time.sleep(0.005)  # a server just started has not woken from its first tick yet
    assert set(probes) == {"0", "1"} and min(probes.values()) > 0, probes


def test_completions_equal_the_library(client, direct) -> None:
    r = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=12,
                                  seed=5, temperature=0.8, logprobs=3, n=2,
                                  extra_body={"top_k": 50, "min_p": 0.01,
                                              "repetition_penalty": 1.1})  # fmt: skip
    p = gx.SamplingParams(seed=5, temperature=0.8, top_k=50, logprobs=3, n=2, min_p=0.01,
                          repetition_penalty=1.1, max_tokens=12)  # fmt: skip
    want = direct([(direct.encode("The quick brown fox"), p.stream(i)) for i in range(2)])
    assert [(c.text, len(c.logprobs.tokens)) for c in r.choices] == want
    assert [c.seed for c in r.choices] == [gx.params.stream_seed(5, i) for i in range(2)]
    assert r.usage.completion_tokens == sum(n for _, n in want) and r.usage.prompt_tokens > 0
    lp = r.choices[0].logprobs
    assert len(lp.top_logprobs[0]) == 3 and lp.text_offset[0] == 0
    assert all(x <= 0 for x in lp.token_logprobs)
    # an unseeded request reports its seed, and replaying it gives the same text
    a = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=8)
    b = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=8,
                                  seed=a.choices[0].seed)  # fmt: skip
    # (its seed depends on the requests before it, so it may draw EOS within 8 tokens)
    assert (a.choices[0].text, a.choices[0].finish_reason) == (
        b.choices[0].text,
        b.choices[0].finish_reason,
    )


def test_stop_strings(client, direct) -> None:
    base = client.completions.create(model=MODEL, prompt="Hello", max_tokens=16, seed=1)
    text = base.choices[0].text
    stop = text[4:6]
    assert stop.strip()
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=16, seed=1, stop=[stop])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == text[: text.index(stop)]


def test_chat_streaming_and_not_equal_the_library(client, direct) -> None:
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    want = direct([(direct.chat(msgs), gx.SamplingParams(seed=9, max_tokens=10,
                                                         temperature=0.7))])[0]  # fmt: skip
    r = client.chat.completions.create(model=MODEL, messages=msgs, seed=9, max_tokens=10,
                                       temperature=0.7, logprobs=True, top_logprobs=2)  # fmt: skip
    c = r.choices[0]
    assert (c.message.content, r.usage.completion_tokens) == want
    assert c.message.role == "assistant" and len(c.logprobs.content) == want[1]
    assert len(c.logprobs.content[0].top_logprobs) == 2
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=msgs, seed=9, max_tokens=10, temperature=0.7, stream=True,
        stream_options={"include_usage": True}))  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
    assert text == want[0] and finish[-1] == "length" and finish.count("length") == 1
    assert chunks[-1].usage.completion_tokens == want[1] and not chunks[-1].choices


def test_grammars(client) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
              "age": {"type": "integer"}}, "required": ["name", "age"],
              "additionalProperties": False}  # fmt: skip
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "a person"}],
        seed=3,
        max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}},
    )
    c = r.choices[0]
    assert c.finish_reason == "stop", c
    assert set(json.loads(c.message.content)) == {"name", "age"}
    r = client.completions.create(model=MODEL, prompt="Date:", seed=2, max_tokens=20,
                                  extra_body={"guided_regex": r"20[0-9]{2}-0[1-9]"})  # fmt: skip
    assert re.fullmatch(r"20[0-9]{2}-0[1-9]", r.choices[0].text)


BAD = [  # (field, value) -> 400 naming it
    ("temperature", -1), ("top_p", 2), ("top_k", -5), ("top_k", 10**6), ("min_p", 2),
    ("seed", -1), ("max_tokens", 0), ("n", 0), ("n", 100), ("logprobs", 30),
    ("presence_penalty", 5), ("frequency_penalty", -5), ("repetition_penalty", 0),
    ("logit_bias", {"999999": 1}), ("logit_bias", {"x": 1}), ("min_tokens", 99),
    ("stop", 5), ("ignore_eos", "yes"), ("response_format", {"type": "xml"}),
    ("guided_regex", "("), ("guided_json", 5), ("prompt", [999999]), ("prompt", 5),
    ("echo", "yes"), ("suffix", "x"), ("prompt_logprobs", 50), ("stream", "yes"),
]  # fmt: skip


@pytest.mark.parametrize("field,value", BAD, ids=[f"{f}={v}" for f, v in BAD])
def test_bad_completion_parameters_are_400_naming_the_field(server, field, value) -> None:
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 4, field: value}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=10)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == field, err
    assert err["type"] == "invalid_request_error" and err["message"]


def test_bad_chat_requests(server, client) -> None:
    url = f"{server.url}/v1/chat/completions"
    msgs = [{"role": "user", "content": "hi"}]
    for body, param in [
        ({"messages": msgs, "top_logprobs": 30, "logprobs": True}, "top_logprobs"),
        ({"messages": msgs, "top_logprobs": 2}, "top_logprobs"),
        ({"messages": msgs, "logprobs": 3}, "logprobs"),
        ({"messages": msgs, "max_completion_tokens": 0}, "max_completion_tokens"),
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages"),  # raise_exception
        ({"messages": msgs, "response_format": {"type": "json_schema"}}, "response_format"),
    ]:
        r = httpx.post(url, json={"model": MODEL, **body}, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    r = httpx.post(url, content=b"{not json", timeout=10)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model=MODEL, messages=msgs, temperature=-2)
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="nope", messages=msgs)
    assert e.value.status_code == 404 and e.value.body["code"] == "model_not_found"


def test_64_concurrent_streams_lose_and_duplicate_nothing(server, direct) -> None:
    prompts = [f"Story number {i} begins" for i in range(64)]
    want = direct([(direct.encode(p), gx.SamplingParams(seed=100 + i, max_tokens=8 + i % 5,
                                                        ignore_eos=True))
                   for i, p in enumerate(prompts)])  # fmt: skip

    async def one(aclient, i):
        stream = await aclient.completions.create(
            model=MODEL,
            prompt=prompts[i],
            seed=100 + i,
            max_tokens=8 + i % 5,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        chunks = [c async for c in stream]
        toks = [c for c in chunks if c.choices and c.choices[0].finish_reason is None]
        assert len({c.id for c in chunks}) == 1
        return "".join(c.choices[0].text for c in toks), len(toks), chunks[-1].usage

    async def main():
        aclient = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        async with aclient:
            return await asyncio.gather(*(one(aclient, i) for i in range(64)))

    got = asyncio.run(main())
    for i, (text, ntok, usage) in enumerate(got):
        assert ntok == usage.completion_tokens == 8 + i % 5
        assert (text, ntok) == want[i], i
    # least-loaded routing: both engines took work (each reports its load when idle)
    server.wait_for(lambda h: h["free_slots"] == 32 and h["waiting"] == 0
                    and all(e["steps"] > 0 for e in h["engines"]))  # fmt: skip
