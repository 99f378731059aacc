"""The host side of a step, kept cheap: a batch plan reused while no request comes or
goes, stop checks on whole columns, and outputs built only when they are read.

Terms: the *plan* is the ordered decode rows of a step, cut into chunks of at most the
largest bucket, each with its `GraphKey`; it is rebuilt only when a request is admitted,
finishes or is aborted. Its per-row counters (tokens generated, token limit) are numpy
columns, so a step touches no per-request Python object unless that request ends, has a
grammar, or has its own stop ids.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from graphexec.graphs import GraphKey, chunks
from graphexec.request import Request, RequestOutput, chunk_key

INVALID_MESSAGE = "no samplable token: every logit was NaN or -inf, or the grammar allowed none"


@dataclass
class BatchPlan:
    rows: list[Request]
    chunks: list[tuple[GraphKey, int, int]]  # (key, first row, rows)
    generated: np.ndarray  # i64 [n]: tokens each request has produced
    limit: np.ndarray  # i64 [n]: min(max_tokens, room left in the model's sequence)
    own_stops: list[int]  # rows with stop_token_ids of their own
    grammar_rows: list[int]  # rows with a grammar matcher
    logprobs: bool  # some row asked for logprobs
    uploaded: bool = False  # the device slot ids hold this plan's only chunk

    @classmethod
    def build(cls, rows: list[Request], buckets: Sequence[int], max_seq_len: int,
              grammar_slots) -> BatchPlan:  # fmt: skip
        return cls(
            rows=rows,
            chunks=[
                (chunk_key(rows[start : start + n], bucket), start, n)
                for start, n, bucket in chunks(len(rows), buckets)
            ],
            generated=np.array([r.generated for r in rows], dtype=np.int64),
            limit=np.array(
                [min(r.params.max_tokens, max_seq_len - r.prompt_len) for r in rows],
                dtype=np.int64,
            ),
            own_stops=[i for i, r in enumerate(rows) if r.params.stop_token_ids],
            grammar_rows=[i for i, r in enumerate(rows) if grammar_slots(r.slot)],
            logprobs=any(r.params.logprobs is not None for r in rows),
        )

    def retire(self) -> None:
        """Write the counters back to the requests (the plan is about to be rebuilt)."""
        for r, g in zip(self.rows, self.generated.tolist(), strict=True):
            r.generated = g


@dataclass
class Finished:
    row: int
    reason: str  # "stop", "length", "error"


def finish_rows(plan: BatchPlan, host, eos: int | None, grammar) -> tuple[StepOutputs, list]:
    """Advance the plan's counters by the step's host outputs and decide who ends.

    `host` is a SamplerOutput on the host whose first n rows belong to the plan's rows.
    Returns the step's outputs and the rows that finished (the caller releases them).
    """
    n = len(plan.rows)
    toks = host.token_ids[:n].numpy().copy()
    valid = toks >= 0  # the sampler writes -1 exactly where a row is invalid
    positions = plan.generated.copy()
    plan.generated += valid
    stop = toks == eos if eos is not None else np.zeros(n, dtype=bool)
    for i in plan.own_stops:
        if valid[i] and int(toks[i]) in plan.rows[i].stop_ids:
            stop[i] = True
    for i in plan.grammar_rows:
        if valid[i] and grammar.accept(plan.rows[i].slot, int(toks[i])):
            stop[i] = True
    done = ~valid | stop | (plan.generated >= plan.limit)
    ended = []
    for i in np.flatnonzero(done).tolist():
        reason = "error" if not valid[i] else "stop" if stop[i] else "length"
        ended.append(Finished(i, reason))
    lp = None
    if plan.logprobs:
        lp = tuple(getattr(host, f)[:n].clone()
                   for f in ("logprobs", "ranks", "top_token_ids", "top_logprobs"))  # fmt: skip
    outs = StepOutputs(plan.rows, plan.chunks, toks, positions,
                       {f.row: f.reason for f in ended}, lp)  # fmt: skip
    return outs, ended


class StepOutputs(Sequence[RequestOutput]):
    """One step's outputs: first the ones that were waiting (`ready`: first tokens drawn at
    admission, aborts), then one per decode row. Decode rows are held as columns and each
    `RequestOutput` is built when it is read, so the step does no per-row Python work.
    Engines that want columns read `row_request_ids` / `row_token_ids` (numpy, -1 where
    invalid) for the decode rows."""

    def __init__(self, rows=(), chunks=(), token_ids=None, positions=None, reasons=None,
                 logprobs=None) -> None:  # fmt: skip
        self.ready: list[RequestOutput] = []
        self._rows = rows
        self._chunks = chunks
        self.row_token_ids = token_ids
        self._positions = positions
        self._reasons = reasons
        self._lp = logprobs

    @property
    def row_request_ids(self) -> list[str]:
        return [r.request_id for r in self._rows]

    def __len__(self) -> int:
        return len(self.ready) + len(self._rows)

    def _key(self, i: int) -> GraphKey | None:
        for key, start, n in self._chunks:
            if start <= i < start + n:
                return key
        return None  # drawn at admission

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        if i < len(self.ready):
            return self.ready[i]
        i -= len(self.ready)
        req = self._rows[i]
        pos, seed = int(self._positions[i]), req.params.seed
        reason = self._reasons.get(i)
        if self.row_token_ids[i] < 0:  # the sampler found nothing samplable
            return RequestOutput(req.request_id, None, pos, seed, finished=True,
                                 finish_reason="error", message=INVALID_MESSAGE,
                                 key=self._key(i))  # fmt: skip
        lp = rank = top = None
        k = req.params.logprobs
        if k is not None:
            lps, ranks, top_ids, top_lps = self._lp
            lp, rank = float(lps[i]), int(ranks[i])
            top = list(zip(top_ids[i, :k].tolist(), top_lps[i, :k].tolist(), strict=True))
        return RequestOutput(req.request_id, int(self.row_token_ids[i]), pos, seed, lp, rank, top,
                             reason is not None, reason, key=self._key(i))  # fmt: skip

    def __iter__(self) -> Iterator[RequestOutput]:
        yield from self.ready
        if not self._rows:
            return
        toks, pos = self.row_token_ids.tolist(), self._positions.tolist()
        keys = [key for key, _, n in self._chunks for _ in range(n)] or [None] * len(toks)
        skip = len(self.ready)
        for i, req in enumerate(self._rows):
            p = req.params
            if toks[i] < 0 or p.logprobs is not None or i in self._reasons:
                yield self[skip + i]  # the full path: logprobs, an end
            else:
                yield RequestOutput(req.request_id, toks[i], pos[i], p.seed, key=keys[i])
