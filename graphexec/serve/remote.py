"""An API server's side of the engine processes (`serve.engine_core`): requests go out
to the least-loaded engine, outputs come back on this server's own socket.

One reader task takes every message for this server and hands each output to its
request's stream; a stream holds what arrived and the route reads it (`ready()` drains
what is already there, so a client that fell behind gets its backlog in one write).
Leaving a stream before its end sends ABORT to its engine.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import zmq
import zmq.asyncio

from graphexec.engine.async_executor import QueueFullError
from graphexec.engine.inbox import ExecutorFullError, stream_ids
from graphexec.params import SamplingParams
from graphexec.request import RequestOutput
from graphexec.serve import wire
from graphexec.serve.engines import EngineStats

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineInfo:
    """What an engine reports once ready."""

    max_batch_size: int
    vocab_size: int
    max_seq_len: int


class _Stream:
    """The outputs of one request (all n streams of it), in arrival order."""

    def __init__(self, owner: RemoteEngines, engine: int, request_id: str, n: int) -> None:
        self._owner, self.engine, self.request_id = owner, engine, request_id
        self.ids = stream_ids(request_id, n)
        self.n = n
        self._left = set(self.ids)
        self._buf: deque = deque()
        self._wake = asyncio.Event()
        self._closed = False

    def push(self, item) -> None:
        self._buf.append(item)
        self._wake.set()

    def __aiter__(self) -> _Stream:
        return self

    async def __anext__(self) -> RequestOutput:
        while not self._buf:
            if not self._left or self._closed:
                raise StopAsyncIteration
            self._wake.clear()
            await self._wake.wait()
        return self._take(self._buf.popleft())

    def _take(self, item) -> RequestOutput:
        if isinstance(item, BaseException):
            self._left.clear()
            self._end()
            raise item
        if item.finished:
            self._left.discard(item.request_id)
            if not self._left:
                self._end()
        return item

    def ready(self) -> list[RequestOutput]:
        """The outputs that arrived and were not read yet (no waiting)."""
        out = []
        while self._buf and not isinstance(self._buf[0], BaseException):
            out.append(self._take(self._buf.popleft()))
        return out

    def _end(self) -> None:
        if not self._closed:
            self._closed = True
            self._owner._release(self)

    async def aclose(self) -> None:
        if not self._closed:
            if self._left:
                self._owner._abort(self)
            self._end()


class RemoteEngines:
    """`serve.engines.Engine` over engine processes: `engine_addrs[e]` is engine e's
    PULL socket, `server_addr` this server's (bound here), `server` its number."""

    def __init__(self, server: int, server_addr: str, engine_addrs: Sequence[str],
                 infos: Sequence[EngineInfo],
                 on_admitted: Callable[[float], None] | None = None) -> None:  # fmt: skip
        self.server = server
        self.engines = len(engine_addrs)
        self.max_batch_size = min(i.max_batch_size for i in infos)
        self.vocab_size = infos[0].vocab_size
        self.on_admitted = on_admitted
        self._ctx = zmq.Context()
        self._out = [wire.push_socket(self._ctx, a) for a in engine_addrs]
        self._actx = zmq.asyncio.Context()
        self._in = wire.pull_socket(self._actx, server_addr)
        self._stats = [EngineStats(free_slots=i.max_batch_size) for i in infos]
        self._live = [0] * self.engines  # streams this server has on each engine
        self._streams: dict[str, _Stream] = {}  # stream id and request id -> its stream
        self._reader: asyncio.Task | None = None

    # ---- the Engine protocol ---------------------------------------------------------
    def generate(self, request_id: str, prompt_token_ids: Sequence[int],
                 params: SamplingParams) -> _Stream:  # fmt: skip
        """Send the request to the least-loaded engine; its outputs as they come. A refusal
        (ValueError, ExecutorFullError, QueueFullError) raises on the first read."""
        if self._reader is None:
            self._reader = asyncio.get_running_loop().create_task(self._read())
        n = params.n
        e = min(
            range(self.engines),
            key=lambda i: (self._live[i], self._stats[i].running + self._stats[i].waiting),
        )
        st = _Stream(self, e, request_id, n)
        for k in {request_id, *st.ids}:
            self._streams[k] = st
        self._live[e] += n
        self._send(e, wire.add(self.server, request_id, list(prompt_token_ids), params))
        return st

    def stats(self) -> EngineStats:
        return EngineStats.total(self._stats)

    def engine_stats(self) -> list[EngineStats]:
        """Each engine's load as its last message said (engines report after every step
        with outputs for this server, and when they go idle)."""
        return list(self._stats)

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        self._in.close(linger=0)
        for s in self._out:
            s.close(linger=0)
        self._ctx.term()
        self._actx.term()

    # ---- streams ---------------------------------------------------------------------
    def _release(self, st: _Stream) -> None:
        for k in {st.request_id, *st.ids}:
            if self._streams.get(k) is st:
                del self._streams[k]
        self._live[st.engine] -= st.n

    def _abort(self, st: _Stream) -> None:
        self._send(st.engine, wire.pack([wire.ABORT, st.request_id]))

    def _send(self, engine: int, data: bytes) -> None:
        try:  # an engine that is gone ends the server (launch); never block a route on it
            self._out[engine].send(data, zmq.NOBLOCK)
        except zmq.Again:
            log.error("engine %d is not reading; a message dropped", engine)

    async def _read(self) -> None:
        sock, streams = self._in, self._streams
        while True:
            msg = wire.unpack(await sock.recv())
            kind, e = msg[0], msg[1]
            if kind == wire.OUTPUTS:
                if msg[2] is not None:  # None: unchanged (an engine sends them every 100 ms)
                    self._stats[e] = EngineStats(*msg[2])
                for r in msg[3]:
                    st = streams.get(r[0])
                    if st is not None:
                        st.push(wire.output(r))
            elif kind == wire.STATS:
                self._stats[e] = EngineStats(*msg[2])
            elif kind == wire.ADMITTED:
                if self.on_admitted is not None and msg[2] in streams:
                    self.on_admitted(msg[3])
            elif kind == wire.REJECTED:
                st = streams.get(msg[2])
                if st is not None:
                    st.push(_refusal(msg[3], msg[4]))


def _refusal(kind: str, message: str) -> Exception:
    if kind == wire.BAD_REQUEST:
        return ValueError(message)
    if kind == wire.QUEUE_FULL:
        return QueueFullError(message)
    if kind == wire.NEVER_FITS:
        return ExecutorFullError(message)
    return RuntimeError(f"the engine could not add the request: {message}")
