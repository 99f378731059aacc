"""DecodeExecutor: the decode loop. add_request / step / abort over captured graphs.

A step, in order:
  1. emit the outputs waiting since the last step (first tokens sampled at admission,
     aborts);
  2. flush staged slot writes (admissions, releases) and upload the grammar bitmask rows
     of grammar requests (pinned host rows, copied without blocking);
  3. for each chunk of at most the largest bucket: pick its `GraphKey` from host copies
     (variant, smallest bucket that fits, logprobs if any row asked), write its slot ids
     (padding rows -> the padding slot), replay the key's graph or run the same step
     function eagerly, and queue a non-blocking copy of its outputs to pinned host memory;
  4. wait once for the outputs, then per row: feed the grammar, check stop conditions,
     report, and release finished slots (reset at the next flush).
With speculation (`graphexec.speculative.runner`), step 3 also writes each chunk's drafts
and per-offset grammar masks and gives its key spec_k, and step 4 reports runs of 1..K+1
tokens per request.
"""

from __future__ import annotations

import logging
import random
import time
from collections import Counter
from collections.abc import Sequence

import torch
from tqdm.auto import tqdm

from graphexec.batch import BatchPlan, StepOutputs, finish_rows
from graphexec.graphs import CapturedGraphs, GraphKey, all_keys, check_buckets, default_buckets
from graphexec.params import MAX_TOP_LOGPROBS, SamplingParams, variant_rank
from graphexec.request import Request, RequestOutput, chunk_key
from graphexec.sampling.pipeline import default_backend
from graphexec.sampling.tensors import SamplerOutput
from graphexec.speculative.config import SpeculativeConfig
from graphexec.speculative.runner import SpecRunner
from graphexec.state import SlotTable
from graphexec.stats import ExecutorStats, StepTiming
from graphexec.step import StepBuffers, StepSampler, decode_step, first_token

log = logging.getLogger(__name__)


class ExecutorFullError(RuntimeError):
    """add_request when max_batch_size requests are already running."""


class DecodeExecutor:
    """Runs the decode loop of up to `max_batch_size` requests.

    Args:
        model: a `graphexec.models.DecodeModel`; the executor calls `model.bind`.
        max_batch_size: requests that may run at once (one slot each).
        device: "cuda" / "cpu" / a torch.device; None = CUDA when available.
        cuda_graphs: replay captured graphs (emulated without CUDA); False = always eager.
        tokenizer: a `graphexec.Tokenizer`; needed for grammars, and its EOS stops requests.
        buckets: graph batch sizes; default 1, 2, 4, 8, then multiples of 16 up to
            max_batch_size. Larger batches run as several chunks.
        backend: the sampler backend; None = "triton" on CUDA, "torch" elsewhere.
        sampler_config: the Triton sampler's `SamplerConfig` (None: its device preset).
        max_logit_bias: the most logit_bias entries a request may carry.
        seed: seeds the generator of seeds for unseeded requests; None = OS entropy.
        speculative: a `SpeculativeConfig` to verify drafts in every step (each request
            then emits 1 to K+1 tokens per step); None = one token per step.
    """

    def __init__(
        self,
        model,
        max_batch_size: int = 256,
        device: torch.device | str | None = None,
        cuda_graphs: bool = True,
        tokenizer=None,
        buckets: Sequence[int] | None = None,
        backend: str | None = None,
        max_logit_bias: int = 16,
        seed: int | None = None,
        sampler_config=None,
        speculative=None,
    ) -> None:
        if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int):
            raise ValueError(f"max_batch_size must be an int >= 1, got {max_batch_size!r}")
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model = model
        self.vocab_size = int(model.vocab_size)
        self.max_batch_size = max_batch_size
        self.buckets = check_buckets(buckets or default_buckets(max_batch_size))
        self.cuda_graphs = cuda_graphs
        self.backend = backend or default_backend(self.device)
        self.tokenizer = tokenizer
        if speculative is not None and not isinstance(speculative, SpeculativeConfig):
            raise ValueError(
                f"speculative must be a SpeculativeConfig or None, got {type(speculative).__name__}"
            )
        if speculative is not None and not hasattr(model, "verify"):
            raise ValueError(f"speculative decoding needs {type(model).__name__}.verify")
        runs = 1 if speculative is None else speculative.num_draft_tokens + 1
        self.slots = SlotTable(max_batch_size, self.vocab_size, self.device, max_logit_bias,
                               grammar=bool(tokenizer), offsets=runs)  # fmt: skip
        model.bind(max_batch_size + 1, self.device)
        self.grammar = None
        if tokenizer is not None:
            from graphexec.grammar import GrammarCompiler, GrammarSlots

            compiler = GrammarCompiler(tokenizer, self.vocab_size)
            self.grammar = GrammarSlots(compiler, max_batch_size, runs)
        self._eos = None if tokenizer is None else tokenizer.eos_token_id
        self._seeds = random.Random(seed) if seed is not None else random.SystemRandom()
        largest = self.buckets[-1]
        self.buffers = StepBuffers.allocate(largest, self.slots.padding_slot, self.device)
        self.sampler = StepSampler.build(self.backend, self.device, largest * runs,
                                         self.vocab_size, sampler_config)  # fmt: skip
        self.spec = None
        if speculative is not None:
            self.spec = SpecRunner(speculative, model, self.slots, self.device, largest,
                                   max_batch_size)  # fmt: skip
            self.spec.sampler = self.sampler
        self._first = {lp: SamplerOutput.allocate(1, self.device, MAX_TOP_LOGPROBS if lp else None)
                       for lp in (False, True)}  # fmt: skip
        pin = self.device.type == "cuda"
        n = max_batch_size + largest  # chunk staging at each chunk's first row
        self._host_slots = torch.empty(n, dtype=torch.int64, pin_memory=pin)
        self._host_out = SamplerOutput.allocate(max_batch_size, "cpu", MAX_TOP_LOGPROBS)
        if pin:
            for name in ("token_ids", "logprobs", "ranks", "top_logprobs", "top_token_ids"):
                setattr(self._host_out, name, getattr(self._host_out, name).pin_memory())
        self._host_grammar_idx = torch.empty(max_batch_size, dtype=torch.int64, pin_memory=pin)
        self.graphs = CapturedGraphs(self.device)
        self._running: dict[str, Request] = {}
        self._pending: list[RequestOutput] = []
        self._plan: BatchPlan | None = None
        self._eager = Counter()
        self.last_step_timing = StepTiming()
        self._steps = 0
        self._admitted = 0

    # ---- public state ----------------------------------------------------------------
    @property
    def free_slots(self) -> int:
        return self.slots.free_slots

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def idle(self) -> bool:
        """Nothing running and no output waiting to be reported."""
        return not self._running and not self._pending

    @property
    def graph_keys(self) -> list[GraphKey]:
        return list(self.graphs.steps)

    @property
    def stats(self) -> ExecutorStats:
        g = self.graphs
        return ExecutorStats(
            replays={k: s.replays for k, s in g.steps.items()},
            eager_steps=Counter(self._eager),
            capture_s={k: s.capture_s for k, s in g.steps.items()},
            failed=dict(g.failed),
            steps=self._steps,
            admitted=self._admitted,
            drafted=self.spec.drafted if self.spec else 0,
            accepted=self.spec.accepted if self.spec else 0,
        )

    # ---- capture ---------------------------------------------------------------------
    def capture(self, keys: Sequence[GraphKey] | None = None, progress: bool = True) -> None:
        """Warm up and capture every key (default: all of them), largest bucket first,
        into one shared pool. A key that fails is logged and served eagerly."""
        if not self.cuda_graphs:
            raise RuntimeError("this executor was built with cuda_graphs=False")
        spec_ks = self.spec.spec_ks if self.spec else (0,)
        keys = sorted(keys or all_keys(self.buckets, spec_ks), key=lambda k: -k.bucket)
        self.slots.flush()
        self._retire_plan()  # the slot ids buffer is about to hold padding
        self.buffers.slot_ids.fill_(self.slots.padding_slot)
        cuda = self.device.type == "cuda"
        mem0 = torch.cuda.memory_reserved(self.device) if cuda else 0
        t0 = time.perf_counter()
        for key in tqdm(keys, desc="capture", unit="graph", disable=not progress):
            if key.bucket > self.buckets[-1]:
                raise ValueError(f"key {key} has a bucket larger than the largest bucket")
            if key in self.graphs.steps:
                continue
            if key.spec_k not in spec_ks:
                raise ValueError(f"key {key} has spec_k {key.spec_k}; this executor runs {spec_ks}")
            self.graphs.capture(key, self._step_fn(key))
        self.slots.reset_padding()
        grew = torch.cuda.memory_reserved(self.device) - mem0 if cuda else 0
        log.info(
            "captured %d graphs (%d failed) in %.1f s, reserved CUDA memory +%.1f MiB%s",
            len(self.graphs.steps), len(self.graphs.failed), time.perf_counter() - t0,
            grew / 2**20, "" if self.graphs.cuda else " (emulated: no CUDA)",
        )  # fmt: skip

    def _step_fn(self, key: GraphKey):
        slot_ids, out = self.buffers.view(key)
        if self.spec is not None:
            return self.spec.step_fn(key, slot_ids)
        model, slots, sampler = self.model, self.slots, self.sampler
        return lambda: decode_step(model, slots, slot_ids, out, key, sampler)

    # ---- admission -------------------------------------------------------------------
    def add_request(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> None:
        """Admit a request: validate, take a slot, prefill, and sample its first token
        (reported by the next `step`). ValueError names the bad field; ExecutorFullError
        when max_batch_size requests already run (nobody is evicted)."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty str, got {request_id!r}")
        if request_id in self._running or any(o.request_id == request_id for o in self._pending):
            raise ValueError(f"request_id {request_id!r} is already running")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        params.check_vocab(self.vocab_size)
        if params.grammar is not None and self.grammar is None:
            raise ValueError("params.grammar needs a tokenizer: pass tokenizer= to DecodeExecutor")
        prompt = self._check_prompt(prompt_token_ids)
        if self.free_slots == 0:
            raise ExecutorFullError(
                f"all {self.max_batch_size} slots are in use; wait for requests to finish "
                "(ex.free_slots says how many more fit)"
            )
        if params.grammar is not None:
            self.grammar.compiler.compile(params.grammar)  # a bad grammar fails before a slot
        if params.seed is None:
            params = params.with_seed(self._seeds.getrandbits(63))
        slot = self.slots.assign(params, prompt)
        req = Request(
            request_id, params, slot, len(prompt),
            frozenset(params.stop_token_ids) | ({self._eos} if self._eos is not None else set()),
            variant_rank(params),
        )  # fmt: skip
        try:
            if params.grammar is not None:
                self.grammar.add(slot, params.grammar)
            self.slots.flush()
            logits = self.model.prefill(slot, torch.tensor(prompt, dtype=torch.int64))
            if self.spec is not None:
                self.spec.admit(req, slot, prompt)
            if params.grammar is not None:
                self._upload_grammar([slot])
            out = self._first[req.wants_logprobs]
            key = chunk_key([req], 1)
            first_token(logits.to(self.device), self.slots, slot, out, key, self.sampler)
            self._copy_out(out, key, 0, 1)
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
        except Exception:
            self.slots.release(slot)
            if self.grammar is not None:
                self.grammar.remove(slot)
            raise
        self._running[request_id] = req
        self._admitted += 1
        self._retire_plan()  # it joins the decode rows at the step after next
        first = BatchPlan.build([req], (1,), self.model.max_seq_len, self._has_grammar)
        first.chunks = []  # no graph key: drawn at admission
        self._pending += list(self._finish(first))
        first.retire()

    def _check_prompt(self, prompt_token_ids: Sequence[int]) -> list[int]:
        try:
            prompt = [int(t) for t in prompt_token_ids]
        except (TypeError, ValueError):
            raise ValueError("prompt_token_ids must be a sequence of ints") from None
        limit = self.model.max_seq_len
        if not 1 <= len(prompt) <= limit:
            raise ValueError(
                f"prompt_token_ids must hold 1 to {limit} tokens (the model's max_seq_len), "
                f"got {len(prompt)}"
            )
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt_token_ids must be in [0, {self.vocab_size}), got {bad[0]}")
        return prompt

    def abort(self, request_id: str) -> None:
        """Stop a request now; the next step reports it with finish_reason "abort"."""
        req = self._running.get(request_id)
        if req is None:
            raise ValueError(f"request_id {request_id!r} is not running")
        self._pending = [o for o in self._pending if o.request_id != request_id]
        self._release(req)
        self._pending.append(
            RequestOutput(request_id, None, req.generated, req.params.seed, finished=True,
                          finish_reason="abort")
        )  # fmt: skip

    def _release(self, req: Request) -> None:
        self._retire_plan()
        del self._running[req.request_id]
        self.slots.release(req.slot)
        if self.grammar is not None:
            self.grammar.remove(req.slot)

    def _retire_plan(self) -> None:
        """Requests came or went: write the plan's counters back; rebuild at the next step."""
        if self._plan is not None:
            self._plan.retire()
            self._plan = None

    # ---- the step --------------------------------------------------------------------
    def step(self, mode: str | None = None) -> StepOutputs:
        """One output per running request: its next token, or its end (a sequence of
        `RequestOutput`, built as they are read).

        mode: None = replay where a graph was captured (eager otherwise); "eager" runs the
        same step function without replay, on the same buffers.
        """
        t0 = time.perf_counter()
        if mode not in (None, "replay", "eager"):
            raise ValueError(f"mode must be None, 'replay' or 'eager', got {mode!r}")
        ready, self._pending = self._pending, []
        plan = self._plan
        if plan is None:
            rows = [r for r in self._running.values() if not r.fresh]
            fresh = len(rows) < len(self._running)
            for r in self._running.values():
                r.fresh = False
            plan = BatchPlan.build(rows, self.buckets, self.model.max_seq_len, self._has_grammar)
            self._plan = None if fresh else plan  # fresh requests join at the next step
        if not plan.rows:
            outs = StepOutputs()
            outs.ready = ready
            return outs
        self._steps += 1
        self.slots.flush()
        if plan.grammar_rows and self.spec is None:  # the runner writes masks per offset
            self._upload_grammar([plan.rows[i].slot for i in plan.grammar_rows])
        replay = mode != "eager" and self.cuda_graphs
        keys = []
        for key, start, n in plan.chunks:
            if self.spec is not None:
                key = self.spec.prepare(plan, key, start, n, self.grammar)
            keys.append((key, start, n))
            if not plan.uploaded:
                host = self._host_slots[start : start + key.bucket]
                host.fill_(self.slots.padding_slot)
                host[:n] = torch.tensor([r.slot for r in plan.rows[start : start + n]])
            if not plan.uploaded or len(plan.chunks) > 1:
                src = self._host_slots[start : start + key.bucket]
                self.buffers.slot_ids[: key.bucket].copy_(src, non_blocking=True)
            if not (replay and self.graphs.replay(key)):
                self._step_fn(key)()
                self._eager[key] += 1
            if self.spec is not None:
                self.spec.copy_out(key, start, n)
            else:
                self._copy_out(self.buffers.out, key, start, n)
        plan.uploaded = True
        t1 = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        t2 = time.perf_counter()
        if self.spec is not None:
            outs = self._finish_runs(plan, keys, ready)
            ready = outs.ready
        else:
            outs = self._finish(plan)
        if plan is not self._plan:
            plan.retire()  # a one-off plan (a request joins next step): keep its counters
        outs.ready = ready
        self.last_step_timing = StepTiming(t1 - t0, t2 - t1, time.perf_counter() - t2)
        return outs

    def _finish(self, plan: BatchPlan) -> StepOutputs:
        outs, ended = finish_rows(plan, self._host_out, self._eos, self.grammar)
        for f in ended:
            self._release(plan.rows[f.row])
        return outs

    def _finish_runs(self, plan: BatchPlan, keys, ready) -> StepOutputs:
        """Speculative steps report runs: every output goes in `ready`, in row order."""
        chunks, plan.chunks = plan.chunks, keys
        runs, ended = self.spec.finish(plan, self._eos, self.grammar)
        plan.chunks = chunks
        for f in ended:
            self._release(plan.rows[f.row])
        outs = StepOutputs()
        outs.ready = ready + runs
        return outs

    def _has_grammar(self, slot: int) -> bool:
        return self.grammar is not None and self.grammar.has(slot)

    def _copy_out(self, out: SamplerOutput, key: GraphKey, start: int, n: int) -> None:
        """Queue the copy of rows [:n] of `out` to the host buffers at `start`."""
        h = self._host_out
        # token_ids is -1 exactly where valid is False, so it alone tells both
        h.token_ids[start : start + n].copy_(out.token_ids[:n], non_blocking=True)
        if key.logprobs:
            for name in ("logprobs", "ranks", "top_logprobs", "top_token_ids"):
                getattr(h, name)[start : start + n].copy_(getattr(out, name)[:n], non_blocking=True)

    def _upload_grammar(self, g: list[int]) -> None:
        """Fill the bitmasks of grammar slots `g` on the host and copy them to the slots."""
        host_rows = self.grammar.fill(g)
        idx = self._host_grammar_idx[: len(g)]
        idx.copy_(torch.tensor(g, dtype=torch.int64))
        dev_idx = idx.to(self.device, non_blocking=True)
        rows_dev = host_rows.to(self.device, non_blocking=True)
        bm = self.slots.bitmask
        (bm if bm.dim() == 2 else bm[:, 0]).index_copy_(0, dev_idx, rows_dev)
