"""What the routes generate through: an engine in this process (`LocalEngine`, over
`AsyncDecodeExecutor`) or engine processes behind a channel (`serve.remote.RemoteEngines`).
Both give `generate`, `stats`, `close` and the two sizes the routes check."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, fields
from typing import Protocol

from graphexec.engine.async_executor import AsyncDecodeExecutor
from graphexec.params import SamplingParams
from graphexec.request import RequestOutput


@dataclass(frozen=True)
class EngineStats:
    """One engine's load and counters (summed over engines by `total`)."""

    running: int = 0  # streams holding a slot
    waiting: int = 0  # requests waiting for slots
    free_slots: int = 0
    steps: int = 0
    replays: int = 0  # steps replayed from a captured graph
    eager: int = 0  # steps run eagerly
    drafted: int = 0  # speculation: drafts verified
    accepted: int = 0  # speculation: drafts accepted

    @classmethod
    def of(cls, executor, waiting: int) -> EngineStats:
        st = executor.stats
        return cls(executor.num_running, waiting, executor.free_slots, st.steps,
                   sum(st.replays.values()), sum(st.eager_steps.values()), st.drafted,
                   st.accepted)  # fmt: skip

    def as_tuple(self) -> tuple[int, ...]:
        return tuple(getattr(self, f.name) for f in fields(self))

    @classmethod
    def total(cls, parts: Sequence[EngineStats]) -> EngineStats:
        return cls(*(sum(col) for col in zip(*(p.as_tuple() for p in parts), strict=True)))


class Engine(Protocol):
    """The routes' view of what runs requests."""

    max_batch_size: int  # of one engine: a request's n streams must fit it
    vocab_size: int
    engines: int  # data-parallel engines behind it

    def generate(self, request_id: str, prompt_token_ids: Sequence[int],
                 params: SamplingParams) -> AsyncIterator[RequestOutput]: ...  # fmt: skip

    def stats(self) -> EngineStats: ...  # summed over engines

    def engine_stats(self) -> list[EngineStats]: ...  # one per engine

    async def close(self) -> None: ...


class LocalEngine:
    """The executor in this process, stepped by an `AsyncDecodeExecutor` (one loop)."""

    engines = 1

    def __init__(self, executor, max_waiting: int,
                 on_admitted: Callable[[float], None] | None = None) -> None:  # fmt: skip
        self.executor = executor
        self.max_batch_size = executor.max_batch_size
        self.vocab_size = executor.model.vocab_size
        self.aex = AsyncDecodeExecutor(executor, max_waiting=max_waiting, on_admitted=on_admitted)

    def generate(self, request_id, prompt_token_ids, params):
        return self.aex.generate(request_id, prompt_token_ids, params)

    def stats(self) -> EngineStats:
        return EngineStats.of(self.executor, self.aex.num_waiting)

    def engine_stats(self) -> list[EngineStats]:
        return [self.stats()]

    async def close(self) -> None:
        await self.aex.close()
