"""A request's outputs on their way to the client: its generate() streams merged
(`Outputs`), and the client's disconnect watched while they are awaited."""

from __future__ import annotations

import asyncio
import logging

from starlette.requests import Request

log = logging.getLogger(__name__)


class Disconnected(Exception):
    """The client went away before the answer."""


class Outputs:
    """The outputs of a request's generate() calls (one per prompt), merged as they come.
    One prompt (the usual case) is read straight from its generator; several are pumped
    into one queue. `close()` ends them, which aborts whatever is still running."""

    def __init__(self, gens: list) -> None:
        self._one = gens[0] if len(gens) == 1 else None
        self._q: asyncio.Queue = asyncio.Queue()
        self._left = len(gens)
        self._tasks = [] if self._one else [asyncio.create_task(self._pump(g)) for g in gens]

    async def _pump(self, gen) -> None:
        try:
            async for o in gen:
                self._q.put_nowait(o)
            self._q.put_nowait(None)
        except Exception as e:  # noqa: BLE001 (raised to the reader)
            self._q.put_nowait(e)

    def __aiter__(self) -> Outputs:
        return self

    async def __anext__(self):
        if self._one is not None:
            return await self._one.__anext__()
        while self._left:
            o = await self._q.get()
            if o is None:
                self._left -= 1
                continue
            if isinstance(o, BaseException):
                raise o
            return o
        raise StopAsyncIteration

    def ready(self) -> list:
        """Outputs already arrived, taken without waiting (a stream that cannot say: none)."""
        if self._one is not None:
            take = getattr(self._one, "ready", None)
            return take() if take is not None else []
        out = []
        while self._left and not self._q.empty():
            o = self._q.get_nowait()
            if o is None:
                self._left -= 1
            elif isinstance(o, BaseException):
                self._q.put_nowait(o)  # raised by the next __anext__
                break
            else:
                out.append(o)
        return out

    def close(self) -> None:
        if self._one is not None:  # its `finally` aborts the request if it still runs
            asyncio.ensure_future(self._one.aclose()).add_done_callback(_quiet)
        for t in self._tasks:
            t.cancel()


def _quiet(task: asyncio.Future) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.debug("closing a request's outputs: %r", task.exception())


async def until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def or_disconnect(request: Request, coro):
    """Await `coro` unless the client disconnects first (then it is cancelled)."""
    work = asyncio.ensure_future(coro)
    watch = asyncio.ensure_future(until_disconnect(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if not work.done():
        work.cancel()
        raise Disconnected
    return work.result()
