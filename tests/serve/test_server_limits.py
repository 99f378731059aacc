"""The server at its limits: one slot and one waiting place. Requests wait in arrival
order, the next one gets 503 + Retry-After, and a client that disconnects (streaming or
not, running or waiting) aborts its request and frees its place."""

from __future__ import annotations

import asyncio
import json
import os

import httpx
import openai
import pytest

from tests.serve.conftest import shared_server

LONG = {"prompt": "Once upon a time", "max_tokens": 1000, "seed": 1, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(checkpoint):
    # at info: its start-up log is checked here too (a server of its own cost ~10 s)
    return shared_server(checkpoint, "--max-batch-size", "1", "--max-queue", "1",
                         "--log-level", "info")  # fmt: skip


def test_serve_logs_one_thread_count_and_its_context(server) -> None:
    """What `serve` says as it starts (an API server and an engine process): one thread
    count, the engine's, and the context it serves with and why."""
    server.log.flush()
    fd = server.log.fileno()
    log = os.pread(fd, os.fstat(fd).st_size, 0).decode()  # the server's offset stays put
    assert log.count("torch intra-op threads") == 1, log
    assert log.count("max_seq_len 2048, the model's own") == 1, log


def test_queue_full_is_503_and_disconnects_free_the_slot(server, checkpoint) -> None:
    url = f"{server.url}/v1/completions"

    async def until(http, pred, timeout=10.0):
        for _ in range(int(timeout / 0.05)):
            h = (await http.get(f"{server.url}/health")).json()
            if pred(h):
                return h
            await asyncio.sleep(0.05)
        raise AssertionError(h)

    async def stream(http, body, started: asyncio.Event | None = None) -> str:
        async with http.stream("POST", url, json={**body, "stream": True}) as r:
            assert r.status_code == 200
            out = []
            async for line in r.aiter_lines():
                out.append(line)
                if started is not None:
                    started.set()
            return "\n".join(out)

    async def main():
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        async with httpx.AsyncClient(timeout=30) as http, client:
            started = asyncio.Event()
            first = asyncio.create_task(stream(http, LONG, started))  # takes the only slot
            await started.wait()
            await until(http, lambda h: h["running"] == 1 and h["free_slots"] == 0)
            # a waiting client that leaves: its place in the queue is freed
            waiter = asyncio.create_task(http.post(url, json={**LONG, "max_tokens": 3}))
            await until(http, lambda h: h["waiting"] == 1)
            waiter.cancel()
            await until(http, lambda h: h["waiting"] == 0 and h["running"] == 1)
            # one waits; the next is refused with 503 and Retry-After
            second = asyncio.create_task(stream(http, {**LONG, "max_tokens": 3, "seed": 4}))
            await until(http, lambda h: h["waiting"] == 1)
            with pytest.raises(openai.APIStatusError) as e:
                await client.completions.create(model=checkpoint.name, prompt="x", max_tokens=2)
            assert e.value.status_code == 503 and e.value.body["code"] == "queue_full"
            assert e.value.response.headers["retry-after"] == "1"
            # the streaming client leaves: its request is aborted, the waiter runs
            first.cancel()
            body = await asyncio.wait_for(second, 30)
            events = [json.loads(x[6:]) for x in body.split("\n") if x.startswith("data: {")]
            assert body.rstrip().endswith("data: [DONE]")
            assert events[-1]["choices"][0]["finish_reason"] == "length"
            await until(http, lambda h: h["free_slots"] == 1 and h["running"] == 0)
            # a running non-streaming request whose client leaves frees the slot too
            with pytest.raises(httpx.ReadTimeout):
                await http.post(url, json=LONG, timeout=1.0)
            await until(http, lambda h: h["free_slots"] == 1 and h["running"] == 0)
            return (await http.get(f"{server.url}/metrics")).text

    m = asyncio.run(main())
    assert "graphexec_requests_rejected_total 1\n" in m
    assert "graphexec_requests_aborted_total 3\n" in m, m


def test_bodies_past_the_cap_are_413_and_health_answers_while_the_largest_are_read(
    server,
) -> None:
    """The default cap (4 MiB): past it a 413 error object, by Content-Length or while
    a chunked body streams in. Bodies just under it, of prompts that each must be
    tokenized (seconds of work), are handled off the event loop: /health answers within
    a second all along, and each gets its 400 (prompts past the context)."""
    import time

    from graphexec.serve.prompts import MAX_BODY_BYTES

    url = f"{server.url}/v1/completions"
    over = b'{"prompt": "' + b"x" * MAX_BODY_BYTES + b'"}'
    r = httpx.post(url, content=over, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text

    def chunks():
        for _ in range(MAX_BODY_BYTES // 65536 + 2):
            yield b" " * 65536

    r = httpx.post(url, content=chunks(), timeout=60)  # no Content-Length: chunked
    assert r.status_code == 413 and "--max-body-bytes" in r.json()["error"]["message"]

    words = ("Once", "upon", "a", "time", "there", "was", "ünïcode", "42", "cat")
    piece = " ".join(words[(i * 7) % len(words)] for i in range(6000))  # ~30 kB of text
    n = (MAX_BODY_BYTES - 1000) // (len(json.dumps(piece, ensure_ascii=False).encode()) + 2)
    big = json.dumps({"prompt": [piece] * n, "max_tokens": 1}, ensure_ascii=False).encode()
    assert 0.99 * MAX_BODY_BYTES < len(big) <= MAX_BODY_BYTES

    async def main() -> tuple[list[httpx.Response], list[float], float]:
        async with httpx.AsyncClient(timeout=120) as http:
            t0 = time.monotonic()
            posts = [asyncio.create_task(http.post(url, content=big, headers={
                "content-type": "application/json"})) for _ in range(2)]  # fmt: skip
            waits = []
            while not all(p.done() for p in posts):
                a = time.monotonic()
                assert (await http.get(f"{server.url}/health")).status_code == 200
                waits.append(time.monotonic() - a)
                await asyncio.sleep(0.1)
            return [await p for p in posts], waits, time.monotonic() - t0

    answers, waits, took = asyncio.run(main())
    for r in answers:
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text[:300]
    assert took > 1.0 and max(waits) < 1.0, (took, max(waits), len(waits))
