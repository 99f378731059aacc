"""The server on CUDA: streams through the OpenAI client, every step replayed from a
captured graph, equal token for token to the same requests run on the executor directly
(all at once: another batch composition than the server's arrivals)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import pytest

import graphexec as gx
from graphexec.serve.responses import Choice

pytestmark = pytest.mark.gpu
openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


REQUESTS = [  # (prompt, completions fields, the same as SamplingParams fields)
    (f"Request {i} says", dict(seed=i, max_tokens=8 + i % 9, temperature=t, top_p=tp),
     dict(top_k=k, min_p=mp))
    for i, (t, tp, k, mp) in enumerate(
        [(0.0, 1.0, 0, 0.0), (0.8, 0.9, 50, 0.0), (1.0, 1.0, 0, 0.05), (0.7, 0.95, 20, 0.0)] * 6
    )
]  # fmt: skip


def test_server_streams_equal_the_executor_directly() -> None:
    tok = gx.Tokenizer.cl100k()
    model = gx.models.TinyLM(tok.vocab_size, seed=0, max_seq_len=256)
    ex = gx.DecodeExecutor(model, max_batch_size=16, device="cuda", tokenizer=tok, seed=0)
    ex.capture(progress=False)
    assert ex.stats.failed == {}
    from graphexec.serve.app import build_app

    port = _port()
    server = uvicorn.Server(uvicorn.Config(build_app(ex, model_name="tiny"), host="127.0.0.1",
                                           port=port, log_level="warning"))  # fmt: skip
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started

    async def one(client, prompt, fields, extra) -> tuple[str, int]:
        text, tokens = [], 0
        stream = await client.completions.create(model="tiny", prompt=prompt, stream=True,
                                                 extra_body=extra, **fields)  # fmt: skip
        async for chunk in stream:
            c = chunk.choices[0]
            text.append(c.text)
            tokens += c.finish_reason is None
        return "".join(text), tokens

    async def main() -> list[tuple[str, int]]:
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x")
        return await asyncio.gather(*(one(client, *r) for r in REQUESTS))

    try:
        served = asyncio.run(main())
    finally:
        server.should_exit = True
        thread.join(30)
    replays = sum(ex.stats.replays.values())
    assert replays > 0 and sum(ex.stats.eager_steps.values()) == 0

    got: dict[str, list] = {f"r{i}": [] for i in range(len(REQUESTS))}
    todo = list(enumerate(REQUESTS))[::-1]  # last first: other rows, other neighbours
    while todo or not ex.idle:
        while todo and ex.free_slots:
            i, (prompt, fields, extra) = todo.pop(0)
            ex.add_request(f"r{i}", tok.encode(prompt), gx.SamplingParams(**fields, **extra))
        for o in ex.step():
            got[o.request_id].append(o)
    # a token event per token the answer shows (not the EOS that ends a request)
    direct = [("".join(o.text or "" for o in outs), sum(Choice.shows(o) for o in outs))
              for outs in got.values()]  # fmt: skip
    assert served == direct
    assert all(0 < n <= f["max_tokens"] for (_, n), (_, f, _) in zip(direct, REQUESTS, strict=True))


@pytest.mark.multigpu
def test_data_parallel_engines_give_a_seeded_request_the_same_tokens() -> None:
    """`serve --data-parallel 2` on the Qwen2.5-0.5B shape (bf16, random weights): each
    seeded request is sent twice, the second time to the other engine (one API server
    routes each request to the engine with fewer live streams; each request is sent once
    the previous one streams), amid other batch compositions: the texts are equal."""
    import subprocess
    import sys

    import httpx
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    port = _port()
    cmd = [sys.executable, "-m", "graphexec", "serve", "--model", "qwen2.5-0.5b", "--port",
           str(port), "--dtype", "bfloat16", "--max-seq-len", "256", "--max-batch-size", "8",
           "--capture-keys", "default", "--data-parallel", "2", "--api-servers", "1",
           "--seed", "0", "--log-level", "warning"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    seeds = [0, 1, 2, 3, 4, 5, 1, 0, 3, 2, 5, 4]  # sends k and k + 6 alternate engines
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "serve did not start"
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)

        async def one(client, seed, started):
            body = dict(prompt=f"Request {seed} says", seed=seed, max_tokens=24 + 4 * seed,
                        temperature=0.9, top_p=0.9, stream=True, ignore_eos=True)  # fmt: skip
            text = []
            async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        started.set()
                        text.append(json.loads(line[6:])["choices"][0]["text"])
            return "".join(text)

        async def main():
            async with httpx.AsyncClient(timeout=120) as client:
                tasks = []
                for s in seeds:
                    started = asyncio.Event()
                    tasks.append(asyncio.create_task(one(client, s, started)))
                    await started.wait()
                return await asyncio.gather(*tasks)

        texts = asyncio.run(main())
        by_seed: dict[int, set[str]] = {}
        for s, t in zip(seeds, texts, strict=True):
            by_seed.setdefault(s, set()).add(t)
        assert all(len(v) == 1 for v in by_seed.values()), by_seed
        assert len({next(iter(v)) for v in by_seed.values()}) == 6  # seeds differ
        engines = httpx.get(f"{url}/health", timeout=5).json()["engines"]
        assert len(engines) == 2 and all(e["steps"] > 0 for e in engines), engines
    finally:
        proc.terminate()
        proc.wait(60)
