"""The executor's thread-safe side: queued commands and request-id bookkeeping.

`add_request` and `abort` may run on any thread while another thread is inside `step()`;
all they touch is a `RequestQueue`, under one lock held for microseconds. The stepping
thread `take`s the commands at the start of each step and does the work (prefill, slots,
device writes) itself.

Life of an id: queued (`add`) -> running (admitted by a step) -> ended (its slot freed;
its last output built) -> reported (returned by `step()`), when the id becomes free again.
"""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass

from graphexec.params import SamplingParams


def stream_ids(request_id: str, n: int) -> list[str]:
    """The request ids a request of n streams reports under."""
    return [request_id] if n == 1 else [f"{request_id}/{i}" for i in range(n)]


class ExecutorFullError(RuntimeError):
    """add_request when max_batch_size requests are already running or queued."""


@dataclass
class Admit:
    """A queued request: `ids` are its streams' request ids (one unless params.n > 1),
    `params` has its seed set; `streams[i]` is the stream index of ids[i]."""

    request_id: str
    ids: list[str]
    streams: list[int]
    prompt: list[int]
    params: SamplingParams
    bad_words: list[tuple[int, ...]]
    min_ids: tuple[int, ...]  # held back until min_tokens: stop ids, and EOS unless ignored

    def stream_params(self, i: int) -> SamplingParams:
        return self.params if self.params.n == 1 else self.params.stream(self.streams[i])


@dataclass
class Aborted:
    """A request aborted while still queued: reported at the next step, position 0."""

    request_id: str
    seed: int


@dataclass
class Abort:
    """Abort running requests at the next step (a no-op for one that ended meanwhile)."""

    ids: list[str]


class RequestQueue:
    """Commands for the stepping thread, and which ids are in use (see the module
    docstring). `capacity` slots in all; `seed` seeds the draws for unseeded requests."""

    def __init__(self, capacity: int, seed: int | None) -> None:
        self.capacity = capacity
        self._lock = threading.Lock()
        self._seeds = random.Random(seed) if seed is not None else random.SystemRandom()
        self._inbox: list[Admit | Abort | Aborted] = []
        self._live: set[str] = set()  # queued, running, or last output not yet returned
        self._ended: set[str] = set()  # finished; last output not yet returned
        self._groups: dict[str, list[str]] = {}  # n > 1: request id -> its streams' ids
        self._reserved = 0  # slots taken or promised to queued admissions

    @property
    def free(self) -> int:
        return self.capacity - self._reserved

    @property
    def empty(self) -> bool:
        return not self._inbox

    def add(self, request_id: str, prompt: list[int], params: SamplingParams,
            bad_words: list[tuple[int, ...]], min_ids: tuple[int, ...]) -> None:  # fmt: skip
        n = params.n
        ids = stream_ids(request_id, n)
        with self._lock:
            taken = [i for i in {request_id, *ids} if i in self._live or i in self._groups]
            if taken:
                raise ValueError(f"request_id {taken[0]!r} is already in use (queued, running, "
                                 "or its last output not yet returned by step())")  # fmt: skip
            if self._reserved + n > self.capacity:
                raise ExecutorFullError(
                    f"{n} stream(s) do not fit: {self.capacity - self._reserved} of "
                    f"{self.capacity} slots are free (ex.free_slots); wait for requests to "
                    "finish"
                )
            if params.seed is None:
                params = params.with_seed(self._seeds.getrandbits(63))
            self._reserved += n
            self._live.update(ids)
            if n > 1:
                self._groups[request_id] = list(ids)
            self._inbox.append(Admit(request_id, ids, list(range(n)), prompt, params, bad_words,
                                     min_ids))  # fmt: skip

    def abort(self, request_id: str) -> bool:
        """Queue the abort (True); False when every stream has ended already; ValueError
        for an unknown id. A stream still queued is dropped here: it never takes a slot."""
        with self._lock:
            ids = [i for i in self._groups.get(request_id) or [request_id] if i in self._live]
            if not ids:
                raise ValueError(
                    f"request_id {request_id!r} is unknown (never added, or it finished and "
                    "step() already returned its last output)"
                )
            ids = [i for i in ids if i not in self._ended]
            if not ids:
                return False  # finished; its end is about to be reported
            running = []
            for rid in ids:
                adm = next((c for c in self._inbox if isinstance(c, Admit) and rid in c.ids), None)
                if adm is None:
                    running.append(rid)
                    continue
                k = adm.ids.index(rid)
                seed = adm.stream_params(k).seed
                del adm.ids[k], adm.streams[k]
                self._reserved -= 1
                self._ended.add(rid)
                self._inbox.append(Aborted(rid, seed))
            if running:
                self._inbox.append(Abort(running))
            return True

    def take(self) -> list[Admit | Abort | Aborted]:
        with self._lock:
            cmds, self._inbox = self._inbox, []
        return cmds

    def ended(self, request_id: str) -> None:
        """The request's slot is free and its last output is built."""
        with self._lock:
            self._reserved -= 1
            self._ended.add(request_id)

    def reported(self, ids: list[str]) -> None:
        """`step()` returned the last outputs of `ids`: they may be used again."""
        with self._lock:
            self._live.difference_update(ids)
            self._ended.difference_update(ids)
            for parent in [p for p, g in self._groups.items() if not self._live.intersection(g)]:
                del self._groups[parent]
