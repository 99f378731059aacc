"""Prefill inside the step: the prompts admitted since the last step, in one ragged batch.

A request's prompt of n tokens is split: its first n - 1 tokens are *prefilled* here
(into the KV state of its slot), and its last token is the input of its first *decode
row*, so the first output token is drawn by the step's own sampler launch, beside the
other decode rows, from the logits of the prompt's last position (same seed, output
position 0). A request whose prompt is one token needs no prefill at all.

Per step, `Prefiller.run` takes the pending prompts first come first served and cuts
them to a token budget (`prefill_budget`): every prompt that fits is prefilled whole and
a longer one continues from where it stopped at the next step (a *chunk*), so a running
stream never waits for more than one budget's worth of prefill. All chunks of a step go
through the model in one `prefill_batch` call (a model without it gets one `prefill`
per prompt, unchunked). A request with n streams is prefilled once into its first
stream's slot and copied to the others (`fork`) when complete. A drafter's state (a draft
model, or the n-gram history) is prefilled with the same batch.

The executor runs it after launching the step's decode graphs, so the host time spent
launching the prefill overlaps the device's decode (`DecodeExecutor._step`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from graphexec.models.protocol import PrefillBatch, check_logits
from graphexec.request import PromptLogprob, Request
from graphexec.sampling.processing import collapse_inf
from graphexec.sampling.reference import log_softmax_rows

log = logging.getLogger(__name__)


@dataclass
class Pending:
    """A request whose prompt is not yet in its slots' state.

    reqs: its streams (one unless n > 1); reqs[0]'s slot receives the prefill.
    done: prompt tokens prefilled so far (of the n - 1 that need it).
    lp_rows: with prompt_logprobs, the logits rows [k, V] of each chunk, in order.
    """

    reqs: list[Request]
    prompt: list[int]
    logprobs: int | None  # params.prompt_logprobs
    done: int = 0
    lp_rows: list[torch.Tensor] = field(default_factory=list)

    @property
    def todo(self) -> int:
        return len(self.prompt) - 1 - self.done

    def restart(self) -> None:
        """The slot holding the partial prefill was given up: begin again."""
        self.done = 0
        self.lp_rows = []


@dataclass
class PrefillResult:
    complete: list[Pending]  # prompts now fully in their slots: they decode next
    failed: list[tuple[Pending, str]]  # (prompt, why): their requests end with "error"


class Prefiller:
    """Pending prompts and the per-step prefill (see the module docstring).

    Args:
        model: the target `DecodeModel`.
        budget: prompt tokens prefilled per step (>= 1).
        vocab_size: V (prompt logprobs drop a padded model's extra columns).
        device: where the batch's tensors go.
        draft: a drafter's state prefilled with the same batches (a draft model, or the
            n-gram drafter's device history), or None.
    """

    def __init__(self, model, budget: int, vocab_size: int, device: torch.device,
                 draft=None) -> None:  # fmt: skip
        self.model = model
        self.budget = budget
        self.vocab_size = vocab_size
        self.device = device
        self.draft = draft
        # chunks need prefill_batch in every model the batch goes through
        self.chunked = _chunks(model) and (draft is None or _chunks(draft))
        self.pending: list[Pending] = []
        self._logprobs_due: list[Pending] = []  # complete, prompt logprobs not yet read

    def __len__(self) -> int:
        return len(self.pending)

    def add(self, p: Pending) -> None:
        self.pending.append(p)

    def find(self, request_id: str) -> tuple[Pending, Request] | None:
        for p in self.pending:
            for r in p.reqs:
                if r.request_id == request_id:
                    return p, r
        return None

    def drop(self, p: Pending, req: Request) -> None:
        """Remove an aborted stream (the caller frees its slot)."""
        if p.reqs[0] is req:
            p.restart()  # its slot held the partial prefill
        p.reqs.remove(req)
        if not p.reqs:
            self.pending.remove(p)

    def run(self) -> PrefillResult:
        """Prefill this step's chunks; the prompts it completed or failed."""
        ready = [p for p in self.pending if p.todo == 0]
        take: list[tuple[Pending, int]] = []  # (prompt, tokens this step)
        left = self.budget
        for p in self.pending:
            if p.todo and left > 0:
                k = min(p.todo, left) if self.chunked else p.todo
                take.append((p, k))
                left -= k
        failed = []
        try:
            self._prefill(take)
        except Exception:  # one bad prompt must not end the others: each alone again
            ok = []
            for p, k in take:
                try:
                    self._prefill([(p, k)])
                    ok.append((p, k))
                except Exception as e:
                    log.exception("prefill of %s failed", [r.request_id for r in p.reqs])
                    failed.append((p, f"prefill failed: {type(e).__name__}: {e}"))
            take = ok
        ready += [p for p, _ in take if p.todo == 0]
        gone = {id(p) for p in ready} | {id(p) for p, _ in failed}
        self.pending = [p for p in self.pending if id(p) not in gone]
        for p in ready:
            self._complete(p)
        return PrefillResult(ready, failed)

    def _prefill(self, take: list[tuple[Pending, int]]) -> None:
        """Run `take` through the model; chunk progress is recorded only on success."""
        if not take:
            return
        if not self.chunked:
            for p, _ in take:
                self._prefill_one(p)
            return
        segments, rows = [], []
        n = 0
        for p, k in take:
            segments.append((p.reqs[0].slot, p.done, p.prompt[p.done : p.done + k]))
            if p.logprobs is not None:
                rows += range(n, n + k)
            n += k
        batch = PrefillBatch.build(segments, self.device, rows or None)
        logits = self.model.prefill_batch(batch)
        if self.draft is not None:
            self.draft.prefill_batch(batch)
        if rows:
            logits = check_logits(logits, (len(rows), self.model.vocab_size), self.model,
                                  "prefill_batch")  # fmt: skip
        at = 0
        for p, k in take:
            if p.logprobs is not None:
                p.lp_rows.append(logits[at : at + k, : self.vocab_size])
                at += k
            p.done += k

    def _prefill_one(self, p: Pending) -> None:
        """A model without prefill_batch: the whole prompt in one `prefill` call."""
        ids = torch.tensor(p.prompt[:-1], dtype=torch.int64)
        slot, m = p.reqs[0].slot, self.model
        if p.logprobs is None:
            m.prefill(slot, ids)
        else:
            rows = check_logits(m.prefill(slot, ids, all_logits=True), (len(ids), m.vocab_size),
                                m, "prefill")  # fmt: skip
            p.lp_rows.append(rows[:, : self.vocab_size])
        if self.draft is not None:
            self.draft.prefill(slot, ids)
        p.done = len(ids)

    def _complete(self, p: Pending) -> None:
        """Copy the prefilled state to the other streams; prompt logprobs are read later
        (`report_logprobs`), after the step's one wait."""
        n = len(p.prompt) - 1
        src = p.reqs[0].slot
        for r in p.reqs[1:]:
            for m in (self.model, self.draft):
                if m is None or n == 0:
                    continue
                if hasattr(m, "fork"):
                    m.fork(src, r.slot, n)
                else:
                    m.prefill(r.slot, torch.tensor(p.prompt[:-1], dtype=torch.int64))
        if p.logprobs is not None:
            self._logprobs_due.append(p)

    def report_logprobs(self) -> None:
        """Give the requests completed since the last call their prompt logprobs (a host
        read of their logits rows: the executor calls it after the step's wait)."""
        for p in self._logprobs_due:
            rows = torch.cat(p.lp_rows) if p.lp_rows else None
            lp = prompt_logprobs(rows, p.prompt, p.logprobs)
            p.lp_rows = []
            for r in p.reqs:
                r.prompt_logprobs = lp
        self._logprobs_due = []


def _chunks(model) -> bool:
    return getattr(model, "prefill_batch", None) is not None


def prompt_logprobs(rows: torch.Tensor | None, prompt: list[int], n: int) -> list:
    """[None] + one `PromptLogprob` per prompt token after the first, from the logits
    rows [len(prompt) - 1, V] of the prompt's first tokens (row i predicts token i + 1):
    raw log_softmax in float32 as the sampler computes it, rank 1 = most likely, top-n
    with ties to the lower id.
    Read on the host: only for requests that ask, after the step has waited."""
    out: list[PromptLogprob | None] = [None]
    if rows is None or len(prompt) < 2:
        return out
    # the sampler's raw logprobs (sampling.reference.log_softmax_rows, as write_logprobs),
    # so a prompt token's logprob is the bits decoding it reports on the torch backend
    v = collapse_inf(rows.float().cpu())
    lp, m, lse = log_softmax_rows(v)
    nxt = torch.tensor(prompt[1:], dtype=torch.int64)
    tok_lp = lp.gather(1, nxt.unsqueeze(1)).squeeze(1)
    ranks = (v > v.gather(1, nxt.unsqueeze(1))).sum(dim=1) + 1
    top_lp = top_id = None
    if n:
        sv, si = torch.sort(v, dim=1, descending=True, stable=True)
        top_lp, top_id = ((sv[:, :n] - m) - lse).tolist(), si[:, :n].tolist()
    for i, t in enumerate(prompt[1:]):
        top = list(zip(top_id[i], top_lp[i], strict=True)) if n else []
        out.append(PromptLogprob(t, float(tok_lp[i]), int(ranks[i]), top))
    return out
