"""The load test's clients (bench_serve.py): a closed loop of streaming requests, timed.

A client sends a request, reads its stream to the end, and sends the next, until the
run's deadline. Every token's arrival time is kept (`time.monotonic`, one clock for every
process on the host), so the driver can cut the measured window afterwards. The HTTP
clients run in worker processes (`run_http_worker`), each an asyncio loop of its share of
the clients: one Python process cannot parse tens of thousands of SSE events a second,
and a client that falls behind would be measured as the server's slowness. The direct
clients (`run_direct`) drive an `AsyncDecodeExecutor` in the caller's process.

Every request sets `ignore_eos` and a seed, so it yields exactly `max_tokens` tokens: a
stream with fewer is counted as lost, with more as duplicated.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import time

from serve_http import Connection


@dataclasses.dataclass(frozen=True)
class Workload:
    """What each request looks like: `prompt_len` seeded random ids below `vocab`,
    `max_tokens` tokens at temperature 0.8, top_p 0.9, seed = the request's number."""

    prompt_len: int = 64
    max_tokens: int = 128
    vocab: int = 50_000

    def prompt(self, i: int) -> list[int]:
        r = random.Random(i)
        return [r.randrange(self.vocab) for _ in range(self.prompt_len)]

    def body(self, i: int, model: str) -> dict:
        """The /v1/completions body of request i (a token-id prompt: no tokenizer cost)."""
        return dict(model=model, prompt=self.prompt(i), max_tokens=self.max_tokens,
                    temperature=0.8, top_p=0.9, seed=i, ignore_eos=True, stream=True,
                    stream_options={"include_usage": True})  # fmt: skip


@dataclasses.dataclass
class Record:
    """One request as a client saw it: when it was sent, each token's arrival."""

    sent: float
    arrivals: list[float]
    expected: int
    usage: int | None = None  # usage.completion_tokens (HTTP only)
    error: str | None = None
    # HTTP only: the request written, the response's headers read (the server sends them
    # with its first token), and whether it opened a connection
    wrote: float | None = None
    headers: float | None = None
    connected: bool = False


async def _http_client(base_url: str, url: str, wl: Workload, model: str, first: int,
                       step: int, deadline: float, out: list[Record]) -> None:  # fmt: skip
    conn = Connection(base_url)
    i = first
    while time.monotonic() < deadline:
        rec = Record(time.monotonic(), [], wl.max_tokens)
        stamps: dict = {}
        try:
            body = json.dumps(wl.body(i, model)).encode()
            async for data in conn.post_events(url, body, stamps):
                if data == "[DONE]":
                    continue
                now = time.monotonic()
                chunk = json.loads(data)
                choices = chunk.get("choices")
                if choices and choices[0].get("finish_reason") is None:  # a token
                    rec.arrivals.append(now)
                if chunk.get("usage"):
                    rec.usage = chunk["usage"]["completion_tokens"]
        except Exception as e:  # a broken stream is a result, not a crash of the run
            rec.error = f"{type(e).__name__}: {e}"
        rec.wrote, rec.headers = stamps.get("wrote"), stamps.get("headers")
        rec.connected = stamps.get("connected", False)
        out.append(rec)
        i += step
    await conn.close()


def run_http_worker(args: tuple) -> dict:
    """A worker process: `clients` HTTP clients (numbers first, first + step, ...) against
    `base_url` until `deadline` (monotonic), one connection each (serve_http.py): {"records":
    the records as dicts, "lags": the loop's wake-up delays in seconds}."""
    base_url, model, wl, clients, first, step, deadline = args

    # a client loop that lags delays its own sends and reads, charged to the server
    from graphexec.serve.metrics import watch_loop_lag

    async def main() -> tuple[list[Record], list[float]]:
        out: list[Record] = []
        lags: list[float] = []
        await asyncio.gather(watch_loop_lag(lags.append, until=deadline), *(
            _http_client(base_url, "/v1/completions", wl, model, first + k * step,
                         step * clients, deadline, out)
            for k in range(clients)
        ))  # fmt: skip
        return out, lags

    recs, lags = asyncio.run(main())
    return {"records": [dataclasses.asdict(r) for r in recs], "lags": lags}


async def run_direct(aex, wl: Workload, clients: int, deadline: float,
                     first: int = 0) -> list[Record]:  # fmt: skip
    """`clients` closed-loop clients of `AsyncDecodeExecutor` `aex` until `deadline`."""
    import graphexec as gx

    out: list[Record] = []

    async def client(k: int) -> None:
        i = first + k
        while time.monotonic() < deadline:
            rec = Record(time.monotonic(), [], wl.max_tokens)
            p = gx.SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=wl.max_tokens,
                                  ignore_eos=True)  # fmt: skip
            try:
                async for o in aex.generate(f"d{i}", wl.prompt(i), p):
                    if o.token_id is not None:
                        rec.arrivals.append(time.monotonic())
            except Exception as e:
                rec.error = f"{type(e).__name__}: {e}"
            out.append(rec)
            i += clients

    await asyncio.gather(*(client(k) for k in range(clients)))
    return out
