"""An asyncio front end: the decode loop in a background task, one stream per request.

```python
aex = gx.AsyncDecodeExecutor(ex)
async for o in aex.generate("r1", prompt, params):   # RequestOutputs of r1, in order
    ...
await aex.close()
```

The loop runs `ex.step()` in a worker thread (so the event loop stays responsive while
the GPU works) whenever the executor has work, and hands each output to its request's
queue. Leaving the `async for` early (break, an exception, the task cancelled) aborts
the request. With n > 1 the stream yields the outputs of every stream of the request.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence

from graphexec.engine.inbox import stream_ids
from graphexec.params import SamplingParams
from graphexec.request import RequestOutput

log = logging.getLogger(__name__)


class AsyncDecodeExecutor:
    """Drives a `DecodeExecutor` from asyncio (see the module docstring). The executor
    must not be stepped by anyone else while this runs."""

    def __init__(self, executor) -> None:
        self.executor = executor
        self._queues: dict[str, asyncio.Queue] = {}  # stream request id -> its queue
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._closed = False

    async def generate(self, request_id: str, prompt_token_ids: Sequence[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:  # fmt: skip
        """Add the request and yield its outputs until it finishes (every stream of it,
        when params.n > 1). Errors of `add_request` raise here, before the first output."""
        if self._closed:
            raise RuntimeError("this AsyncDecodeExecutor is closed")
        ids = stream_ids(request_id, params.n)
        q: asyncio.Queue = asyncio.Queue()
        for i in ids:
            self._queues[i] = q
        try:
            self.executor.add_request(request_id, prompt_token_ids, params)
        except BaseException:
            for i in ids:
                self._queues.pop(i, None)
            raise
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
            for i in ids:
                self._queues.pop(i, None)
            if left:  # the consumer left early: stop the rest of the work
                try:
                    self.executor.abort(request_id)
                except ValueError:
                    pass  # it ended meanwhile

    def _start(self) -> None:
        if self._wake is None:
            self._wake = asyncio.Event()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._loop())
        self._wake.set()

    async def _loop(self) -> None:
        ex = self.executor
        while not self._closed:
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
                return
            for o in outs:
                q = self._queues.get(o.request_id)
                if q is not None:
                    q.put_nowait(o)

    async def close(self) -> None:
        """Stop the loop (after the step in flight); running requests stay in the executor."""
        self._closed = True
        if self._wake is not None:
            self._wake.set()
        if self._task is not None:
            await self._task
