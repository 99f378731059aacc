"""The requests of one executor on the stepping thread: running, prefilling, ended.

At the start of a step `drain` takes the commands queued since the last one (host
bookkeeping only): each admitted request gets its slots (staged writes) and its prompt
joins the step's prefill (`engine.prefill`); aborts release their slots. A request's
counters (generated, limit, in flight) live in `SlotCounters` by slot, which the step
plans read; a released slot's epoch moves on, so a step still in flight drops its row.
"""

from __future__ import annotations

import logging

import numpy as np

from graphexec.engine.finish import Finished
from graphexec.engine.inbox import Aborted, Admit, RequestQueue
from graphexec.engine.plan import BatchPlan, SlotCounters
from graphexec.engine.prefill import Pending, Prefiller
from graphexec.engine.slots import SlotTable
from graphexec.params import variant_rank
from graphexec.request import Request, RequestOutput
from graphexec.text.output_text import OutputText

log = logging.getLogger(__name__)


class Requests:
    """Running, prefilling and ended requests (see the module docstring).

    Args:
        queue: the thread-safe `RequestQueue` the callers write to.
        slots, masks: the slot table and token masks each request takes a row of.
        prefiller: the pending prompts and the per-step prefill.
        buckets, max_seq_len: what a plan is cut into, and the token limit.
        eos_token_ids: ids that stop a request unless ignore_eos.
        tokenizer: detokenises outputs when given (None: no text).
        drafter: the speculative `Drafter` (keeps n-gram histories), or None.
    """

    def __init__(self, queue: RequestQueue, slots: SlotTable, masks, prefiller: Prefiller,
                 buckets, max_seq_len: int, eos_token_ids: tuple[int, ...], tokenizer=None,
                 drafter=None) -> None:  # fmt: skip
        self.queue, self.slots, self.masks, self.prefiller = queue, slots, masks, prefiller
        self.buckets, self.max_seq_len = buckets, max_seq_len
        self.eos_token_ids, self.tokenizer, self.drafter = eos_token_ids, tokenizer, drafter
        self.running: dict[str, Request] = {}
        self.counters = SlotCounters.allocate(slots.max_slots + 1)
        self.admitted = 0
        self._ends: list[RequestOutput] = []  # ends waiting to be reported
        self._plan: BatchPlan | None = None

    @property
    def num_running(self) -> int:
        return len(self.running) + sum(len(p.reqs) for p in self.prefiller.pending)

    @property
    def idle(self) -> bool:
        return (not self.running and not self._ends and self.queue.empty
                and not self.prefiller.pending)  # fmt: skip

    # ---- admission and aborts ----------------------------------------------------------
    def drain(self) -> list[RequestOutput]:
        """Run the commands queued since the last step; the ends waiting to be reported."""
        for c in self.queue.take():
            if isinstance(c, Admit):
                if c.ids:
                    self._admit(c)
            elif isinstance(c, Aborted):
                self._ends.append(RequestOutput(c.request_id, None, 0, c.seed, finished=True,
                                                finish_reason="abort"))  # fmt: skip
            else:
                for rid in c.ids:
                    self._abort(rid)
        ends, self._ends = self._ends, []
        return ends

    def _abort(self, rid: str) -> None:
        req = self.running.get(rid)
        hit = None if req is not None else self.prefiller.find(rid)
        if req is None and hit is None:
            return  # it ended meanwhile: a no-op
        req = req or hit[1]
        pos = int(self.counters.generated[req.slot])  # its first unreported position
        if hit is None:
            self.release(req)  # a step still in flight drops its row
        else:  # still prefilling
            self.prefiller.drop(*hit)
            self._free_slot(req)
        self._ends.append(RequestOutput(rid, None, pos, req.params.seed, finished=True,
                                        finish_reason="abort"))  # fmt: skip

    def _admit(self, c: Admit) -> None:
        """Give each stream of `c` a slot (staged: written at the next flush) and queue its
        prompt for the step's prefill."""
        reqs = []
        for i, rid in enumerate(c.ids):
            p = c.stream_params(i)
            slot = self.slots.assign(p, c.prompt, c.min_ids)
            eos = () if p.ignore_eos else self.eos_token_ids
            req = Request(rid, p, slot, len(c.prompt), frozenset(p.stop_token_ids) | frozenset(eos),
                          variant_rank(p))  # fmt: skip
            if self.tokenizer is not None:
                req.text = OutputText(
                    self.tokenizer,
                    stop=p.stop,
                    include_stop=p.include_stop_str_in_output,
                    min_tokens=p.min_tokens,
                    skip_special_tokens=p.skip_special_tokens,
                )
            room = self.max_seq_len - len(c.prompt)
            self.counters.start(slot, min(p.max_tokens, room),
                                req.text is not None and req.text.needs_push)  # fmt: skip
            self.masks.add(slot, p, c.bad_words)
            if self.drafter is not None:
                self.drafter.admit(req, c.prompt, self.masks.has(slot))
            reqs.append(req)
        self.prefiller.add(Pending(reqs, c.prompt, c.params.prompt_logprobs))

    # ---- the plan and the ends ----------------------------------------------------------
    def plan(self) -> BatchPlan:
        """The step plan of the running requests that may still emit a token past those
        in flight (built when they changed)."""
        plan, launchable = self._plan, self.counters.launchable
        if plan is not None and not launchable(plan.slots).all():
            plan = None  # a row's last token may be in flight: it is not launched again
        if plan is not None and plan.waiting.size and launchable(plan.waiting).any():
            plan = None  # a row left out has room again (its speculative run was short)
        if plan is None:
            rows = list(self.running.values())
            waiting = np.zeros(0, dtype=np.int64)
            if rows:
                slots = np.array([r.slot for r in rows])
                ok = launchable(slots)
                rows = [r for r, go in zip(rows, ok.tolist(), strict=True) if go]
                waiting = slots[~ok]
            plan = self._plan = BatchPlan.build(rows, self.buckets, self.counters,
                                                self.masks.has)  # fmt: skip
            plan.waiting = waiting
        return plan

    def retire_plan(self) -> None:
        """Requests came or went (or the device slot ids changed): rebuild the plan at the
        next step."""
        self._plan = None

    def end(self, plan: BatchPlan, ended: list[Finished]) -> None:
        """Release the rows of `plan` that finished this step."""
        for f in ended:
            self.release(plan.rows[f.row])

    def release(self, req: Request) -> None:
        self.retire_plan()
        del self.running[req.request_id]
        self._free_slot(req)

    def _free_slot(self, req: Request) -> None:
        self.counters.end(req.slot)
        self.slots.release(req.slot)
        self.masks.remove(req.slot)
        self.queue.ended(req.request_id)

    # ---- prefill -------------------------------------------------------------------------
    def prefill(self) -> list[RequestOutput]:
        """Flush the staged slot writes and run the step's prefill; completed prompts
        join the decode rows. The ends of requests whose prefill failed."""
        self.slots.flush()
        self.masks.write_static(self.slots)  # (after the flush that reset their rows)
        if not self.prefiller.pending:
            return []
        res = self.prefiller.run()
        outs = []
        for p, why in res.failed:
            for r in p.reqs:
                self._free_slot(r)
                outs.append(RequestOutput(r.request_id, None, 0, r.params.seed, finished=True,
                                          finish_reason="error", message=why))  # fmt: skip
        if res.complete:
            self._plan = None  # rebuilt with them at the next plan
            for p in res.complete:
                for r in p.reqs:
                    self.running[r.request_id] = r
                    self.admitted += 1
        return outs
