"""After the wait: a step's runs become outputs, and the stop checks decide who ends.

Every row of a step emitted a run of 0..T tokens (T = spec_k + 1; ordinary decoding is
T = 1): its token ids in pinned host rows, -1 after the run, and a negative code at
offset 0 where it has none (`sampling.flags`). Stop checks run on whole columns: EOS and
a row's own stop ids, and the token limit; only rows with a token mask (the matcher
accepts each token) or text that needs the decoder go token by token, in position
order. A stop inside a run truncates it there and finishes the request. Outputs are
held as columns and each `RequestOutput` is built when it is read, so a step does no
per-row Python work for rows that just continue.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from graphexec.engine.plan import BatchPlan
from graphexec.request import GraphKey, RequestOutput
from graphexec.sampling.flags import error_message

LOGPROB_FIELDS = ("logprobs", "ranks", "top_token_ids", "top_logprobs")


@dataclass
class Finished:
    row: int
    reason: str  # "stop", "length", "error"


def gather_runs(plan: BatchPlan, keys: list, host: dict) -> tuple[np.ndarray, tuple | None]:
    """(token ids [n, T] (a copy), logprob columns or None) of the plan's rows from the
    host rows of each chunk's run length (`host`: T -> HostRuns)."""
    n = len(plan.rows)
    ts = {k.spec_k + 1 for k, _, _ in keys}
    if len(ts) == 1:  # one run length: its rows as they are
        t = ts.pop()
        h = host[t]
        toks = h.token_ids[:n, :t].numpy().copy()
        if not plan.logprobs:
            return toks, None
        return toks, tuple(getattr(h, f)[:n, :t].numpy().copy() for f in LOGPROB_FIELDS)
    t = max(ts)
    toks = np.full((n, t), -1, dtype=np.int64)
    lp = None
    if plan.logprobs:
        cols = [getattr(host[t], f).numpy() for f in LOGPROB_FIELDS]
        lp = tuple(np.zeros((n, t) + c.shape[2:], dtype=c.dtype) for c in cols)
    for key, start, m in keys:
        h, k = host[key.spec_k + 1], key.spec_k + 1
        toks[start : start + m, :k] = h.token_ids[start : start + m, :k].numpy()
        for dst, f in zip(lp or (), LOGPROB_FIELDS, strict=False):
            dst[start : start + m, :k] = getattr(h, f)[start : start + m, :k].numpy()
    return toks, lp


def chunk_at(chunks, row: int) -> tuple[GraphKey | None, int]:
    """(key, first row) of the chunk [(key, first row, rows)] that holds `row`."""
    for key, start, n in chunks:
        if start <= row < start + n:
            return key, start
    return None, 0


def _isin(a: np.ndarray, values: Sequence[int]) -> np.ndarray:
    """np.isin for the few values of a stop list, without its per-call cost."""
    if not 0 < len(values) <= 8:
        return np.isin(a, list(values))
    hit = a == values[0]
    for v in values[1:]:
        hit |= a == v
    return hit


@dataclass
class Runs:
    """A collected step's runs, before the stop checks: token ids [n, T] (-1 past a run),
    logprob columns or None, the rows still live, each row's reported tokens before the
    step (its first position), its run's length, the tokens it could still emit, and the
    tokens it goes on with: its run up to its limit (0 for a dead row; a stop inside the
    run reports fewer, but that row ends)."""

    toks: np.ndarray
    lp: tuple | None
    alive: np.ndarray
    gen: np.ndarray
    ntok: np.ndarray
    room: np.ndarray
    counts: np.ndarray


def collect(plan: BatchPlan, keys: list, host: dict, inflight: np.ndarray | int = 1) -> Runs:
    """The step's runs from the host rows, and the plan's counters advanced by them (and
    released of the step's `inflight` tokens, as it launched them): all the next launch
    needs, before any stop check. A row that stops inside its run advances past the
    stop, but it ends at `finish`."""
    toks, lp = gather_runs(plan, keys, host)
    alive, gen = plan.live(), plan.generated
    room = plan.limit - gen  # tokens each live row may still emit (>= 1)
    ntok = (toks >= 0).cumprod(1).sum(1)  # the run's length; 0: no token
    counts = np.where(alive, np.minimum(ntok, room), 0)
    plan.collected(alive, counts, inflight)
    return Runs(toks, lp, alive, gen, ntok, room, counts)


def finish(plan: BatchPlan, runs: Runs, keys: list, eos: Sequence[int], masks,
           errors: dict[int, str], plain=None) -> tuple[StepOutputs, list[Finished]]:  # fmt: skip
    """Decide who ends among the `collect`ed runs of the plan's step.

    keys: the step's chunks [(key, first row, rows)] as launched; eos: the ids that stop
    rows with eos_stops; errors: chunk start -> why its step raised; plain: the
    tokenizer's `plain_texts` and a bool array of where they exist (a row whose tokens
    need no decoder gets their plain texts when read).
    Rows whose request ended since the launch (`plan.live`) report nothing: under the
    pipelined step a row that stopped at step N ran once more in N + 1, and an abort may
    come while its step is in flight.
    Returns the step's outputs and the rows that finished (the caller releases them)."""
    toks, lp, alive, gen, ntok, room = (runs.toks, runs.lp, runs.alive, runs.gen, runs.ntok,
                                        runs.room)  # fmt: skip
    n, t = toks.shape
    live = toks >= 0
    # ids are >= 0, so the -1 past a run (or a code at 0) never matches a stop id
    stop = _isin(toks, eos)
    stop &= plan.eos_stops[:, None]
    for i in plan.own_stops:
        stop[i] |= _isin(toks[i], plan.rows[i].params.stop_token_ids)
    hit = stop.any(1)
    count = runs.counts.copy()  # reported (a stop in the run: below)
    todo = (hit | (count == room) | (ntok == 0)) & alive
    texts: dict[int, str] | None = None  # row * T + offset -> its pushed text
    slow = None  # rows walked token by token: a mask's matcher, or text to decode
    if plain is not None and plan.has_text.any():
        texts = {}
        odd = (~plain[1][np.maximum(toks, 0)] & live).any(1)
        slow = plan.has_text & (plan.text_slow | odd) & alive
    if plan.mask_rows:
        slow = np.zeros(n, dtype=bool) if slow is None else slow
        slow[plan.mask_rows] = alive[plan.mask_rows]
    reasons: dict[int, str] = {}
    stop_reasons: dict[int, str | int] = {}
    messages: dict[int, str] = {}
    for i in np.flatnonzero(todo if slow is None else todo | slow).tolist():
        if ntok[i] == 0:
            reasons[i] = "error"
            messages[i] = error_message(int(min(toks[i, 0], -1)), errors.get(chunk_at(keys, i)[1]))
            continue
        if slow is not None and slow[i]:
            count[i], reason, why = _walk(plan, i, int(gen[i]), toks[i], int(ntok[i]), stop[i],
                                          int(room[i]), masks, texts, plain)  # fmt: skip
        else:
            if hit[i]:
                count[i] = min(count[i], int(stop[i].argmax()) + 1)
            reason, why = ("stop" if stop[i, count[i] - 1] else "length"), None
        if reason is None:
            continue
        reasons[i] = reason
        last = int(toks[i, count[i] - 1])
        if why is None and reason == "stop" and last in plan.rows[i].params.stop_token_ids:
            why = last
        if why is not None:
            stop_reasons[i] = why
    for i in messages:
        count[i] = 1  # its error output
    outs = StepOutputs(plan.rows, keys, toks, count, gen, reasons, lp)
    outs._texts, outs._stop_reasons, outs._messages = texts, stop_reasons, messages
    outs._lengths = np.where(alive, ntok, 0)  # a dead row emitted nothing that counts
    if texts is not None:
        outs._plain, outs._has_text = plain[0], plan.has_text.copy()
    return outs, [Finished(i, r) for i, r in sorted(reasons.items())]


def _walk(plan, i, pos0, toks, ntok, stop, room, masks, texts, plain):
    """Row i's run token by token from output position `pos0` (its mask's matcher, its
    text): (tokens reported, reason or None, stop reason or None)."""
    req = plan.rows[i]
    has_mask = masks.has(req.slot)
    text = req.text if texts is not None else None
    t, text_slow = len(toks), plan.counters.text_slow
    for j in range(ntok):
        tok = int(toks[j])
        hit = pushed = False
        if text is not None and (text_slow[req.slot] or not plain[1][tok]):
            texts[i * t + j], hit = text.push(tok, pos0 + j + 1)
            text_slow[req.slot] = text.needs_push
            pushed = True
        reason = why = None
        if stop[j]:
            reason = "stop"
        elif has_mask and masks.accept(req.slot, tok):
            reason = "stop"
        elif hit:
            reason, why = "stop", text.stop_reason
        elif j + 1 >= room:
            reason = "length"
        if reason is not None:
            if pushed and not hit:
                texts[i * t + j] += text.flush()
            return j + 1, reason, why
    return ntok, None, None


class StepOutputs(Sequence[RequestOutput]):
    """One step's outputs: first the ones that were waiting (`ready`: aborts, failed
    prefills), then each decode row's run, token by token in position order. Runs are
    held as columns and each `RequestOutput` is built when it is read. Engines that want
    columns read `row_request_ids` / `row_token_ids` (numpy [n] for one-token runs, else
    [n, T]; -1 where there is no token) for the decode rows."""

    def __init__(self, rows=(), chunks=(), toks=None, counts=None, positions=None,
                 reasons=None, logprobs=None) -> None:  # fmt: skip
        self.ready: list[RequestOutput] = []
        self._rows = rows
        self._chunks = chunks
        self._toks = toks
        self._counts = counts
        self._positions = positions
        self._reasons = reasons or {}
        self._lp = logprobs
        self._texts: dict[int, str] | None = None  # row * T + j -> its pushed text
        self._plain: list | None = None  # id -> plain text, for the other text rows
        self._has_text = None
        self._stop_reasons: dict[int, str | int] = {}
        self._messages: dict[int, str] = {}
        self._lengths = None  # [n] tokens each row's run emitted (0: none), before stops
        # the one-token fast path only where every row reports exactly one output (a row
        # of 0 is a token dropped: its request ended meanwhile)
        single = toks is None or (toks.shape[1] == 1 and bool((counts == 1).all()))
        self._starts = None if single else np.cumsum(counts) - counts
        self._total = 0 if toks is None else int(counts.sum())

    @property
    def row_request_ids(self) -> list[str]:
        return [r.request_id for r in self._rows]

    @property
    def row_token_ids(self) -> np.ndarray | None:
        if self._toks is None:
            return None
        if self._toks.shape[1] == 1:
            return np.where(self._counts > 0, self._toks[:, 0], -1)
        keep = np.arange(self._toks.shape[1]) < self._counts[:, None]
        return np.where(keep, self._toks, -1)

    def __len__(self) -> int:
        return len(self.ready) + self._total

    def __getitem__(self, k):  # type: ignore[override]
        if isinstance(k, slice):
            return [self[j] for j in range(*k.indices(len(self)))]
        if k < 0:
            k += len(self)
        if not 0 <= k < len(self):
            raise IndexError(k)
        if k < len(self.ready):
            return self.ready[k]
        k -= len(self.ready)
        if self._starts is None:
            return self._output(k, 0)
        i = int(np.searchsorted(self._starts, k, side="right")) - 1
        return self._output(i, k - int(self._starts[i]))

    def _output(self, i: int, j: int) -> RequestOutput:
        """Row i's output at offset j of its run."""
        req = self._rows[i]
        pos, seed, key = int(self._positions[i]) + j, req.params.seed, chunk_at(self._chunks, i)[0]
        last = j == self._counts[i] - 1
        if i in self._messages:
            msg = self._messages[i]
            return RequestOutput(req.request_id, None, pos, seed, finished=True,
                                 finish_reason="error", message=msg, key=key)  # fmt: skip
        code = int(self._toks[i, j])
        reason = self._reasons.get(i) if last else None
        lp = rank = top = None
        k = req.params.logprobs
        if k is not None:
            lps, ranks, top_ids, top_lps = self._lp
            lp, rank = float(lps[i, j]), int(ranks[i, j])
            top = list(zip(top_ids[i, j, :k].tolist(), top_lps[i, j, :k].tolist(), strict=True))
        return RequestOutput(req.request_id, code, pos, seed, lp, rank, top, reason is not None,
                             reason, key=key, text=self._text(i, j, code),
                             stop_reason=self._stop_reasons.get(i) if last else None,
                             prompt_logprobs=req.prompt_logprobs if pos == 0 else None)  # fmt: skip

    def _text(self, i: int, j: int, tok: int) -> str | None:
        if self._texts is None or not self._has_text[i]:
            return None
        t = self._texts.get(i * self._toks.shape[1] + j)
        return self._plain[tok] if t is None else t

    def __iter__(self) -> Iterator[RequestOutput]:
        yield from self.ready
        if self._toks is None:
            return
        keys = [key for key, _, n in self._chunks for _ in range(n)]
        if self._starts is None:  # one token per row
            texts, plain, reasons = self._texts, self._plain, self._reasons
            has = self._has_text.tolist() if texts is not None else None
            rows = zip(self._rows, self._toks[:, 0].tolist(), self._positions.tolist(), strict=True)
            for i, (req, tok, pos) in enumerate(rows):
                p = req.params
                if (tok < 0 or p.logprobs is not None or i in reasons
                        or (pos == 0 and req.prompt_logprobs is not None)):  # fmt: skip
                    yield self._output(i, 0)  # the full path: logprobs, an end
                    continue
                text = None
                if has is not None and has[i]:
                    text = texts.get(i)
                    if text is None:
                        text = plain[tok]
                yield RequestOutput(req.request_id, tok, pos, p.seed, key=keys[i], text=text)
            return
        for i, c in enumerate(self._counts.tolist()):
            for j in range(c):
                yield self._output(i, j)
