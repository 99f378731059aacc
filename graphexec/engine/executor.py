"""DecodeExecutor: the decode loop. add_request / step / abort over captured graphs.

A step is a few calls that return values:
  1. admit      the commands queued since the last step (`Requests.drain`): admissions
                take slots (staged writes) and queue their prompts; aborts release slots
  2. launch     step N + 1: each chunk of the plan (`StepRunner.launch`): token masks
                (and drafts) up, slot ids written, its key's graph replayed or its step
                run eagerly, its outputs copied to pinned host memory without blocking,
                an event recorded; a chunk whose step raises ends its requests with "error"
  3. prefill    behind the decode graphs: the staged slot writes flushed, the queued
                prompts prefilled in one ragged batch cut to `prefill_budget` tokens; a
                completed prompt decodes from the next step on (when nothing is
                decoding, this runs first and the new rows decode in this step)
  4. wait       for step N, by its event
  5. finish     step N per row, its run of tokens (`engine.finish`): masks fed, text
                detokenised, stop checks, outputs; finished slots released

The pipelined step (`overlap=True`, the default on CUDA): the decode state lives on the
device, so step N + 1 needs nothing from N's host work but which rows still run, and
`step()` returns N's outputs while N + 1 runs (callers step until `idle`, not a count of calls).
A row whose generated plus in-flight tokens reach its limit is not launched again; a row
that stops at N (EOS, a stop id or string) ran once more in N + 1, and that token is
dropped (`BatchPlan.live`); its slot is freed when N is collected, and the next
occupant's flush is queued after N + 1 on the stream. Speculative steps pipeline the
same way: their drafts are made on the device (`engine.drafts`), and a row's tokens in
flight count as the most its run may hold. A step whose token masks need N's tokens on
the host (grammar, bad words) launches N + 1's forward, collects N, then
writes the masks and launches N + 1's draw (`StepRunner.launch_forward`; with n-gram
speculation the masks of each offset follow the drafts, which the host finds from N's
tokens as the forward did), or, with a draft model, finishes N before the launch.
`overlap=False` collects every step in the call that launched it. Tokens never depend
on it.

Threads: `add_request`, `abort` and the read-only properties are safe from any thread,
also while another thread is inside `step()`: they validate and queue under a lock held
for microseconds. `step()` and `capture()` run on one thread at a time (a concurrent call
raises RuntimeError); every model and device call happens there, and no lock is held
while that thread waits for the GPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections import Counter
from collections.abc import Sequence

import numpy as np

from graphexec.engine.config import EngineConfig
from graphexec.engine.drafts import Drafter
from graphexec.engine.executor_stats import ExecutorStats, StepTiming
from graphexec.engine.finish import Runs, StepOutputs, collect, finish
from graphexec.engine.inbox import RequestCheck, RequestQueue
from graphexec.engine.masks import TokenMasks, grammar_slots
from graphexec.engine.prefill import Prefiller
from graphexec.engine.requests import Requests
from graphexec.engine.runner import Launched, StepRunner, build_sampler
from graphexec.engine.slots import SlotTable
from graphexec.engine.step import StepFn
from graphexec.params import SamplingParams
from graphexec.request import GraphKey
from graphexec.sampling.pipeline import default_backend


class DecodeExecutor:
    """Runs the decode loop of up to `max_batch_size` requests (threads: module docstring).

    Args:
        model: a `graphexec.models.DecodeModel`; the executor calls `model.bind`.
        config: an `EngineConfig`; keyword arguments of the same names override its fields
            (`DecodeExecutor(model, max_batch_size=64, tokenizer=tok)` works alone).
        tokenizer: a `graphexec.Tokenizer`; needed for grammars, stop strings and bad words
            given as text; each of its `eos_token_ids` stops requests (unless ignore_eos).
    """

    def __init__(self, model, config: EngineConfig | None = None, *, tokenizer=None,
                 **options) -> None:  # fmt: skip
        cfg = dataclasses.replace(config or EngineConfig(), **options)
        self.config = cfg
        self.device = device = cfg.torch_device
        self.model, self.tokenizer = model, tokenizer
        self.vocab_size = v = cfg.vocab_for(model, tokenizer)
        self.max_batch_size, self.buckets = cfg.max_batch_size, cfg.graph_buckets
        self.cuda_graphs = cfg.cuda_graphs
        self.backend = cfg.backend or default_backend(device)
        self.detokenize = bool(cfg.detokenize) and tokenizer is not None
        tp = None
        if cfg.tp_group is not None:
            from graphexec.distributed import for_executor

            tp = for_executor(cfg.tp_group, cfg.tp_method, model, v, cfg.speculative)
        n, runs = cfg.max_batch_size, cfg.runs
        self.slots = SlotTable(n, v, device, cfg.max_logit_bias, offsets=runs,
                               max_min_ids=cfg.max_min_ids)  # fmt: skip
        model.bind(n + 1, device)
        grammar = grammar_slots(tokenizer, v, n, runs)
        self.masks = TokenMasks(v, n, runs, grammar)
        self.eos_token_ids: tuple[int, ...] = () if tokenizer is None else tokenizer.eos_token_ids
        self.eos_token_id = None if tokenizer is None else tokenizer.eos_token_id
        self._plain = None  # (Tokenizer.plain_texts, where they exist): the text fast path
        if self.detokenize:
            texts = tokenizer.plain_texts
            texts = texts + [None] * (v - len(texts))
            self._plain = (texts, np.array([t is not None for t in texts], dtype=bool))
        largest = self.buckets[-1]
        spec = cfg.speculative
        self.drafter = None if spec is None else Drafter(spec, model, self.slots, device, n,
                                                         largest)  # fmt: skip
        sampler = build_sampler(self.backend, device, largest * runs, v, cfg.sampler_config, tp,
                                cfg.tp_method, spec is not None)  # fmt: skip
        draft, history = (self.drafter.draft, self.drafter.history) if spec else (None, None)
        step = StepFn(model, self.slots, sampler, draft, history,
                      spec.verify if spec else "strict", self.device.type == "cuda")  # fmt: skip
        self.runner = StepRunner(step, self.masks, self.buckets, n, device, self.drafter,
                                 cfg.blocking_wait)  # fmt: skip
        self.prefiller = Prefiller(model, cfg.prefill_budget, v, device,
                                   self.drafter.prefilled if self.drafter else None)
        self._queue = RequestQueue(n, cfg.seed)  # shared with other threads
        self._check = RequestCheck(v, model.max_seq_len, cfg.max_logit_bias,
                                   self.slots.min_words.shape[1], tokenizer, self.detokenize,
                                   grammar.compiler if grammar else None, self.eos_token_ids,
                                   tp is not None)  # fmt: skip
        self.requests = Requests(self._queue, self.slots, self.masks, self.prefiller,
                                 self.buckets, model.max_seq_len, self.eos_token_ids,
                                 tokenizer if self.detokenize else None,
                                 self.drafter)  # fmt: skip
        self.overlap = cfg.overlap if cfg.overlap is not None else device.type == "cuda"
        self.last_step_timing = StepTiming()
        self._inflight: Launched | None = None  # the step launched and not yet collected
        self._steps = 0
        self._stepping = threading.Lock()

    # ---- public state ----------------------------------------------------------------
    @property
    def free_slots(self) -> int:
        """How many more requests (streams) `add_request` accepts now."""
        return self._queue.free

    @property
    def num_running(self) -> int:
        """Requests (streams) holding a slot: decoding, or with their prompt still being
        prefilled."""
        return self.requests.num_running

    @property
    def idle(self) -> bool:
        """Nothing queued, running, in flight, or waiting to be reported."""
        return self.requests.idle and self._inflight is None

    @property
    def graphs(self):  # the `CapturedGraphs` of this executor's keys
        return self.runner.graphs

    @property
    def graph_keys(self) -> list[GraphKey]:
        """The captured keys, largest bucket first: one per distinct graph (a variant
        whose kernels another's graph runs has none: `engine.variants`)."""
        return list(self.runner.graphs.steps)

    @property
    def stats(self) -> ExecutorStats:
        g, d = self.runner.graphs, self.drafter
        return ExecutorStats(
            replays={k: s.replays + g.part_replays(k) for k, s in g.steps.items()},
            eager_steps=Counter(self.runner.eager),
            capture_s={k: s.capture_s for k, s in g.steps.items()},
            failed=dict(g.failed),
            steps=self._steps,
            admitted=self.requests.admitted,
            drafted=d.drafted if d else 0,
            accepted=d.accepted if d else 0,
        )

    @contextlib.contextmanager
    def _step_thread(self):
        if not self._stepping.acquire(blocking=False):
            raise RuntimeError("step() or capture() is already running in another thread; "
                               "one thread drives the loop")  # fmt: skip
        try:
            yield
        finally:
            self._stepping.release()

    def capture(self, keys: Sequence[GraphKey] | None = None, progress: bool = True) -> None:
        """Warm up and capture every key (default: all of them), largest bucket first,
        into one shared pool. A key that fails is logged and served eagerly."""
        if not self.cuda_graphs:
            raise RuntimeError("this executor was built with cuda_graphs=False")
        with self._step_thread():
            if self._inflight is not None:
                self._inflight.wait()  # its graph reads the slot ids about to hold padding
            self.requests.retire_plan()  # the slot ids buffer is about to hold padding
            self.runner.capture(keys, progress)

    # ---- requests (any thread) -------------------------------------------------------
    def add_request(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> None:
        """Validate and queue a request; the next `step()` prefills it, and its tokens
        follow as the steps go (with overlap, each a call after its launch). ValueError
        names the bad field (or says the id is already in use); ExecutorFullError when its
        n streams do not fit (nobody is evicted). With n > 1, stream i reports as request
        id "<request_id>/<i>" with seed `stream_seed(seed, i)`; `abort(request_id)` aborts
        all of them."""
        prompt, bad, min_ids = self._check(request_id, prompt_token_ids, params)
        self._queue.add(request_id, prompt, params, bad, min_ids)

    def abort(self, request_id: str) -> bool:
        """Abort a request (all its streams when n > 1): the next step reports it with
        finish_reason "abort" at the position of its first unreported token (0 when none
        was reported), with no token. True when the abort was queued (the request was
        queued or running); False, a no-op, for any other id: one that has already
        finished (its last output returned by `step()` or not yet) or was never added, as
        vLLM's abort is. Safe to call on a client's disconnect without knowing whether
        the request ended first. ValueError only when `request_id` is not a non-empty
        str."""
        return self._queue.abort(request_id)

    # ---- the step --------------------------------------------------------------------
    def step(self, mode: str | None = None) -> StepOutputs:
        """Admit what was queued, then the outputs of every running request: its next
        tokens (a run of 1..K+1 with speculation), or its end. With `overlap`, the outputs
        of the step the previous call launched (this call's step runs meanwhile).

        mode: None = replay where a graph was captured (eager otherwise); "eager" runs the
        same step function without replay, on the same buffers.
        """
        if mode not in (None, "replay", "eager"):
            raise ValueError(f"mode must be None, 'replay' or 'eager', got {mode!r}")
        with self._step_thread():
            outs = self._step(mode)
            done = [o.request_id for o in outs.ready if o.finished]
            done += [outs._rows[i].request_id for i in outs._reasons]
            if done:
                self._queue.reported(done)
            return outs

    def _step(self, mode: str | None) -> StepOutputs:
        t0 = time.perf_counter()
        reqs = self.requests
        ready = reqs.drain()
        prev, runs, outs = self._inflight, None, None  # step N (its runs, once collected)
        early = late = 0.0  # waits for the device: before the launch, after it (seconds)
        plan = reqs.plan()
        replay = mode != "eager" and self.cuda_graphs
        split = (prev is not None and bool(plan.mask_rows)
                 and self.runner.can_split(plan, replay))  # fmt: skip
        if prev is not None and not split and plan.mask_rows:
            # the masks need step N's tokens on the host: collect and finish N first
            self._inflight = None
            runs, early = self._collect(prev, queued=False)
            outs = self._finish(prev, runs)  # the matchers take N's tokens first
            prev = runs = None
            plan = reqs.plan()
        prefilled = not plan.rows and bool(reqs.prefiller.pending)
        if prefilled:
            ready += reqs.prefill()  # nothing decodes yet: the new rows decode now
            plan = reqs.plan()
        launched = None
        if split:  # N + 1's forward runs while N is finished; then its masks, its draw
            self._steps += 1
            part = self.runner.launch_forward(plan, replay)
            self._inflight = None
            runs, early = self._collect(prev, queued=True)
            outs = self._finish(prev, runs)
            prev, live = None, plan.live()
            masked = [i for i in plan.mask_rows if live[i]]
            launched = self.runner.launch_draw(part, masked, replay)
        elif plan.rows:
            self._steps += 1
            launched = self.runner.launch(plan, replay)
        if not prefilled:
            ready += reqs.prefill()  # behind the decode graphs: the launches overlap them
        t1 = time.perf_counter()
        if prev is None and not self.overlap:
            prev, launched = launched, None  # drained: this step is collected now
        if prev is not None:
            if runs is None:
                runs, late = self._collect(prev, queued=launched is not None)
            outs = self._finish(prev, runs)
        self._inflight = launched
        if outs is None:
            outs = StepOutputs()
        outs.ready = ready + outs.ready  # (aborts and failed prefills first)
        self.last_step_timing = StepTiming(t1 - t0 - early, early + late,
                                           time.perf_counter() - t1 - late)  # fmt: skip
        return outs

    def _collect(self, launched: Launched, queued: bool) -> tuple[Runs, float]:
        """Wait for a launched step by its event (`queued`: a later launch runs behind it)
        and collect its runs (`finish.collect`; a drafter's histories extended): (the
        runs, the seconds waited for the device)."""
        t = time.perf_counter()
        launched.wait(queued)
        waited = time.perf_counter() - t
        plan = launched.plan
        runs = collect(plan, launched.keys, launched.host, launched.inflight)
        if self.drafter is not None:
            self.drafter.extend(plan, runs.toks, runs.counts)
            ok = [c for c in launched.keys if c[1] not in launched.errors]
            launched.drafted = self.drafter.found(plan, ok, launched.host, runs.alive)
        return runs, waited

    def _finish(self, launched: Launched, runs: Runs) -> StepOutputs:
        """Finish a collected step: its stop checks, outputs and ends."""
        self.prefiller.report_logprobs()
        plan = launched.plan
        outs, ended = finish(plan, runs, launched.keys, self.eos_token_ids, self.masks,
                             launched.errors, self._plain)  # fmt: skip
        if self.drafter is not None:
            self.drafter.count(launched.drafted, outs._lengths)
        self.requests.end(plan, ended)
        return outs
