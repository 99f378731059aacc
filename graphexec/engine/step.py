"""The captured step: the function every graph records and the eager path runs.

A step serves runs of T = spec_k + 1 tokens per row: ordinary decoding is the run of
T = 1. It branches once, statically when its function is made (`StepFn.make`), between
decode + sample (no speculation) and draft + verify (a speculative executor: spec_k = K,
or 0 when no row of a chunk has a draft, T = 1 through the same path). In order (all on the
device, no host sync, static shapes):
  1. gather     each row's output position pos (the noise counter), the model position
                of its last token, and (verify) its draft allowance: how many of the K
                drafts it may use (fewer near max_tokens or the model's length)
  2. draft      (verify) n-gram: the last token into the slot's device history, then the
                drafts matched over it (`NgramHistory.match`; their count written back
                over the allowance, for the host); a draft model: K+1 `decode` calls on
                its own cache, drawing draft j at position pos + j with the request's
                own parameters and noise (strict: the TOKEN stream, so an equal model
                drafts exactly the target's tokens; rejection: SPEC_DRAFT, passing its
                distributions as q)
  3. forward    decode: model.decode(last token) -> logits [b, W]; verify:
                model.verify([last token, d_0 .. d_{K-1}]) -> [b, K+1, W]; shapes checked
                (host metadata only), padding columns past V dropped
  4. sample     token masks gathered from the slot table per offset (grammar, allowed
                ids, bad words; min_tokens' held-back ids cleared by position), then
                `sample_step` (decode) or `verify_step` (verify)
  5. flag       a run holding a token whose raw logit is +inf emits nothing: token -2
                (`sampling.flags.INF_TOKEN`), invalid: the model's fault, an error
  6. advance    real rows with a valid run: position += tokens emitted, last token = the
                last one, token counts += each (n-gram: the run into the history).
                Padding rows (the padding slot) and invalid rows change nothing, so a
                graph's padding never touches a slot.
On CUDA steps 1 and 4's mask gather run as one kernel, steps 5 and 6 as another
(`step_kernels`), and n-gram drafting as a third (`ngram_kernel`), the same values as
their torch references (`step_state`, `NgramHistory`).

Terms: a *bucket* is the static batch size of a graph; its first n rows are the real
requests and the rest are *padding rows* pointing at the table's padding slot.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from graphexec.engine.slots import SlotTable
from graphexec.engine.step_state import (
    advance_decode_reference,
    advance_runs_reference,
    gather_inputs_reference,
)
from graphexec.models.protocol import check_logits
from graphexec.params import MAX_TOP_LOGPROBS
from graphexec.request import GraphKey
from graphexec.rng import Stream, gumbel
from graphexec.sampling import processing
from graphexec.sampling import reference as ref
from graphexec.sampling.step_sampler import StepSampler
from graphexec.sampling.tensors import SamplerOutput
from graphexec.speculative.ngram_device import NgramHistory
from graphexec.speculative.verify import VerifyOutput, clean_drafts
from graphexec.speculative.verify_reference import target_probs


@dataclass
class RunBuffers:
    """Static inputs and outputs of the steps of one run length T, for the largest bucket.

    inputs: i64 [N]: per row the draft allowance, which the step overwrites with the
        number of drafts it verified (copied to the host with the runs).
    out: `VerifyOutput` [N, T] (for T = 1 the run is token_ids[:, 0] and valid alone:
    num_tokens is not written). A key of bucket b uses the first b rows: views keep their
    addresses fixed, so one set serves every graph of that T.
    """

    inputs: torch.Tensor
    out: VerifyOutput

    @classmethod
    def allocate(cls, rows: int, t: int, device: torch.device) -> RunBuffers:
        inputs = torch.zeros(rows, dtype=torch.int64, device=device)
        return cls(inputs, VerifyOutput.allocate(rows, t - 1, device, MAX_TOP_LOGPROBS))

    def view(self, key: GraphKey) -> tuple[torch.Tensor, VerifyOutput]:
        """(inputs [b], outputs [b, T]); logprob fields only when key.logprobs."""
        out = self.out.rows(key.bucket)
        if not key.logprobs:
            s = out.sampled
            out.sampled = SamplerOutput(s.token_ids, s.valid)
            out.logprobs = out.ranks = out.top_logprobs = out.top_token_ids = None
        return self.inputs[: key.bucket], out


@dataclass
class SplitBuffers:
    """A split speculative step's state between its two parts, for the largest bucket:
    inputs i64 [N] (the run length's allowances, `RunBuffers.inputs`), drafts i64 [N, K]
    (the forward's, cleaned), cut i64 [N] (the drafts each row may keep, written by the
    host between the parts)."""

    inputs: torch.Tensor
    drafts: torch.Tensor
    cut: torch.Tensor


@dataclass(frozen=True)
class StepFn:
    """Makes the step function of a key (see the module docstring)."""

    model: object
    slots: SlotTable
    sampler: StepSampler
    draft: object = None  # a draft DecodeModel, or None (n-gram drafts from `history`)
    history: NgramHistory | None = None  # the n-gram drafter's device history
    method: str = "strict"  # verify_step's method
    kernels: bool = False  # the bookkeeping by `step_kernels` (CUDA), else by `step_state`

    def make(self, key: GraphKey, slot_ids: torch.Tensor, inputs: torch.Tensor,
             out: VerifyOutput) -> Callable[[], None]:  # fmt: skip
        if self.sampler.verify_fn is None:  # no speculation: every step decodes
            gather, advance, _ = self._bookkeeping()
            return lambda: self.decode(key, slot_ids, out, gather, advance)
        return lambda: self.verify(key, slot_ids, inputs, out)

    def make_parts(self, key: GraphKey, slot_ids: torch.Tensor, out: VerifyOutput,
                   logits: torch.Tensor, split: SplitBuffers | None = None,
                   ) -> tuple[Callable[[], None], ...]:  # fmt: skip
        """A step as two functions, for steps whose token masks the host writes while the
        model runs: (forward: steps 1-3 into `logits` [>= b, model width] (a speculative
        step's [>= b, T, model width]), a static buffer; draw: steps 1, 4-6 from it).
        Together the same values as `make`'s. The buffer keeps the model's full row, so the
        sampler sees the row stride of the whole step: Triton specialises strides by
        alignment, and a kernel compiled for another alignment may sum a row in another
        order (last-bit logprobs). A speculative step (n-gram drafts only: a draft model
        drafts under the masks) needs `split`: its forward matches the drafts the host
        also finds, its draw cuts each row's at `split.cut` (the drafts its masks kept)."""
        if self.sampler.verify_fn is not None:
            return self._verify_parts(key, slot_ids, out, logits, split)
        gather, advance, _ = self._bookkeeping()
        b = slot_ids.shape[0]
        v = self.slots.vocab_size

        def forward() -> None:
            logits[:b].copy_(self._raw_logits(gather(self.slots, slot_ids), slot_ids))

        def draw() -> None:
            rows = self.sampler.clip(logits[:b], v)
            self._draw(key, slot_ids, out, gather(self.slots, slot_ids), rows, advance)

        return forward, draw

    def _bookkeeping(self) -> tuple[Callable, Callable, Callable]:
        """(gather inputs, advance a decode, advance a speculative step's runs)."""
        if self.kernels:  # (imported here: triton loads when a CUDA executor builds)
            from graphexec.engine import step_kernels as k

            return k.gather_inputs, k.advance_decode, k.advance_runs
        return gather_inputs_reference, advance_decode_reference, advance_runs_reference

    def decode(self, key: GraphKey, slot_ids: torch.Tensor, out: VerifyOutput, gather: Callable,
               advance: Callable) -> None:  # fmt: skip
        inp = gather(self.slots, slot_ids)
        self._draw(key, slot_ids, out, inp, self._logits(inp, slot_ids), advance)

    def _logits(self, inp, slot_ids: torch.Tensor) -> torch.Tensor:
        """Step 3 of a decode: the rows' logits [b, W] (padding columns past V dropped)."""
        return self.sampler.clip(self._raw_logits(inp, slot_ids), self.slots.vocab_size)

    def _raw_logits(self, inp, slot_ids: torch.Tensor) -> torch.Tensor:
        """The model's decode logits [b, model width], shape checked."""
        raw = self.model.decode(inp.last, inp.model_pos, slot_ids)
        b = slot_ids.shape[0]
        return check_logits(raw, (b, self.sampler.width(self.model)), self.model, "decode")

    def _draw(self, key: GraphKey, slot_ids: torch.Tensor, out: VerifyOutput, inp,
              logits: torch.Tensor, advance: Callable) -> None:  # fmt: skip
        """Steps 4-6 of a decode from its logits."""
        slots, sampler = self.slots, self.sampler
        drawn = SamplerOutput(out.token_ids[:, 0], out.valid)  # views: T = 1
        if out.logprobs is not None:
            drawn.logprobs, drawn.ranks = out.logprobs[:, 0], out.ranks[:, 0]
            drawn.top_logprobs = out.top_logprobs[:, 0]
            drawn.top_token_ids = out.top_token_ids[:, 0]
        sampler(logits, slot_ids, inp.pos, slots.tensors, drawn, inp.masks, key.variant)
        advance(slots, slot_ids, logits, drawn.token_ids, drawn.valid, not sampler.flags_in_draw)

    def verify(self, key: GraphKey, slot_ids: torch.Tensor, inputs: torch.Tensor,
               out: VerifyOutput) -> None:  # fmt: skip
        inp, drafts, q, logits = self._verify_forward(key, slot_ids, inputs)
        self._verify_draw(key, slot_ids, inputs, out, inp, drafts, q, logits)

    def _verify_forward(self, key: GraphKey, slot_ids: torch.Tensor, inputs: torch.Tensor):
        """Steps 1-3 of a speculative step: (its inputs, the drafts [b, K] (-1 past a row's),
        the draft model's q or None, the logits [b, K+1, model width])."""
        slots, sampler, k = self.slots, self.sampler, key.spec_k
        inp = self._bookkeeping()[0](slots, slot_ids, k + 1)
        q, hist = None, self.history
        if hist is not None:
            drafts = hist.match(slot_ids, inp.model_pos, inp.last, inputs, k)
        else:
            drafts, q = self.draft_tokens(key, slot_ids, inp.pos, inp.model_pos, inp.masks)
        j = torch.arange(k, device=slot_ids.device).unsqueeze(0)
        drafts = clean_drafts(torch.where(j < inputs.unsqueeze(1), drafts, -1), slots.vocab_size)
        tokens = torch.cat([inp.last.unsqueeze(1), drafts.clamp(min=0)], dim=1)
        raw = self.model.verify(tokens, inp.model_pos, slot_ids)
        b = slot_ids.shape[0]
        logits = check_logits(raw, (b, k + 1, sampler.width(self.model)), self.model, "verify")
        return inp, drafts, q, logits

    def _verify_draw(self, key: GraphKey, slot_ids: torch.Tensor, inputs: torch.Tensor,
                     out: VerifyOutput, inp, drafts: torch.Tensor, q,
                     logits: torch.Tensor) -> None:  # fmt: skip
        """Steps 4-6 of a speculative step from its logits."""
        slots, sampler = self.slots, self.sampler
        logits = sampler.clip(logits, slots.vocab_size)
        sampler.verify(logits, drafts, slot_ids, inp.pos, slots.tensors, out, inp.masks, q,
                       self.method, key.variant)  # fmt: skip
        values = sampler.token_values(logits, out.token_ids)
        self._bookkeeping()[2](slots, slot_ids, values, out, self.history, inp.model_pos)

    def _verify_parts(self, key: GraphKey, slot_ids: torch.Tensor, out: VerifyOutput,
                      logits: torch.Tensor, split: SplitBuffers | None):  # fmt: skip
        if self.history is None or split is None:
            raise ValueError("a speculative step splits with n-gram drafts and SplitBuffers")
        b, k = slot_ids.shape[0], key.spec_k
        inputs, gather = split.inputs[:b], self._bookkeeping()[0]

        def forward() -> None:
            _, drafts, _, raw = self._verify_forward(key, slot_ids, inputs)
            split.drafts[:b, :k].copy_(drafts)
            logits[:b].copy_(raw)

        def draw() -> None:
            inp = gather(self.slots, slot_ids, k + 1)  # with the masks written since
            cut = split.cut[:b]
            j = torch.arange(k, device=slot_ids.device).unsqueeze(0)
            drafts = torch.where(j < cut.unsqueeze(1), split.drafts[:b, :k], -1)
            inputs.copy_(torch.minimum(inputs, cut))  # the drafts verified, for the host
            self._verify_draw(key, slot_ids, inputs, out, inp, drafts, None, logits[:b])

        return forward, draw

    def draft_tokens(self, key: GraphKey, slot_ids, pos, model_pos, masks):
        """Step 2 with a draft model: ([b, K] drafts, [b, K, V] q or None). `masks`
        [b, K+1, W]: strict drafts are drawn under them, so a draft model equal to the
        target still drafts the target's tokens."""
        slots, draft, k = self.slots, self.draft, key.spec_k
        b = slot_ids.shape[0]
        inp = slots.last_token[slot_ids]
        probs = []
        out = SamplerOutput.allocate(b, slot_ids.device, None)
        # the drafts so far, -1 (counted nowhere) past them: one shape for every offset, and
        # each offset's mask copied whole, so that every draw compiles the same kernels (a
        # narrower count or a mask slice off 16 bytes is a new compile of each, minutes)
        drafts = torch.full((b, k), -1, dtype=torch.int64, device=slot_ids.device)
        for j in range(k + 1):
            logits = draft.decode(inp, model_pos + j, slot_ids)
            if j == k:
                break  # this call only wrote the cache entry of the last draft
            logits = check_logits(logits, (b, draft.vocab_size), draft, "decode")
            logits = logits[:, : slots.vocab_size]
            if self.method == "strict":
                self.sampler(logits, slot_ids, pos + j, slots.tensors, out,
                             masks[:, j].contiguous(), key.variant, count_ids=drafts)  # fmt: skip
                d = out.token_ids
            else:
                d, q = draw_q(logits, slot_ids, pos + j, slots, key, drafts[:, :j])
                probs.append(q)
            drafts[:, j] = d
            inp = d.clamp(min=0)
        return drafts, (torch.stack(probs, dim=1) if probs else None)


def draw_q(logits, slot_ids, pos, slots: SlotTable, key: GraphKey, before):
    """A rejection-mode draft: its distribution q (the draft's processed, filtered
    probabilities, as the sampler defines them) and a draw from it on SPEC_DRAFT."""
    xc = processing.collapse_inf(
        processing.process_logits(logits, slot_ids, slots.tensors, None, before)
    )
    q, _ = target_probs(xc, slot_ids, slots.tensors, key.variant)
    ids = torch.arange(q.shape[1], device=q.device).unsqueeze(0)
    seed = slots.tensors.seed[slot_ids].unsqueeze(1)
    g = gumbel(seed, pos.unsqueeze(1), ids, Stream.SPEC_DRAFT).to(torch.float64)
    score = torch.where(q > 0, torch.log(q) + g, -torch.inf)
    d = torch.where((q > 0).any(dim=1), ref.first_argmax(score), -1)
    return d, q.to(torch.float32)
