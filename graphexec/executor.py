"""DecodeExecutor: the decode loop. add_request / step / abort over captured graphs.

A step, in order:
  1. drain the commands queued since the last step (`add_request`, `abort`), host
     bookkeeping only: admissions take slots (staged writes) and queue their prompts for
     prefill; aborts release their slots;
  2. upload the token-mask rows of decode rows with a grammar, allowed_token_ids or
     bad_words (pinned host rows, copied without blocking);
  3. for each chunk of at most the largest bucket: pick its `GraphKey` from host copies
     (variant, smallest bucket that fits, logprobs if any row asked), write its slot ids
     (padding rows -> the padding slot), replay the key's graph or run the same step
     function eagerly, and queue a non-blocking copy of its outputs to pinned host memory;
     a chunk whose eager step raises (a model returning the wrong shape) ends its
     requests with "error" instead of wedging the executor;
  4. behind the decode graphs: flush the staged slot writes (one packed copy) and
     prefill the queued prompts in one ragged batch, cut to `prefill_budget` tokens
     (`graphexec.prefill`); a request whose prompt is complete decodes from the next step
     on, its last prompt token being the input of the row that draws its first token.
     (When nothing is decoding, 4 runs first and the new rows decode in this step.)
  5. wait once for the outputs, then per row: feed the masks, detokenise and match stop
     strings, check stop conditions, report, and release finished slots.
With speculation (`graphexec.speculative.runner`), step 3 also writes each chunk's drafts
and per-offset masks and gives its key spec_k, and step 4 reports runs of 1..K+1 tokens
per request.

Threads: `add_request`, `abort` and the read-only properties are safe from any thread,
also while another thread is inside `step()`: they validate and queue under a lock held
for microseconds. `step()` and `capture()` run on one thread at a time (a concurrent call
raises RuntimeError); every model and device call happens there, and no lock is held
while that thread waits for the GPU.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Sequence

import numpy as np
import torch

from graphexec.admission import check_request, drain
from graphexec.batch import CHUNK_FAILED, BatchPlan, StepOutputs, finish_rows
from graphexec.graphs import CapturedGraphs, GraphKey, check_buckets, default_buckets
from graphexec.launch import capture_keys, launch_chunks
from graphexec.masks import TokenMasks
from graphexec.params import MAX_TOP_LOGPROBS, SamplingParams
from graphexec.prefill import Prefiller
from graphexec.request import Request, RequestOutput
from graphexec.request_queue import RequestQueue
from graphexec.sampling.pipeline import BACKENDS, default_backend
from graphexec.sampling.tensors import SamplerOutput
from graphexec.speculative.config import SpeculativeConfig
from graphexec.speculative.runner import SpecRunner
from graphexec.state import SlotTable
from graphexec.stats import ExecutorStats, StepTiming
from graphexec.step import StepBuffers, StepSampler, decode_step

log = logging.getLogger(__name__)


def _device(device) -> torch.device:
    try:
        d = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device must be 'cuda', 'cpu' or a torch.device, got {device!r}") from e
    if d.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but CUDA is not available (use device='cpu')")
    return d


class DecodeExecutor:
    """Runs the decode loop of up to `max_batch_size` requests (threads: module docstring).

    Args:
        model: a `graphexec.models.DecodeModel`; the executor calls `model.bind`.
        max_batch_size: requests that may run at once (one slot each).
        device: "cuda" / "cpu" / a torch.device; None = CUDA when available.
        cuda_graphs: replay captured graphs (emulated without CUDA); False = always eager.
        tokenizer: a `graphexec.Tokenizer`; needed for grammars, stop strings and bad
            words given as text; each of its `eos_token_ids` stops requests (unless
            ignore_eos).
        buckets: graph batch sizes; default 1, 2, 4, 8, then multiples of 16 up to
            max_batch_size. Larger batches run as several chunks.
        backend: the sampler backend; None = "triton" on CUDA, "torch" elsewhere.
        sampler_config: the Triton sampler's `SamplerConfig` (None: its device preset).
        max_logit_bias: the most logit_bias entries a request may carry.
        seed: seeds the generator of seeds for unseeded requests; None = OS entropy.
        speculative: a `SpeculativeConfig` to verify drafts in every step (each request
            then emits 1 to K+1 tokens per step); None = one token per step.
        vocab_size: the ids that may be sampled; None = the tokenizer's vocabulary (or the
            model's without a tokenizer). A model whose vocab_size is larger (a padded
            embedding) has its extra columns dropped before sampling.
        detokenize: with a tokenizer, report each token's text (`RequestOutput.text`);
            stop strings need it.
        max_min_ids: the most bitmask words of ids one request's min_tokens holds back.
        prefill_budget: prompt tokens prefilled per step; a longer prompt is prefilled in
            chunks over several steps, so running streams never wait for more than this.
            (A model without `prefill_batch` gets whole prompts, one `prefill` each.)
        tp_group: a torch.distributed group of tensor-parallel ranks: the model's decode
            (and verify) return this rank's vocabulary slice (`distributed.vocab_slices`),
            sampled with `distributed.sample_step` (`tp_method`: "all_to_all",
            "vocab_parallel" or "auto"). Every rank runs its own executor with the same
            requests in the same order (grammar masks are filled on every rank: the same
            host work, no broadcast, since every rank draws the same tokens); speculation
            needs an n-gram drafter and verify="strict"; prompt_logprobs is not served.
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
        vocab_size: int | None = None,
        detokenize: bool = True,
        max_min_ids: int = 16,
        prefill_budget: int = 1024,
        tp_group=None,
        tp_method: str = "auto",
    ) -> None:
        if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int):
            raise ValueError(f"max_batch_size must be an int >= 1, got {max_batch_size!r}")
        if (
            isinstance(prefill_budget, bool)
            or not isinstance(prefill_budget, int)
            or (prefill_budget < 1)
        ):
            raise ValueError(f"prefill_budget must be an int >= 1, got {prefill_budget!r}")
        if backend is not None and backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
        for attr in ("vocab_size", "max_seq_len", "bind", "prefill", "decode"):
            if not hasattr(model, attr):
                raise ValueError(f"model ({type(model).__name__}) has no {attr!r}: not a "
                                 "DecodeModel")  # fmt: skip
        self.device = _device(device)
        self.model = model
        width = int(model.vocab_size)
        if vocab_size is None:
            vocab_size = width if tokenizer is None else int(tokenizer.vocab_size)
        if not 1 <= vocab_size <= width:
            raise ValueError(
                f"vocab_size ({vocab_size}, the tokenizer's unless given) must be in [1, the "
                f"model's vocab_size {width}]"
            )
        self.vocab_size = vocab_size
        self.max_batch_size = max_batch_size
        self.buckets = check_buckets(buckets or default_buckets(max_batch_size))
        self.cuda_graphs = cuda_graphs
        self.backend = backend or default_backend(self.device)
        self.tokenizer = tokenizer
        self.detokenize = bool(detokenize) and tokenizer is not None
        if speculative is not None and not isinstance(speculative, SpeculativeConfig):
            raise ValueError(
                f"speculative must be a SpeculativeConfig or None, got {type(speculative).__name__}"
            )
        if speculative is not None and not hasattr(model, "verify"):
            raise ValueError(f"speculative decoding needs {type(model).__name__}.verify")
        self.tp = None
        if tp_group is not None:
            from graphexec.distributed import for_executor

            self.tp = for_executor(tp_group, tp_method, model, self.vocab_size, speculative)
        runs = 1 if speculative is None else speculative.num_draft_tokens + 1
        self.slots = SlotTable(max_batch_size, self.vocab_size, self.device, max_logit_bias,
                               offsets=runs, max_min_ids=max_min_ids)  # fmt: skip
        model.bind(max_batch_size + 1, self.device)
        grammar = None
        if tokenizer is not None:
            from graphexec.grammar import GrammarCompiler, GrammarSlots

            compiler = GrammarCompiler(tokenizer, self.vocab_size)
            grammar = GrammarSlots(compiler, max_batch_size, runs)
        self.grammar = grammar
        self.masks = TokenMasks(self.vocab_size, max_batch_size, runs, grammar)
        self.eos_token_id = None if tokenizer is None else tokenizer.eos_token_id
        # every EOS id stops a request (Llama 3 instruct ends turns with <|eot_id|> too)
        self.eos_token_ids: tuple[int, ...] = () if tokenizer is None else tokenizer.eos_token_ids
        self._eos = np.array(self.eos_token_ids, dtype=np.int64)
        self._plain = None  # (Tokenizer.plain_texts, where they exist): the text fast path
        if self.detokenize:
            texts = tokenizer.plain_texts
            texts = texts + [None] * (self.vocab_size - len(texts))
            self._plain = (texts, np.array([t is not None for t in texts], dtype=bool))
        largest = self.buckets[-1]
        self.buffers = StepBuffers.allocate(largest, self.slots.padding_slot, self.device)
        self.sampler = StepSampler.build(self.backend, self.device, largest * runs,
                                         self.vocab_size, sampler_config, self.tp,
                                         tp_method)  # fmt: skip
        self.spec = None
        if speculative is not None:
            self.spec = SpecRunner(speculative, model, self.slots, self.device, largest,
                                   max_batch_size)  # fmt: skip
            self.spec.sampler = self.sampler
        self.prefiller = Prefiller(model, prefill_budget, self.vocab_size, self.device,
                                   self.spec.draft if self.spec else None)  # fmt: skip
        pin = self.device.type == "cuda"
        n = max_batch_size + largest  # chunk staging at each chunk's first row
        self._host_slots = torch.empty(n, dtype=torch.int64, pin_memory=pin)
        self._host_out = SamplerOutput.allocate(max_batch_size, "cpu", MAX_TOP_LOGPROBS)
        if pin:
            for name in ("token_ids", "logprobs", "ranks", "top_logprobs", "top_token_ids"):
                setattr(self._host_out, name, getattr(self._host_out, name).pin_memory())
        self._host_mask_idx = torch.empty(max_batch_size, dtype=torch.int64, pin_memory=pin)
        self.graphs = CapturedGraphs(self.device)
        self._running: dict[str, Request] = {}
        self._pending: list[RequestOutput] = []
        self._plan: BatchPlan | None = None
        self._eager = Counter()
        self.last_step_timing = StepTiming()
        self._steps = 0
        self._admitted = 0
        self._stepping = threading.Lock()
        self._queue = RequestQueue(max_batch_size, seed)  # shared with other threads

    # ---- public state ----------------------------------------------------------------
    @property
    def free_slots(self) -> int:
        """How many more requests (streams) `add_request` accepts now."""
        return self._queue.free

    @property
    def num_running(self) -> int:
        """Requests (streams) holding a slot: decoding, or with their prompt still
        being prefilled."""
        return len(self._running) + sum(len(p.reqs) for p in self.prefiller.pending)

    @property
    def idle(self) -> bool:
        """Nothing queued, running, or waiting to be reported."""
        return (not self._running and not self._pending and self._queue.empty
                and not self.prefiller.pending)  # fmt: skip

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

    @contextlib.contextmanager
    def _step_thread(self):
        if not self._stepping.acquire(blocking=False):
            raise RuntimeError("step() or capture() is already running in another thread; "
                               "one thread drives the loop")  # fmt: skip
        try:
            yield
        finally:
            self._stepping.release()

    # ---- capture ---------------------------------------------------------------------
    def capture(self, keys: Sequence[GraphKey] | None = None, progress: bool = True) -> None:
        """Warm up and capture every key (default: all of them), largest bucket first,
        into one shared pool. A key that fails is logged and served eagerly."""
        if not self.cuda_graphs:
            raise RuntimeError("this executor was built with cuda_graphs=False")
        with self._step_thread():
            capture_keys(self, keys, progress)

    def _step_fn(self, key: GraphKey):
        slot_ids, out = self.buffers.view(key)
        if self.spec is not None:
            return self.spec.step_fn(key, slot_ids)
        model, slots, sampler = self.model, self.slots, self.sampler
        return lambda: decode_step(model, slots, slot_ids, out, key, sampler)

    # ---- admission (any thread) ------------------------------------------------------
    def add_request(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> None:
        """Validate and queue a request; the next `step()` prefills it and reports its
        first token. ValueError names the bad field (or says the id is already in use);
        ExecutorFullError when its n streams do not fit (nobody is evicted). With n > 1,
        stream i reports as request id "<request_id>/<i>" with seed
        `stream_seed(seed, i)`; `abort(request_id)` aborts all of them."""
        prompt, bad, min_ids = check_request(self, request_id, prompt_token_ids, params)
        self._queue.add(request_id, prompt, params, bad, min_ids)

    def abort(self, request_id: str) -> bool:
        """Abort a request (all its streams when n > 1): the next step reports it with
        finish_reason "abort" at the position of its first unreported token (0 when none
        was reported), with no token. True when queued; False (a no-op) when it has
        already finished; ValueError for an id that is unknown (never added, or finished
        and already reported)."""
        return self._queue.abort(request_id)

    # ---- admission (the step thread: `admission.drain`) -------------------------------
    def _free_slot(self, req: Request) -> None:
        self.slots.release(req.slot)
        self.masks.remove(req.slot)
        self._queue.ended(req.request_id)

    def _release(self, req: Request) -> None:
        self._retire_plan()
        del self._running[req.request_id]
        self._free_slot(req)

    def _retire_plan(self) -> None:
        """Requests came or went: write the plan's counters back; rebuild at the next step."""
        if self._plan is not None:
            self._plan.retire()
            self._plan = None

    # ---- the step --------------------------------------------------------------------
    def step(self, mode: str | None = None) -> StepOutputs:
        """Admit what was queued, then one output per running request: its next token,
        or its end (a sequence of `RequestOutput`, built as they are read).

        mode: None = replay where a graph was captured (eager otherwise); "eager" runs the
        same step function without replay, on the same buffers.
        """
        if mode not in (None, "replay", "eager"):
            raise ValueError(f"mode must be None, 'replay' or 'eager', got {mode!r}")
        with self._step_thread():
            outs = self._step(mode)
            done = [o.request_id for o in outs.ready if o.finished]
            done += [outs._rows[i].request_id for i in outs._reasons or ()]
            if done:
                self._queue.reported(done)
            return outs

    def _step(self, mode: str | None) -> StepOutputs:
        t0 = time.perf_counter()
        drain(self)
        ready, self._pending = self._pending, []
        prefilled = False
        if not self._running and self.prefiller.pending:
            ready += self._prefill()  # nothing decodes yet: the new rows decode now
            prefilled = True
        plan = self._plan
        if plan is None:
            plan = self._plan = BatchPlan.build(list(self._running.values()), self.buckets,
                                                self.model.max_seq_len, self.masks.has)  # fmt: skip
        keys: list[tuple[GraphKey, int, int]] = []
        errors: dict[int, str] = {}
        if plan.rows:
            self._steps += 1
            keys = launch_chunks(self, plan, mode, errors)
        if not prefilled:
            # launched behind the decode graphs: the host's launch time overlaps the
            # device's decode, and the new requests decode from the next step on
            ready += self._prefill()
        t1 = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        t2 = time.perf_counter()
        self.prefiller.report_logprobs()
        if not plan.rows:
            outs = StepOutputs()
        elif self.spec is not None:
            self.spec.fail_rows(errors, keys)
            outs = self._finish_runs(plan, keys, [], errors)
        else:
            for start, n in ((s, n) for _, s, n in keys if s in errors):
                self._host_out.token_ids[start : start + n] = CHUNK_FAILED
            outs = self._finish(plan, errors)
        if plan is not self._plan:
            plan.retire()  # requests joined during the step: keep its counters
        outs.ready = ready + outs.ready
        self.last_step_timing = StepTiming(t1 - t0, t2 - t1, time.perf_counter() - t2)
        return outs

    def _prefill(self) -> list[RequestOutput]:
        """Flush the staged slot writes and run the step's prefill; completed prompts
        join the decode rows. The ends of requests whose prefill failed."""
        self.slots.flush()
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
            self._plan = None  # rebuilt with them at the next plan (the step's is retired)
            for p in res.complete:
                for r in p.reqs:
                    self._running[r.request_id] = r
                    self._admitted += 1
        return outs

    def _finish(self, plan: BatchPlan, errors: dict[int, str] | None = None) -> StepOutputs:
        outs, ended = finish_rows(plan, self._host_out, self._eos, self.masks,
                                  errors or {}, self._plain)  # fmt: skip
        for f in ended:
            self._release(plan.rows[f.row])
        return outs

    def _finish_runs(self, plan: BatchPlan, keys, ready, errors) -> StepOutputs:
        """Speculative steps report runs: every output goes in `ready`, in row order."""
        chunks, plan.chunks = plan.chunks, keys
        runs, ended = self.spec.finish(plan, self.masks, errors)
        plan.chunks = chunks
        for f in ended:
            self._release(plan.rows[f.row])
        outs = StepOutputs()
        outs.ready = ready + runs
        return outs
