"""An engine process: one `DecodeExecutor` stepped in a plain loop, fed by the API
servers over ZeroMQ (`serve.wire`), so no HTTP, JSON or SSE work shares its thread.

    loop:
      1. take the API servers' messages: ADD (admitted now, queued, or rejected), ABORT
         (blocking only while there is nothing to step)
      2. admit waiting requests, first come first served, while their streams fit
      3. step the executor once
      4. send each API server one OUTPUTS message with its requests' rows, and the load at
         most every 100 ms (None otherwise: the server keeps the last)

The waiting FIFO has `AsyncDecodeExecutor`'s rules: at most `max_waiting` requests, a
later small request never overtakes an earlier large one. Token text is made here, by
the executor, since stop strings end a request inside the loop.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

import zmq

from graphexec.engine.inbox import ExecutorFullError, stream_ids
from graphexec.params import SamplingParams
from graphexec.serve import wire
from graphexec.serve.engines import EngineStats

log = logging.getLogger(__name__)
POLL_MS = 500  # idle: how long one wait for a message lasts
STATS_EVERY_S = 0.1  # stats ride with outputs at most this often


@dataclass(eq=False)
class _Waiter:
    server: int
    request_id: str
    prompt: list[int]
    params: SamplingParams
    since: float  # monotonic arrival


class EngineCore:
    """The loop of one engine (see the module docstring). `inbox`: a bound PULL socket;
    `outboxes[j]`: a PUSH socket to API server j."""

    def __init__(self, executor, index: int, max_waiting: int, inbox: zmq.Socket,
                 outboxes: list[zmq.Socket]) -> None:  # fmt: skip
        self.ex, self.index, self.max_waiting = executor, index, max_waiting
        self.inbox, self.outboxes = inbox, outboxes
        self.waiting: deque[_Waiter] = deque()
        self.owner: dict[str, int] = {}  # stream id -> its API server
        self._poller = zmq.Poller()
        self._poller.register(inbox, zmq.POLLIN)
        self._told_idle = True
        self._stats_at = -1.0  # monotonic time of the last stats sent with outputs
        self.stopped = False

    def run(self) -> None:
        ex = self.ex
        while not self.stopped:
            self._take(block=ex.idle)
            self._admit()
            if ex.idle:
                if not self._told_idle:  # the last load every server saw was busy
                    self._broadcast([wire.STATS, self.index, self._stats()])
                    self._told_idle = True
                continue
            self._told_idle = False
            try:
                outs = ex.step()
            except Exception:
                log.exception("engine %d: step() failed; ending its streams", self.index)
                self._fail_all()
                raise
            self._send(outs)

    # ---- messages in -----------------------------------------------------------------
    def _take(self, block: bool) -> None:
        if block and not self._poller.poll(POLL_MS):
            return
        while True:
            try:
                msg = wire.unpack(self.inbox.recv(zmq.NOBLOCK))
            except zmq.Again:
                return
            if msg[0] == wire.ADD:
                _, server, rid, prompt, blob = msg
                self._add(_Waiter(server, rid, prompt, wire.params_of(blob), time.monotonic()))
            elif msg[0] == wire.ABORT:
                self._abort(msg[1])

    def _add(self, w: _Waiter) -> None:
        n, ex = w.params.n, self.ex
        if not self.waiting and ex.free_slots >= n:
            self._start(w)
        elif n > ex.max_batch_size:
            self._reject(w, wire.NEVER_FITS, f"n={n} streams never fit max_batch_size="
                         f"{ex.max_batch_size}")  # fmt: skip
        elif len(self.waiting) >= self.max_waiting:
            self._reject(w, wire.QUEUE_FULL, f"no free slot and {len(self.waiting)} requests "
                         "already wait (max_waiting)")  # fmt: skip
        else:
            self.waiting.append(w)

    def _admit(self) -> None:
        while self.waiting and self.waiting[0].params.n <= self.ex.free_slots:
            self._start(self.waiting.popleft())

    def _start(self, w: _Waiter) -> None:
        try:
            self.ex.add_request(w.request_id, w.prompt, w.params)
        except ExecutorFullError as e:
            self._reject(w, wire.QUEUE_FULL, str(e))
            return
        except (ValueError, TypeError) as e:
            self._reject(w, wire.BAD_REQUEST, str(e))
            return
        except Exception as e:  # noqa: BLE001 (a bug: that request fails, not the engine)
            log.exception("engine %d: add_request(%r) failed", self.index, w.request_id)
            self._reject(w, wire.INTERNAL, f"{type(e).__name__}: {e}")
            return
        for s in stream_ids(w.request_id, w.params.n):
            self.owner[s] = w.server
        waited = time.monotonic() - w.since
        self._post(w.server, [wire.ADMITTED, self.index, w.request_id, waited])

    def _reject(self, w: _Waiter, kind: str, message: str) -> None:
        self._post(w.server, [wire.REJECTED, self.index, w.request_id, kind, message])

    def _post(self, server: int, msg: list, data: bytes | None = None) -> None:
        """Send without ever blocking the loop: a server that is gone loses its messages."""
        try:
            self.outboxes[server].send(data or wire.pack(msg), zmq.NOBLOCK)
        except zmq.Again:
            log.warning("engine %d: API server %d is not reading; a message dropped",
                        self.index, server)  # fmt: skip

    def _abort(self, request_id: str) -> None:
        for w in self.waiting:
            if w.request_id == request_id:
                self.waiting.remove(w)
                return
        try:
            self.ex.abort(request_id)
        except ValueError:
            pass  # it ended meanwhile (and was reported)

    # ---- messages out ----------------------------------------------------------------
    def _stats(self) -> tuple[int, ...]:
        return EngineStats.of(self.ex, len(self.waiting)).as_tuple()

    def _fresh_stats(self) -> tuple[int, ...] | None:
        """The engine's stats, at most every STATS_EVERY_S (building them costs tens of
        microseconds, too much per step); None between: the server keeps the last ones.
        An engine going idle always broadcasts them (`run`)."""
        now = time.monotonic()
        if now - self._stats_at < STATS_EVERY_S:
            return None
        self._stats_at = now
        return self._stats()

    def _send(self, outs) -> None:
        per: list[list] = [[] for _ in self.outboxes]
        owner = self.owner
        for o in outs:
            server = owner.get(o.request_id)
            if server is None:
                continue
            per[server].append(wire.row(o))
            if o.finished:
                del owner[o.request_id]
        if not any(per):
            return
        stats = self._fresh_stats()
        for server, rows in enumerate(per):
            if rows:
                self._post(server, [wire.OUTPUTS, self.index, stats, rows])

    def _broadcast(self, msg: list) -> None:
        data = wire.pack(msg)
        for server in range(len(self.outboxes)):
            self._post(server, msg, data)

    def _fail_all(self) -> None:
        from graphexec.request import RequestOutput

        per: list[list] = [[] for _ in self.outboxes]
        for sid, server in self.owner.items():
            o = RequestOutput(sid, None, 0, 0, finished=True, finish_reason="error",
                              message="the engine failed")  # fmt: skip
            per[server].append(wire.row(o))
        for server, rows in enumerate(per):
            if rows:
                stats = EngineStats().as_tuple()  # the executor is broken: ask it nothing
                self._post(server, [wire.OUTPUTS, self.index, stats, rows])
        self.owner.clear()
