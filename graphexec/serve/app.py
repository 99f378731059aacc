"""The Starlette app: OpenAI's /v1/completions and /v1/chat/completions (SSE streaming or
not), /v1/models, /health and /metrics, over one `AsyncDecodeExecutor` whose stepping
loop the app owns (started on the first request, closed at shutdown).

A request becomes one `generate` per prompt (its n streams inside); the first output is
awaited before answering, so admission errors (400) and a full queue (503) come back as
OpenAI error objects. A client that disconnects, streaming or not, aborts its request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
import uuid
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from graphexec.engine.async_executor import QueueFullError
from graphexec.engine.inbox import ExecutorFullError
from graphexec.params import MAX_SEED
from graphexec.serve.auth import ApiKey
from graphexec.serve.engines import Engine, LocalEngine
from graphexec.serve.errors import APIError, http_error, internal_error
from graphexec.serve.metrics import ServerMetrics, watch_loop_lag
from graphexec.serve.outputs import Disconnected, Outputs, or_disconnect
from graphexec.serve.prompts import MAX_BODY_BYTES, PromptReader, ServedModel, read_body
from graphexec.serve.request_fields import Parsed, param_of, parse_request
from graphexec.serve.responses import DONE, Choice, Shape
from graphexec.serve.tools import tool_format, tool_notes

log = logging.getLogger(__name__)
RETRY_AFTER_S = 1  # the 503's Retry-After: a slot frees within a few steps
# Bodies up to this size are parsed and tokenized on the event loop; larger ones in a
# thread. A thread's result waits for the GIL behind a busy loop: with the loop kept busy
# in 200 us slices, a 40 us parse took 3 ms at the median and seconds at p99 in a thread.
INLINE_BODY_BYTES = 16 * 1024


async def _off_loop_if_large(raw: bytes, fn, *args):
    """fn(raw, *args), in a worker thread when raw is larger than INLINE_BODY_BYTES."""
    if len(raw) <= INLINE_BODY_BYTES:
        return fn(raw, *args)
    return await asyncio.to_thread(fn, raw, *args)


class Server:
    """The routes' state: the engine(s), the model, the counters."""

    def __init__(self, engine: Engine, model: ServedModel, metrics: ServerMetrics,
                 max_body_bytes: int = MAX_BODY_BYTES) -> None:  # fmt: skip
        self.engine, self.model, self.metrics = engine, model, metrics
        self.reader, self.max_body_bytes = PromptReader(model), max_body_bytes
        self._noted: set[str] = set()  # warnings logged once

    def token_text(self, token_id: int) -> str:
        """A token as logprobs show it (its bytes, invalid UTF-8 replaced)."""
        return self.model.tokenizer.token_bytes(token_id).decode("utf-8", errors="replace")

    # ---- small routes ----------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        st = self.engine.stats()
        per = [{"running": e.running, "waiting": e.waiting, "free_slots": e.free_slots,
                "steps": e.steps} for e in self.engine.engine_stats()]  # fmt: skip
        return JSONResponse({"status": "ok", "model": self.model.name, "running": st.running,
                             "waiting": st.waiting, "free_slots": st.free_slots,
                             "max_batch_size": self.engine.max_batch_size,
                             "engines": per})  # fmt: skip

    async def models(self, request: Request) -> Response:
        m = {"id": self.model.name, "object": "model", "created": 0, "owned_by": "graphexec",
             "max_model_len": self.model.max_seq_len}  # fmt: skip
        return JSONResponse({"object": "list", "data": [m]})

    async def prometheus(self, request: Request) -> Response:
        text = self.metrics.render(self.engine.stats())
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    # ---- generation ------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def _generate(self, request: Request, chat: bool) -> Response:
        t0 = time.monotonic()
        try:  # a large body's JSON and tokens in a thread: the event loop keeps answering
            raw = await read_body(request, self.max_body_bytes)
            parsed, echoes = await _off_loop_if_large(raw, self._read, chat)
        except APIError as e:
            return e.response()
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        shape = Shape(chat, rid, self.model.name, parsed.logprobs, parsed.include_usage,
                      parsed.tools, echoes, parsed.echo_only, parsed.prompt_logprobs is not None,
                      self.token_text)  # fmt: skip
        if parsed.params.seed is None:  # drawn here, so every choice knows its seed at once
            parsed.params = parsed.params.with_seed(secrets.randbelow(MAX_SEED + 1))
        n = parsed.params.n
        seeds = [parsed.params.seed] if n == 1 else [parsed.params.stream(i).seed
                                                     for i in range(n)]  # fmt: skip
        choices = [Choice(k * n + i, seed=seeds[i], prompt=k)
                   for k in range(len(parsed.prompts)) for i in range(n)]  # fmt: skip
        index = {}
        gens = []
        for k, prompt in enumerate(parsed.prompts):
            sub = f"{rid}-{k}"
            ids = [sub] if n == 1 else [f"{sub}/{i}" for i in range(n)]
            index.update({s: k * n + i for i, s in enumerate(ids)})
            gens.append(self.engine.generate(sub, prompt, parsed.params))
        outs = Outputs(gens)
        try:
            first = await or_disconnect(request, outs.__anext__())
        except Disconnected:
            outs.close()
            self.metrics.aborted += 1
            return Response(status_code=499)
        except APIError as e:
            outs.close()
            return e.response()
        except (ValueError, ExecutorFullError) as e:
            outs.close()
            return self._admission_error(e, parsed, chat).response()
        self.metrics.requests += 1
        self.metrics.ttft.observe(time.monotonic() - t0)
        prompt_tokens = sum(len(p) for p in parsed.prompts)
        self.metrics.prompt_tokens += prompt_tokens
        run = _Run(self, shape, choices, index, outs, prompt_tokens, t0)
        if parsed.stream:
            return StreamingResponse(run.events(first), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})  # fmt: skip
        try:
            return JSONResponse(await or_disconnect(request, run.collect(first)))
        except Disconnected:
            self.metrics.aborted += 1
            return Response(status_code=499)
        finally:
            outs.close()

    def _read(self, raw: bytes, chat: bool) -> tuple[Parsed, list | None]:
        """(the request checked, its prompts tokenized; completions' echoes)."""
        body = self.reader.body(raw)
        fmt = tool_format(self.model.chat.source)
        parsed = parse_request(body, self.reader.prompts(body, chat), chat=chat,
                               max_seq_len=self.model.max_seq_len, tool_format=fmt)  # fmt: skip
        if chat:
            self._note(tool_notes(body, fmt, self.model.chat.shows_tools))
        return parsed, self.reader.echoes(body, parsed.prompts) if parsed.echo else None

    def _note(self, notes: list[str]) -> None:
        for n in notes:
            if n not in self._noted:
                self._noted.add(n)
                log.warning("%s (model %s; said once)", n, self.model.name)

    def _admission_error(self, e: Exception, parsed: Parsed, chat: bool) -> APIError:
        if isinstance(e, QueueFullError) or (
            isinstance(e, ExecutorFullError) and parsed.params.n <= self.engine.max_batch_size
        ):
            self.metrics.rejected += 1
            return APIError(503, f"the server is busy: {e}", None, "server_busy",
                            "queue_full", {"Retry-After": str(RETRY_AFTER_S)})  # fmt: skip
        if isinstance(e, ExecutorFullError):
            return APIError(400, str(e), "n")
        prompt_field = "messages" if chat else "prompt"
        return APIError(400, str(e), param_of(str(e), parsed.fields, prompt_field))

    async def _body(self, request: Request) -> dict[str, Any]:
        raw = await read_body(request, self.max_body_bytes)
        return await _off_loop_if_large(raw, self.reader.body)

    # ---- tokenizer routes (vLLM's /tokenize and /detokenize) --------------------------
    async def tokenize(self, request: Request) -> Response:
        """{"prompt": str} or {"messages": [...], chat fields}, add_special_tokens ->
        {"tokens", "count", "max_model_len"}: the ids a generation request would run."""
        try:
            raw = await read_body(request, self.max_body_bytes)
            out = await _off_loop_if_large(raw, lambda r: self.reader.tokenize(self.reader.body(r)))
        except APIError as e:
            return e.response()
        return JSONResponse(out)

    async def detokenize(self, request: Request) -> Response:
        """{"tokens": [ids]} -> {"prompt": their text}."""
        try:
            body = await self._body(request)
            ids = body.get("tokens")
            vocab = self.engine.vocab_size
            if not isinstance(ids, list) or not all(type(t) is int and 0 <= t < vocab for t in ids):
                raise APIError(400, f"tokens must be a list of token ids in [0, {vocab})",
                               "tokens")  # fmt: skip
        except APIError as e:
            return e.response()
        return JSONResponse({"prompt": self.model.tokenizer.decode(ids)})


@dataclass
class _Run:
    """One accepted request on its way out: outputs -> choices -> a response or events."""

    server: Server
    shape: Shape
    choices: list[Choice]
    index: dict[str, int]
    outs: Outputs
    prompt_tokens: int
    t0: float  # arrival (monotonic)

    def _take(self, o) -> tuple[Choice, str, dict | None]:
        c = self.choices[self.index[o.request_id]]
        had = len(c.logprobs)
        now = time.monotonic()
        if o.token_id is not None:
            self.server.metrics.token()
            if c.last is not None:
                self.server.metrics.itl.observe(now - c.last)
            c.last = now
        piece = c.add(o, self.server.token_text)
        if o.finished:
            m = self.server.metrics
            reason = o.finish_reason or "none"
            m.finished[reason] = m.finished.get(reason, 0) + 1
            if all(x.finish_reason is not None for x in self.choices):
                m.e2e.observe(now - self.t0)
        return c, piece, (c.logprobs[-1] if len(c.logprobs) > had else None)

    async def collect(self, first) -> dict[str, Any]:
        self._take(first)
        async for o in self.outs:
            self._take(o)
        return self.shape.full(self.choices, self.prompt_tokens)

    async def events(self, first):
        """The SSE stream: chat's role chunks, one chunk per token, one per end, [DONE].
        The events of every output already arrived go out in one write (a client that
        fell behind catches up in few sends)."""
        try:
            head = []
            if self.shape.chat:
                head = [self.shape.chunk(c, None, role=True) for c in self.choices]
            elif self.shape.echo is not None:  # the prompt first (no prompt logprobs here)
                head = [self.shape.chunk(c, self.shape.echo[c.prompt].text) for c in self.choices]
            tools = self.shape.tools is not None
            batch = [first, *self.outs.ready()]
            while batch:
                parts = head
                for o in batch:
                    c, piece, lp = self._take(o)
                    if (piece or c.shows(o)) and not tools:
                        parts.append(self.shape.chunk(c, piece, lp))
                    if o.finished:
                        if tools:
                            parts.append(self.shape.tool_chunk(c))
                        parts.append(self.shape.chunk(c, None, finish=o.finish_reason))
                yield "".join(parts)
                head = []
                o = await anext(self.outs, None)
                batch = [] if o is None else [o, *self.outs.ready()]
            tail = [self.shape.usage_chunk(self.choices, self.prompt_tokens)
                    ] if self.shape.include_usage else []  # fmt: skip
            yield "".join([*tail, DONE])
        finally:  # the end, or the client left (cancelled): abort what still runs
            if any(c.finish_reason is None for c in self.choices):
                self.server.metrics.aborted += 1
            self.outs.close()


def build_app(executor, model: ServedModel | None = None, max_queue: int | None = None, *,
              model_name: str | None = None, api_key: str | None = None,
              max_body_bytes: int = MAX_BODY_BYTES) -> Starlette:  # fmt: skip
    """The ASGI app over `executor` (a `DecodeExecutor` with a tokenizer, stepped by
    nobody else) in this process. `model` None serves the executor's tokenizer under
    `model_name` (no BOS prefix, the plain chat template). Requests beyond the free slots
    wait in arrival order, at most `max_queue` of them (default 4x max_batch_size); past
    that, 503 with Retry-After. `api_key`: required on every route but /health and
    /metrics. A body over `max_body_bytes` is a 413."""
    if model is None:
        model = ServedModel(model_name or "graphexec", executor.tokenizer,
                            executor.model.max_seq_len)  # fmt: skip
    queue = 4 * executor.max_batch_size if max_queue is None else max_queue
    metrics = ServerMetrics()
    return app_over(LocalEngine(executor, queue, metrics.queue.observe), model, metrics, api_key,
                    max_body_bytes)  # fmt: skip


def app_over(engine: Engine, model: ServedModel, metrics: ServerMetrics | None = None,
             api_key: str | None = None,
             max_body_bytes: int = MAX_BODY_BYTES) -> Starlette:  # fmt: skip
    """The ASGI app over any `Engine` (in this process, or `serve.remote`'s engine
    processes); the engine is closed at the app's shutdown."""
    server = Server(engine, model, metrics or ServerMetrics(), max_body_bytes)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        probe = asyncio.ensure_future(watch_loop_lag(server.metrics.loop_lag.observe))
        yield
        probe.cancel()
        await engine.close()

    routes = [
        Route("/health", server.health),
        Route("/metrics", server.prometheus),
        Route("/v1/models", server.models),
        Route("/v1/completions", server.completions, methods=["POST"]),
        Route("/v1/chat/completions", server.chat_completions, methods=["POST"]),
        Route("/tokenize", server.tokenize, methods=["POST"]),
        Route("/detokenize", server.detokenize, methods=["POST"]),
    ]
    middleware = [Middleware(ApiKey, key=api_key)] if api_key else []
    app = Starlette(routes=routes, lifespan=lifespan, middleware=middleware,
                    exception_handlers={HTTPException: http_error,
                                        Exception: internal_error})  # fmt: skip
    app.state.server = server
    return app
