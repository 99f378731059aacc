"""An asyncio front end: the decode loop in a background task, one stream per request.

```python
aex = gx.AsyncDecodeExecutor(ex, max_waiting=64)
async for o in aex.generate("r1", prompt, params):   # RequestOutputs of r1, in order
    ...
await aex.close()
```

The loop runs `ex.step()` in a worker thread (so the event loop stays responsive while
the GPU works) whenever the executor has work, and hands each output to its request's
queue. Leaving the `async for` early (break, an exception, the task cancelled) aborts
the request. With n > 1 the stream yields the outputs of every stream of the request.

Waiting for a slot: a request whose n streams do not fit the free slots waits in a FIFO
of at most `max_waiting` requests (0, the default: none wait, `ExecutorFullError` at
once as `add_request` raises it). The loop admits waiters in arrival order after each
step, so a later small request never overtakes an earlier large one. When the FIFO is
full, `generate` raises `QueueFullError` (an `ExecutorFullError`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

from graphexec.engine.inbox import ExecutorFullError, stream_ids
from graphexec.params import SamplingParams
from graphexec.request import RequestOutput

log = logging.getLogger(__name__)


class QueueFullError(ExecutorFullError):
    """generate() when no slot is free and `max_waiting` requests already wait."""


@dataclass(eq=False)
class _Waiter:
    """A request waiting for slots; the loop adds it and registers its queue."""

    request_id: str
    prompt: Sequence[int]
    params: SamplingParams
    ids: list[str]
    queue: asyncio.Queue
    admitted: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop()
                                     .create_future())  # fmt: skip


class AsyncDecodeExecutor:
    """Drives a `DecodeExecutor` from asyncio (see the module docstring). The executor
    must not be stepped by anyone else while this runs."""

    def __init__(self, executor, max_waiting: int = 0,
                 on_admitted: Callable[[float], None] | None = None) -> None:  # fmt: skip
        if isinstance(max_waiting, bool) or not isinstance(max_waiting, int) or max_waiting < 0:
            raise ValueError(f"max_waiting must be an int >= 0, got {max_waiting!r}")
        self.executor = executor
        self.max_waiting = max_waiting
        # called with the seconds each request waited for its slots (0: none), for metrics
        self._on_admitted = on_admitted
        self._queues: dict[str, asyncio.Queue] = {}  # stream request id -> its queue
        self._in_use: set[str] = set()  # request and stream ids of every live generate()
        self._waiting: deque[_Waiter] = deque()
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._closed = False

    @property
    def num_waiting(self) -> int:
        """Requests waiting for slots (not yet added to the executor)."""
        return len(self._waiting)

    async def generate(self, request_id: str, prompt_token_ids: Sequence[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:  # fmt: skip
        """Add the request (after waiting for slots, see the module docstring) and yield
        its outputs until it finishes (every stream of it, when params.n > 1). Errors of
        `add_request` (ValueError, ExecutorFullError, QueueFullError) raise here, before
        the first output; an id already in use is refused without touching its stream."""
        if self._closed:
            raise RuntimeError("this AsyncDecodeExecutor is closed")
        n = params.n if isinstance(params, SamplingParams) else 1
        ids = stream_ids(request_id, n) if isinstance(request_id, str) else []
        names = {request_id, *ids} if isinstance(request_id, str) else set()
        if names & self._in_use:
            raise ValueError(f"request_id {request_id!r} is already in use (its stream is "
                             "still open)")  # fmt: skip
        q: asyncio.Queue = asyncio.Queue()
        if self.max_waiting == 0 or (not self._waiting and self.executor.free_slots >= n):
            # the queue is registered only once the executor took the request, so a
            # refused one never touches another stream's queue
            self.executor.add_request(request_id, prompt_token_ids, params)
            self._queues.update(dict.fromkeys(ids, q))
            waited = 0.0
        else:
            t0 = time.monotonic()
            await self._wait(_Waiter(request_id, prompt_token_ids, params, ids, q), names)
            waited = time.monotonic() - t0
        if self._on_admitted is not None:
            self._on_admitted(waited)
        self._in_use |= names
        self._start()
        left = set(ids)
        try:
            while left:
                o = await q.get()
                if isinstance(o, BaseException):
                    raise o
                if o.finished:
                    left.discard(o.request_id)
                yield o
        finally:
            self._in_use -= names
            for i in ids:
                self._queues.pop(i, None)
            if left:  # the consumer left early: stop the rest of the work
                self._abort(request_id)

    async def _wait(self, w: _Waiter, names: set[str]) -> None:
        if w.params.n > self.executor.max_batch_size:
            raise ExecutorFullError(f"n={w.params.n} streams never fit max_batch_size="
                                    f"{self.executor.max_batch_size}")  # fmt: skip
        if len(self._waiting) >= self.max_waiting:
            raise QueueFullError(f"no free slot and {len(self._waiting)} requests already "
                                 "wait (max_waiting)")  # fmt: skip
        self._waiting.append(w)
        self._in_use |= names  # a duplicate id is refused while this one waits, too
        self._start()
        try:
            await w.admitted
        except asyncio.CancelledError:
            if w in self._waiting:
                self._waiting.remove(w)
            elif not w.admitted.cancelled() and w.admitted.exception() is None:
                for i in w.ids:  # admitted just before the cancel: undo it
                    self._queues.pop(i, None)
                self._abort(w.request_id)
            raise
        finally:
            self._in_use -= names

    def _admit_waiting(self) -> None:
        """Add waiters to the executor, first come first served, while their streams fit."""
        ex = self.executor
        while self._waiting and self._waiting[0].params.n <= ex.free_slots:
            w = self._waiting.popleft()
            if w.admitted.done():  # cancelled while queued
                continue
            try:
                ex.add_request(w.request_id, w.prompt, w.params)
            except Exception as e:  # noqa: BLE001 (the waiter raises it)
                w.admitted.set_exception(e)
                continue
            self._queues.update(dict.fromkeys(w.ids, w.queue))
            w.admitted.set_result(None)

    def _abort(self, request_id: str) -> None:
        try:
            self.executor.abort(request_id)
        except ValueError:
            pass  # it ended meanwhile (and was reported)

    def _start(self) -> None:
        if self._wake is None:
            self._wake = asyncio.Event()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._loop())
        self._wake.set()

    async def _loop(self) -> None:
        ex = self.executor
        while not self._closed:
            self._admit_waiting()
            if ex.idle:
                self._wake.clear()
                if ex.idle:  # re-check: a request may have come in between
                    await self._wake.wait()
                continue
            try:
                outs = await asyncio.to_thread(lambda: list(ex.step()))
            except Exception as e:  # the executor is broken: tell every waiting stream
                log.exception("step() failed; ending every stream")
                for q in set(self._queues.values()):
                    q.put_nowait(e)
                while self._waiting:
                    w = self._waiting.popleft()
                    if not w.admitted.done():
                        w.admitted.set_exception(e)
                return
            for o in outs:
                q = self._queues.get(o.request_id)
                if q is not None:
                    q.put_nowait(o)

    async def close(self) -> None:
        """Stop the loop (after the step in flight); running requests stay in the executor;
        requests still waiting for a slot raise RuntimeError."""
        self._closed = True
        while self._waiting:
            w = self._waiting.popleft()
            if not w.admitted.done():
                w.admitted.set_exception(RuntimeError("this AsyncDecodeExecutor is closed"))
        if self._wake is not None:
            self._wake.set()
        if self._task is not None:
            await self._task
