"""The step plan: the ordered decode rows of a step, cut into chunks of at most the
largest bucket, each with its `GraphKey` (the variant: `choose_variant`'s choice).

It is rebuilt only when a request is admitted, finishes or is aborted, or a row stops
being launchable (its generated plus in-flight tokens reach its limit). The per-request
counters live in `SlotCounters`, numpy columns indexed by slot, so a step touches no
per-request Python object unless that request ends, has a token mask, its own stop ids,
or its text is detokenised; and two steps in flight (the pipelined step) read and
advance the same counters. A plan keeps each row's slot and the slot's epoch at build
time: a row whose request ended since (epoch moved on) is dead, its tokens dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from graphexec.engine.graphs import chunks
from graphexec.params import VARIANT_ORDER
from graphexec.request import GraphKey, Request


def chunk_key(rows: list[Request], bucket: int) -> GraphKey:
    """The key of a chunk of rows: `choose_variant`'s choice, from the ranks cached at
    admission (no per-step scan of the parameters)."""
    variant = VARIANT_ORDER[max(r.variant_rank for r in rows)]
    return GraphKey(variant, bucket, any(r.params.logprobs is not None for r in rows))


@dataclass
class SlotCounters:
    """Host counters per slot (numpy [S]), written at admission and by each step's finish.

    generated: tokens the request has reported; limit: min(max_tokens, the room left in the
    model's sequence); inflight: tokens launched and not yet collected (a speculative
    step counts the most its run may hold: the allowance + 1); text_slow: its next token
    needs the decoder (`OutputText.needs_push`); epoch: bumped when the slot's request ends."""

    generated: np.ndarray
    limit: np.ndarray
    inflight: np.ndarray
    text_slow: np.ndarray
    epoch: np.ndarray

    @classmethod
    def allocate(cls, slots: int) -> SlotCounters:
        def z(dtype=np.int64):
            return np.zeros(slots, dtype=dtype)

        return cls(z(), z(), z(), z(bool), z())

    def start(self, slot: int, limit: int, text_slow: bool) -> None:
        self.generated[slot], self.limit[slot], self.inflight[slot] = 0, limit, 0
        self.text_slow[slot] = text_slow

    def end(self, slot: int) -> None:
        """The slot's request ended: rows of it still in flight are dead."""
        self.epoch[slot] += 1
        self.inflight[slot] = 0

    def launchable(self, slots: np.ndarray) -> np.ndarray:
        """bool [n]: the slots' requests may emit a token past those in flight."""
        return self.generated[slots] + self.inflight[slots] < self.limit[slots]


@dataclass
class BatchPlan:
    rows: list[Request]
    chunks: list[tuple[GraphKey, int, int]]  # (key, first row, rows); spec_k 0 until launch
    counters: SlotCounters
    slots: np.ndarray  # i64 [n]: each row's slot
    epoch: np.ndarray  # i64 [n]: its slot's epoch when the plan was built
    own_stops: list[int]  # rows with stop_token_ids of their own
    eos_stops: np.ndarray  # bool [n]: EOS stops the row (not ignore_eos)
    mask_rows: list[int]  # rows whose token mask the host rewrites each step (grammar, bad words)
    has_text: np.ndarray  # bool [n]: the row's output text is detokenised
    logprobs: bool  # some row asked for logprobs
    uploaded: bool = False  # the device slot ids hold this plan's only chunk
    # slots of running rows left out (their tokens in flight may fill their limit)
    waiting: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    @classmethod
    def build(cls, rows: list[Request], buckets: Sequence[int], counters: SlotCounters,
              has_mask) -> BatchPlan:  # fmt: skip
        slots = np.array([r.slot for r in rows], dtype=np.int64)
        return cls(
            rows=rows,
            chunks=[
                (chunk_key(rows[start : start + n], bucket), start, n)
                for start, n, bucket in chunks(len(rows), buckets)
            ],
            counters=counters,
            slots=slots,
            epoch=counters.epoch[slots],
            own_stops=[i for i, r in enumerate(rows) if r.params.stop_token_ids],
            eos_stops=np.array([not r.params.ignore_eos for r in rows], dtype=bool),
            mask_rows=[i for i, r in enumerate(rows) if has_mask(r.slot)],
            has_text=np.array([r.text is not None for r in rows], dtype=bool),
            logprobs=any(r.params.logprobs is not None for r in rows),
        )

    # the counters of the plan's rows (copies)
    @property
    def generated(self) -> np.ndarray:
        return self.counters.generated[self.slots]

    @property
    def limit(self) -> np.ndarray:
        return self.counters.limit[self.slots]

    @property
    def inflight(self) -> np.ndarray:
        return self.counters.inflight[self.slots]

    @property
    def text_slow(self) -> np.ndarray:
        return self.counters.text_slow[self.slots]

    def live(self) -> np.ndarray:
        """bool [n]: rows whose request has not ended since the plan was built."""
        return self.counters.epoch[self.slots] == self.epoch

    def launched(self, tokens: np.ndarray | int) -> None:
        """A step of the plan's rows went out: at most `tokens` ([n] or one for all) each."""
        self.counters.inflight[self.slots] += tokens

    def collected(self, live: np.ndarray, count: np.ndarray, tokens: np.ndarray | int) -> None:
        """The step's tokens are in: live rows advance by `count`, and their in-flight
        `tokens` (as `launched`) are released (dead rows' slots may belong to other
        requests already: untouched)."""
        s = self.slots[live]
        self.counters.inflight[s] -= tokens if np.isscalar(tokens) else tokens[live]
        self.counters.generated[s] += count[live]
