"""The host side of a step, kept cheap: a batch plan reused while no request comes or
goes, stop checks on whole columns, and outputs built only when they are read.

Terms: the *plan* is the ordered decode rows of a step, cut into chunks of at most the
largest bucket, each with its `GraphKey`; it is rebuilt only when a request is admitted,
finishes or is aborted. Its per-row counters (tokens generated, token limit) are numpy
columns, so a step touches no per-request Python object unless that request ends, has a
token mask, its own stop ids, or its text is detokenised.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from graphexec.graphs import GraphKey, chunks
from graphexec.request import Request, RequestOutput, chunk_key

INVALID_MESSAGE = (
    "no samplable token: every logit was NaN or -inf, or the token masks (grammar, "
    "allowed_token_ids, bad_words, min_tokens) allowed none"
)
INF_MESSAGE = "the model's logits hold +inf for the sampled token: the model is broken"
# host token ids of rows with no token (the sampler writes -1 for nothing samplable)
INF_TOKEN = -2  # the sampled token's raw logit was +inf (flagged inside the step)
CHUNK_FAILED = -3  # the chunk's step raised (the message says why)


def error_message(code: int, row: int, chunks, errors: dict[int, str]) -> str:
    """Why a row with token id `code` (< 0) has no token: -1 the sampler found nothing
    samplable, -2 +inf logits, -3 its chunk's step raised (`errors`: chunk start -> why)."""
    if code == INF_TOKEN:
        return INF_MESSAGE
    if code == CHUNK_FAILED:
        start = max((s for _, s, _ in chunks if s <= row), default=0)
        return f"the step failed: {errors.get(start, 'unknown error')}"
    return INVALID_MESSAGE


@dataclass
class BatchPlan:
    rows: list[Request]
    chunks: list[tuple[GraphKey, int, int]]  # (key, first row, rows)
    generated: np.ndarray  # i64 [n]: tokens each request has produced
    limit: np.ndarray  # i64 [n]: min(max_tokens, room left in the model's sequence)
    own_stops: list[int]  # rows with stop_token_ids of their own
    eos_stops: np.ndarray  # bool [n]: EOS stops the row (not ignore_eos)
    mask_rows: list[int]  # rows with a host-written token mask (grammar, allowed, bad words)
    has_text: np.ndarray  # bool [n]: the row's output text is detokenised
    text_slow: np.ndarray  # bool [n]: its next token needs the decoder (OutputText.needs_push)
    logprobs: bool  # some row asked for logprobs
    uploaded: bool = False  # the device slot ids hold this plan's only chunk

    @classmethod
    def build(cls, rows: list[Request], buckets: Sequence[int], max_seq_len: int,
              has_mask) -> BatchPlan:  # fmt: skip
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
            eos_stops=np.array([not r.params.ignore_eos for r in rows], dtype=bool),
            mask_rows=[i for i, r in enumerate(rows) if has_mask(r.slot)],
            has_text=np.array([r.text is not None for r in rows], dtype=bool),
            text_slow=np.array(
                [r.text is not None and r.text.needs_push for r in rows], dtype=bool
            ),  # fmt: skip
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


def finish_rows(plan: BatchPlan, host, eos: np.ndarray, masks, errors: dict[int, str],
                plain: list | None = None) -> tuple[StepOutputs, list]:  # fmt: skip
    """Advance the plan's counters by the step's host outputs and decide who ends.

    `host` is a SamplerOutput on the host whose first n rows belong to the plan's rows.
    `plain`: the tokenizer's `plain_texts` and a bool array of where they exist; a row
    whose text needs no decoder gets its token's plain text when its output is read.
    Returns the step's outputs and the rows that finished (the caller releases them).
    """
    n = len(plan.rows)
    toks = host.token_ids[:n].numpy().copy()
    valid = toks >= 0  # the sampler writes a negative id exactly where a row is invalid
    positions = plan.generated.copy()
    plan.generated += valid
    stop = np.isin(toks, eos) & plan.eos_stops  # eos: the tokenizer's EOS ids (maybe none)
    stop_reason: dict[int, str | int] = {}
    for i in plan.own_stops:
        if valid[i] and int(toks[i]) in plan.rows[i].params.stop_token_ids:
            stop[i] = True
            stop_reason[i] = int(toks[i])
    for i in plan.mask_rows:
        if valid[i] and masks.accept(plan.rows[i].slot, int(toks[i])):
            stop[i] = True
    texts = None
    matched = set()  # rows cut at a stop string: nothing held back to flush
    if plain is not None and plan.has_text.any():
        texts = {}
        slow = plan.has_text & valid & (plan.text_slow | ~plain[1][np.maximum(toks, 0)])
        for i in np.flatnonzero(slow).tolist():
            text = plan.rows[i].text
            texts[i], hit = text.push(int(toks[i]), int(plan.generated[i]))
            plan.text_slow[i] = text.needs_push
            if hit:
                matched.add(i)
                if not stop[i]:
                    stop[i] = True
                    stop_reason[i] = text.stop_reason
    done = ~valid | stop | (plan.generated >= plan.limit)
    ended = []
    for i in np.flatnonzero(done).tolist():
        reason = "error" if not valid[i] else "stop" if stop[i] else "length"
        ended.append(Finished(i, reason))
        if texts is not None and i in texts and i not in matched:
            texts[i] += plan.rows[i].text.flush()
    lp = None
    if plan.logprobs:
        lp = tuple(getattr(host, f)[:n].clone()
                   for f in ("logprobs", "ranks", "top_token_ids", "top_logprobs"))  # fmt: skip
    outs = StepOutputs(plan.rows, plan.chunks, toks, positions,
                       {f.row: f.reason for f in ended}, lp)  # fmt: skip
    outs._texts, outs._stop_reasons, outs._errors = texts, stop_reason, errors
    if texts is not None:
        outs._plain, outs._has_text = plain[0], plan.has_text.copy()
    return outs, ended


class StepOutputs(Sequence[RequestOutput]):
    """One step's outputs: first the ones that were waiting (`ready`: aborts, failed
    prefills), then one per decode row. Decode rows are held as columns and each
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
        self._texts: dict[int, str] | None = None  # row -> its token's text (slow rows)
        self._plain: list | None = None  # id -> plain text, for the other text rows
        self._has_text = None
        self._stop_reasons: dict[int, str | int] = {}
        self._errors: dict[int, str] = {}

    @property
    def row_request_ids(self) -> list[str]:
        return [r.request_id for r in self._rows]

    def __len__(self) -> int:
        return len(self.ready) + len(self._rows)

    def _key(self, i: int) -> GraphKey | None:
        for key, start, n in self._chunks:
            if start <= i < start + n:
                return key
        return None

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
        code = int(self.row_token_ids[i])
        if code < 0:  # nothing was sampled
            msg = error_message(code, i, self._chunks, self._errors)
            return RequestOutput(req.request_id, None, pos, seed, finished=True,
                                 finish_reason="error", message=msg, key=self._key(i))  # fmt: skip
        lp = rank = top = None
        k = req.params.logprobs
        if k is not None:
            lps, ranks, top_ids, top_lps = self._lp
            lp, rank = float(lps[i]), int(ranks[i])
            top = list(zip(top_ids[i, :k].tolist(), top_lps[i, :k].tolist(), strict=True))
        return RequestOutput(req.request_id, code, pos, seed, lp, rank, top, reason is not None,
                             reason, key=self._key(i), text=self._text(i, code),
                             stop_reason=self._stop_reasons.get(i),
                             prompt_logprobs=req.prompt_logprobs if pos == 0 else None)  # fmt: skip

    def _text(self, i: int, tok: int) -> str | None:
        if self._texts is None or not self._has_text[i]:
            return None
        t = self._texts.get(i)
        return self._plain[tok] if t is None else t

    def __iter__(self) -> Iterator[RequestOutput]:
        yield from self.ready
        if not self._rows:
            return
        toks, pos = self.row_token_ids.tolist(), self._positions.tolist()
        keys = [key for key, _, n in self._chunks for _ in range(n)] or [None] * len(toks)
        skip = len(self.ready)
        for i, req in enumerate(self._rows):
            p = req.params
            if (
                toks[i] < 0
                or p.logprobs is not None
                or i in self._reasons
                or (pos[i] == 0 and req.prompt_logprobs is not None)
            ):
                yield self[skip + i]  # the full path: logprobs, an end
            else:
                yield RequestOutput(req.request_id, toks[i], pos[i], p.seed, key=keys[i],
                                    text=self._text(i, toks[i]))  # fmt: skip
