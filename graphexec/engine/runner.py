"""StepRunner: the device side of the executor's work, on the stepping thread.

It owns the static buffers (slot ids [N]; per run length T, inputs and outputs [N, T]
and their pinned host rows), captures every `GraphKey` (`capture`), and per step
launches each chunk of the plan (`launch`: token masks and drafts up, slot ids written,
the key's graph replayed or its step run eagerly, outputs copied to the host without
blocking, and an event recorded behind them: the step's end). T = 1 is ordinary
decoding; a speculative executor also has T = K + 1.

Two steps may be in flight (the pipelined step launches N + 1 before it reads N), so the
pinned buffers a launch writes for non-blocking copies (slot ids, draft allowances,
outputs) come in two sets used by alternate launches: step N + 1 writes the set of
N - 1, whose copies the executor waited for before it launched N. Mask rows have one
set: they are written only once the step before was collected. A one-chunk step with
host-written masks launches in two parts (`launch_forward`, then `launch_draw`: a graph
each, `CapturedGraphs.capture_parts`): the model runs while the host finishes step N,
whose tokens the masks of N + 1 need. With n-gram speculation the forward part also
matches the drafts, which the host finds too once N is collected: the masks per offset
follow them, and the draw cuts each row's drafts where its mask refused one.
"""

from __future__ import annotations

import functools
import gc
import logging
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch
from tqdm.auto import tqdm

from graphexec.engine.graphs import CapturedGraphs, all_keys
from graphexec.engine.plan import BatchPlan
from graphexec.engine.step import RunBuffers, SplitBuffers, StepFn
from graphexec.models.protocol import check_logits
from graphexec.params import MAX_TOP_LOGPROBS
from graphexec.request import GraphKey
from graphexec.sampling.flags import CHUNK_FAILED
from graphexec.sampling.step_sampler import StepSampler
from graphexec.speculative.verify import verify_step

log = logging.getLogger(__name__)


@dataclass
class HostRuns:
    """Pinned host copies of a step's outputs of run length T, one row per plan row."""

    token_ids: torch.Tensor  # i64 [N, T]: the run, then -1 (a code < 0 at 0: no token)
    logprobs: torch.Tensor  # f32 [N, T]
    ranks: torch.Tensor  # i64 [N, T]
    top_logprobs: torch.Tensor  # f32 [N, T, 20]
    top_token_ids: torch.Tensor  # i64 [N, T, 20]
    drafts: torch.Tensor  # i64 [N]: the drafts each row verified (speculation)

    @classmethod
    def allocate(cls, rows: int, t: int, pin: bool) -> HostRuns:
        def e(*shape, dtype):
            return torch.zeros(shape, dtype=dtype, pin_memory=pin)

        n, i64, f32 = MAX_TOP_LOGPROBS, torch.int64, torch.float32
        return cls(e(rows, t, dtype=i64), e(rows, t, dtype=f32), e(rows, t, dtype=i64),
                   e(rows, t, n, dtype=f32), e(rows, t, n, dtype=i64),
                   e(rows, dtype=i64))  # fmt: skip


@dataclass
class Launched:
    """A launched step: its plan, its chunks [(key, first row, rows)], the chunks whose
    step raised (first row -> why), the pinned host rows its outputs go to (T ->
    HostRuns), and the CUDA event recorded behind its copies (None on the CPU)."""

    plan: BatchPlan
    keys: list[tuple[GraphKey, int, int]] = field(default_factory=list)
    errors: dict[int, str] = field(default_factory=dict)
    host: dict = field(default_factory=dict)
    event: torch.cuda.Event | None = None
    sleeper: torch.cuda.Event | None = None  # the same point, blocking-sync (blocking_wait)
    inflight: np.ndarray | int = 1  # the most tokens each row may emit (a drafter's: allowance + 1)
    drafted: np.ndarray | None = None  # once collected: the drafts each row verified

    def wait(self, queued: bool = False) -> None:
        """Block until the step's outputs are on the host (its event: never a stream
        synchronize, so work queued behind it keeps the device busy). Asleep only with
        `queued` work behind it (EngineConfig.blocking_wait): the wake-up then costs no
        device time, while a wait with nothing queued leaves the device idle until the
        thread runs again (about 170 us a step on an H200), so that one spins."""
        if queued and self.sleeper is not None:
            self.sleeper.synchronize()
        elif self.event is not None:
            self.event.synchronize()


class StepRunner:
    """Capture and launch the steps of one executor (see the module docstring)."""

    def __init__(self, step: StepFn, masks, buckets: tuple[int, ...], max_batch_size: int,
                 device: torch.device, drafter=None,
                 blocking_wait: bool = True) -> None:  # fmt: skip
        self.step, self.slots, self.masks = step, step.slots, masks
        self.buckets, self.device, self.drafter = buckets, device, drafter
        self.spec_ks = drafter.spec_ks if drafter is not None else (0,)
        largest = buckets[-1]
        pin = device.type == "cuda"
        self.slot_ids = torch.full((largest,), self.slots.padding_slot, dtype=torch.int64,
                                   device=device)  # fmt: skip
        self.buffers = {k + 1: RunBuffers.allocate(largest, k + 1, device) for k in self.spec_ks}
        # two sets, for alternate launches (module docstring)
        self._hosts = [{t: HostRuns.allocate(max_batch_size, t, pin) for t in self.buffers}
                       for _ in range(2)]  # fmt: skip
        # chunk staging at each chunk's first row
        self._host_slot_sets = [torch.empty(max_batch_size + largest, dtype=torch.int64,
                                            pin_memory=pin) for _ in range(2)]  # fmt: skip
        self._launches = 0
        self._host_mask_idx = torch.empty(max_batch_size, dtype=torch.int64, pin_memory=pin)
        self.graphs = CapturedGraphs(device)
        self.eager: Counter = Counter()
        self.split_logits: dict[int, torch.Tensor] = {}  # T -> [largest, (T,) W]: split steps'
        self.split: dict[int, SplitBuffers] = {}  # T -> a split speculative step's buffers
        self._host_cut = [torch.zeros(largest, dtype=torch.int64, pin_memory=pin)
                          for _ in range(2)]  # fmt: skip
        self.split_steps = 0
        self.blocking_wait = blocking_wait  # EngineConfig.blocking_wait

    def _end_events(self, done: Launched) -> None:
        """The launch's end on the step's stream: `done.event`, and with blocking_wait a
        blocking-sync twin `done.sleeper` (`Launched.wait` picks one per wait)."""
        stream = torch.cuda.current_stream(self.device)
        done.event = torch.cuda.Event()
        done.event.record(stream)
        if self.blocking_wait:
            done.sleeper = torch.cuda.Event(blocking=True)
            done.sleeper.record(stream)

    def fn(self, key: GraphKey):
        """The step function of `key` on the static buffers."""
        inputs, out = self.buffers[key.spec_k + 1].view(key)
        return self.step.make(key, self.slot_ids[: key.bucket], inputs, out)

    def capture(self, keys, progress: bool) -> None:
        """Warm up and capture `keys` (None: all of them), largest bucket first, into
        one shared pool; a key that fails is logged and served eagerly. The caller retires
        its plan first: the slot ids buffer is about to hold padding."""
        keys = sorted(dict.fromkeys(keys or all_keys(self.buckets, self.spec_ks)),
                      key=lambda k: -k.bucket)  # fmt: skip
        self.slots.flush()
        self.slot_ids.fill_(self.slots.padding_slot)
        cuda = self.device.type == "cuda"
        mem0 = torch.cuda.memory_reserved(self.device) if cuda else 0
        t0 = time.perf_counter()
        # a real capture warms each key up, which checks the model's outputs; emulation
        # checks them once, on one padding row
        bad = None if self.graphs.cuda else self.probe_model()
        if self.graphs.cuda:  # earlier executors' graphs and pools go now, not mid-capture
            gc.collect()
        for key in tqdm(keys, desc="capture", unit="graph", disable=not progress):
            if key.bucket > self.buckets[-1]:
                raise ValueError(f"key {key} has a bucket larger than the largest bucket")
            if key.spec_k not in self.spec_ks:
                raise ValueError(f"key {key} has spec_k {key.spec_k}; this executor runs "
                                 f"{self.spec_ks}")  # fmt: skip
            if key in self.graphs.steps:
                continue
            if bad is not None:
                self.graphs.fail(key, bad)
            else:
                self.graphs.capture(key, self.fn(key))
        if bad is None and self.splits:  # split steps: see `launch_forward`
            for key in tqdm(keys, desc="capture (split)", unit="key", disable=not progress):
                if key in self.graphs.steps and not self.graphs.has_parts(key):
                    self.graphs.capture_parts(key, *self.parts(key))
        self.slots.reset_padding()
        grew = torch.cuda.memory_reserved(self.device) - mem0 if cuda else 0
        log.info(
            "captured %d graphs (%d failed) in %.1f s, reserved CUDA memory +%.1f MiB%s",
            len(self.graphs.steps), len(self.graphs.failed), time.perf_counter() - t0,
            grew / 2**20, "" if self.graphs.cuda else " (emulated: no CUDA)",
        )  # fmt: skip

    def probe_model(self) -> str | None:
        """Why the model's decode (and verify) outputs are wrong, on one padding row."""
        m, w = self.step.model, self.step.sampler.width(self.step.model)
        ids = torch.zeros(1, dtype=torch.int64, device=self.device)
        slot = torch.full((1,), self.slots.padding_slot, dtype=torch.int64, device=self.device)
        try:
            check_logits(m.decode(ids, ids, slot), (1, w), m, "decode")
            if self.drafter is not None:
                t = self.drafter.k + 1
                check_logits(m.verify(ids.expand(1, t), ids, slot), (1, t, w), m, "verify")
        except Exception as e:
            return f"{type(e).__name__}: {e}"
        finally:
            self.slots.reset_padding()
        return None

    def launch(self, plan: BatchPlan, replay: bool) -> Launched:
        """Replay (or run eagerly) each chunk of the plan and queue its output copies.
        A chunk whose step raises ends its requests with "error"; the executor goes on.
        The caller has waited for the launch before the last one (double buffers)."""
        which = self._launches % 2
        self._launches += 1
        done = Launched(plan, host=self._hosts[which])
        host_slots = self._host_slot_sets[which]
        drafter = self.drafter
        if plan.mask_rows and drafter is None:  # the drafter writes masks per offset
            self.upload_masks([plan.rows[i].slot for i in plan.mask_rows])
        inputs = {t: b.inputs for t, b in self.buffers.items()} if drafter else None
        for key, start, n in plan.chunks:
            if drafter is not None:
                key = drafter.prepare(plan, key, start, n, self.masks, inputs, which)
            done.keys.append((key, start, n))
            src = host_slots[start : start + key.bucket]
            if not plan.uploaded or len(plan.chunks) > 1:
                src.fill_(self.slots.padding_slot)
                src[:n] = torch.from_numpy(plan.slots[start : start + n])
                self.slot_ids[: key.bucket].copy_(src, non_blocking=True)
            try:
                if not (replay and self.graphs.replay(key)):
                    self.eager[key] += 1
                    self.fn(key)()
            except Exception as e:
                log.exception("step of %s failed; its %d requests end with 'error'", key, n)
                done.errors[start] = f"{type(e).__name__}: {e}"
                done.host[key.spec_k + 1].token_ids[start : start + n, 0] = CHUNK_FAILED
                continue
            self.copy_out(key, start, n, done.host)
        plan.uploaded = True
        if drafter is not None:
            done.inflight = drafter.inflight(len(plan.rows))
        plan.launched(done.inflight)
        if self.device.type == "cuda":
            self._end_events(done)
        return done

    @property
    def splits(self) -> bool:
        """Whether steps may split (`launch_forward`): not under a draft model, which
        drafts under the masks before the forward."""
        return self.drafter is None or self.drafter.history is not None

    def parts(self, key: GraphKey):
        """The (forward, draw) functions of `key`'s split step (`StepFn.make_parts`)."""
        t = key.spec_k + 1
        if t not in self.split_logits:  # width and dtype: the model's whole row (make_parts)
            m, pad = self.step.model, self.slots.padding_slot
            ids = torch.zeros(1, dtype=torch.int64, device=self.device)
            slot = torch.full((1,), pad, dtype=torch.int64, device=self.device)
            row = m.decode(ids, ids, slot)
            self.slots.reset_padding()
            spec = self.drafter is not None
            shape = (self.buckets[-1], t, row.shape[-1])
            self.split_logits[t] = row.new_empty(shape if spec else shape[::2])
            if spec:
                inputs = self.buffers[t].inputs
                self.split[t] = SplitBuffers(inputs, inputs.new_zeros((inputs.shape[0], t - 1)),
                                             torch.zeros_like(inputs))  # fmt: skip
        _, out = self.buffers[t].view(key)
        return self.step.make_parts(key, self.slot_ids[: key.bucket], out, self.split_logits[t],
                                    self.split.get(t))  # fmt: skip

    def can_split(self, plan: BatchPlan, replay: bool) -> bool:
        """Whether `plan`'s step may launch as forward, then draw (`launch_forward`)."""
        if not self.splits or len(plan.chunks) != 1:
            return False  # (one chunk: the parts share the slot ids buffer)
        key = plan.chunks[0][0]  # its parts' graphs, or no graph at all (eager)
        return self.graphs.has_parts(key) or not (replay and key in self.graphs.steps)

    def launch_forward(self, plan: BatchPlan, replay: bool) -> Launched:
        """The model's part of a one-chunk step whose token masks the host writes: the
        forward runs while the host finishes the step before (whose tokens those masks
        need); `launch_draw` then uploads the masks and draws. The same values as
        `launch`'s whole step."""
        which = self._launches % 2
        self._launches += 1
        self.split_steps += 1
        done = Launched(plan, host=self._hosts[which])
        key, start, n = plan.chunks[0]
        drafter = self.drafter
        if drafter is not None:  # allowances only: the masks wait for step N
            inputs = {t: b.inputs for t, b in self.buffers.items()}
            key = drafter.prepare(plan, key, start, n, None, inputs, which)
        done.keys.append((key, start, n))
        if not plan.uploaded:
            src = self._host_slot_sets[which][: key.bucket]
            src.fill_(self.slots.padding_slot)
            src[:n] = torch.from_numpy(plan.slots[:n])
            self.slot_ids[: key.bucket].copy_(src, non_blocking=True)
        try:
            if replay and self.graphs.has_parts(key):
                self.graphs.replay_part(key, "forward")
            else:
                self.eager[key] += 1
                self.parts(key)[0]()
        except Exception as e:
            log.exception("step of %s failed; its %d requests end with 'error'", key, n)
            done.errors[start] = f"{type(e).__name__}: {e}"
            done.host[key.spec_k + 1].token_ids[start : start + n, 0] = CHUNK_FAILED
        plan.uploaded = True
        if drafter is not None:
            done.inflight = drafter.inflight(len(plan.rows))
        plan.launched(done.inflight)
        return done

    def launch_draw(self, done: Launched, mask_rows: list[int], replay: bool) -> Launched:
        """The rest of a split step: the masks of `mask_rows` (plan rows still live after
        the step before) up, with speculation each row's cut too (`Drafter.run_masks`),
        the draw, the output copies and the step's event."""
        key, start, n = done.keys[0]
        t = key.spec_k + 1
        if start not in done.errors:
            try:
                if self.drafter is not None:
                    cut = self._host_cut[(self._launches - 1) % 2][: key.bucket]
                    cut.zero_()
                    cut[:n] = torch.from_numpy(self.drafter.run_masks(done.plan, mask_rows,
                                                                      self.masks, n))  # fmt: skip
                    self.split[t].cut[: key.bucket].copy_(cut, non_blocking=True)
                elif mask_rows:
                    self.upload_masks([done.plan.rows[i].slot for i in mask_rows])
                if replay and self.graphs.has_parts(key):
                    self.graphs.replay_part(key, "draw")
                else:
                    self.parts(key)[1]()
                self.copy_out(key, start, n, done.host)
            except Exception as e:
                log.exception("step of %s failed; its %d requests end with 'error'", key, n)
                done.errors[start] = f"{type(e).__name__}: {e}"
                done.host[t].token_ids[start : start + n, 0] = CHUNK_FAILED
        if self.device.type == "cuda":
            self._end_events(done)
        return done

    def copy_out(self, key: GraphKey, start: int, n: int, host: dict) -> None:
        """Queue the copy of the chunk's runs to the host rows at `start` (`host`: T ->
        HostRuns)."""
        t = key.spec_k + 1
        out, h = self.buffers[t].out, host[t]
        # token ids are < 0 exactly where a row emitted nothing, and -1 after a run
        h.token_ids[start : start + n].copy_(out.token_ids[:n], non_blocking=True)
        if self.drafter is not None:
            h.drafts[start : start + n].copy_(self.buffers[t].inputs[:n], non_blocking=True)
        if key.logprobs:
            for f in ("logprobs", "ranks", "top_logprobs", "top_token_ids"):
                getattr(h, f)[start : start + n].copy_(getattr(out, f)[:n], non_blocking=True)

    def upload_masks(self, slots: list[int]) -> None:
        """Fill the mask rows of `slots` on the host and copy them to the slot table."""
        host_rows = self.masks.fill(slots)
        idx = self._host_mask_idx[: len(slots)]
        idx.copy_(torch.tensor(slots, dtype=torch.int64))
        dev_idx = idx.to(self.device, non_blocking=True)
        self.slots.write_masks(dev_idx, host_rows.to(self.device, non_blocking=True))


def build_sampler(backend: str, device: torch.device, rows: int, vocab_size: int,
                  config=None, tp=None, tp_method: str = "auto",
                  speculative: bool = False) -> StepSampler:  # fmt: skip
    """The executor's `StepSampler`: the Triton workspace allocated once for `rows` rows;
    with `tp` (a `distributed.TensorParallel`), draws and verification over this rank's
    vocabulary slice."""
    ws = None
    if backend == "triton":
        from graphexec.sampling.triton.sampler_config import SamplerConfig, Workspace

        config = config or SamplerConfig.default()
        ws = Workspace.allocate(rows, vocab_size, device, config, logprobs=True)
    if tp is None:
        return StepSampler(backend, config, ws, verify_fn=verify_step if speculative else None)
    from graphexec import distributed
    from graphexec.distributed.comm import value_at

    sample = functools.partial(distributed.sample_step, tp=tp, method=tp_method, flag_inf=True)
    verify = functools.partial(verify_step, sample=sample, vocab_size=tp.vocab_size)
    return StepSampler(backend, config, ws, sample, verify if speculative else None,
                       functools.partial(value_at, tp=tp), tp.slice, True)  # fmt: skip
