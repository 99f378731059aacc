"""The app in this process (`build_app` over a TableModel executor, driven through
httpx's ASGI transport): what it logs and answers without a server subprocess."""

from __future__ import annotations

import asyncio
import logging

import httpx
import pytest

import graphexec as gx
from graphexec.serve.app import build_app
from tests.serve.test_fields import WEATHER


@pytest.fixture(scope="module")
def executor():
    tok = gx.Tokenizer.cl100k()
    model = gx.models.TableModel(tok.vocab_size, seed=0)
    return gx.DecodeExecutor(model, max_batch_size=4, device="cpu", tokenizer=tok, seed=0)


def post_all(app, bodies: list[dict], path: str = "/v1/chat/completions") -> list:
    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as c:
            return [await c.post(path, json=b, timeout=60) for b in bodies]

    return asyncio.run(main())


def test_tools_the_template_does_not_show_are_logged_once(executor, caplog) -> None:
    """The plain template (as SmolLM2's) never shows the tools to the model, and has no
    tool-call format: the answer is text, and the log says why, once."""
    app = build_app(executor, model_name="m")
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER],
            "max_tokens": 2, "seed": 1}  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="graphexec.serve"):
        rs = post_all(app, [body, {**body, "tool_choice": "auto"}, body])
    assert [r.status_code for r in rs] == [200, 200, 200], rs[1].text
    texts = [r.json()["choices"][0]["message"]["content"] for r in rs]
    assert texts[0] == texts[1] == texts[2]  # tools alone == explicit auto
    notes = [r.getMessage() for r in caplog.records]
    assert sum("does not show the tools" in n for n in notes) == 1, notes
    assert sum("no tool-call format" in n for n in notes) == 1, notes


def test_a_text_too_long_in_bytes_for_the_context_is_refused_untokenized(monkeypatch) -> None:
    """No token stands for more than max_token_bytes bytes, so a text of more than twice
    max_seq_len x that has more tokens than the context: a 400 naming the field, before
    the tokenizer spends seconds on it."""
    from graphexec.serve.errors import APIError
    from graphexec.serve.prompts import PromptReader, ServedModel

    tok = gx.Tokenizer.cl100k()
    model = ServedModel("m", tok, 64)
    reader = PromptReader(model)
    limit = 2 * 64 * model.max_token_bytes
    assert len(reader.prompts({"prompt": "a" * limit}, chat=False)[0]) > 64  # tokenized
    monkeypatch.setattr(tok, "encode", lambda *a, **k: pytest.fail("tokenized"))
    for body, chat, field in (({"prompt": ["a" * (limit + 1), "hi"]}, False, "prompt"),
                              ({"messages": [{"role": "user", "content": "a" * limit}]},
                               True, "messages")):  # fmt: skip
        with pytest.raises(APIError) as e:
            reader.prompts(body, chat)
        assert e.value.status == 400 and e.value.param == field
        assert "maximum context length is 64 tokens" in e.value.message


def test_small_bodies_are_read_on_the_loop_and_large_ones_in_a_thread(
    executor, monkeypatch
) -> None:
    """A thread's result waits for the GIL behind a busy event loop (milliseconds to
    seconds), so a request body up to INLINE_BODY_BYTES is parsed and tokenized on the
    loop; a larger one (a long text to tokenize) in a thread. Both give the same answer."""
    from graphexec.serve import app as app_module

    threaded = []
    real = asyncio.to_thread

    async def counting(fn, *args):
        if fn.__qualname__.startswith(("Server.", "PromptReader.")):  # not the engine's
            threaded.append(fn.__qualname__)
        return await real(fn, *args)

    monkeypatch.setattr(app_module.asyncio, "to_thread", counting)
    app = build_app(executor, model_name="m")
    small = {"prompt": "Once upon a time", "max_tokens": 3, "seed": 5}
    raw = httpx.Request("POST", "http://app", json=small).content
    big = raw[:-1] + b" " * app_module.INLINE_BODY_BYTES + b"}"  # the same request, padded
    json_type = {"content-type": "application/json"}

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as c:
            a = await c.post("/v1/completions", content=raw, headers=json_type, timeout=60)
            seen = list(threaded)
            b = await c.post("/v1/completions", content=big, headers=json_type, timeout=60)
            return a, seen, b

    r_small, seen, r_big = asyncio.run(main())
    assert r_small.status_code == 200 and seen == []
    assert r_big.status_code == 200 and threaded == ["Server._read"]
    assert r_big.json()["choices"][0]["text"] == r_small.json()["choices"][0]["text"]
