"""The decode step: the function every captured graph records and the eager path runs.

Steps, in order (all on the device, no host sync, static shapes):
  1. gather     the rows' decode state through `slot_ids` [b]: output position (the
                noise counter), last token (the model input), prompt length
  2. forward    model.decode(last token, model position, slot) -> logits [b, W]; shape
                and dtype checked (host metadata only), padding columns past V dropped
  3. sample     token masks (gathered from the slot table: grammar, allowed ids, bad
                words; min_tokens' held-back ids cleared by position), logit bias,
                penalties, temperature, filters, draw, logprobs writer (`sample_step`)
  4. flag       a row whose sampled token's raw logit is +inf is the model's fault:
                token -2 (`INF_TOKEN`), invalid, so the request finishes "error"
  5. advance    for real rows with a valid token: position += 1, last token = token,
                token count += 1. Padding rows (the padding slot) and invalid rows change
                nothing, so a graph's padding never touches a real slot.

Terms: a *bucket* is the static batch size of a graph; the step's first n rows are the
real requests and the rest are *padding rows* pointing at the table's padding slot.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from graphexec.batch import INF_TOKEN
from graphexec.graphs import GraphKey
from graphexec.models.protocol import check_logits
from graphexec.params import MAX_TOP_LOGPROBS
from graphexec.sampling.pipeline import sample_step
from graphexec.sampling.tensors import SamplerOutput
from graphexec.state import SlotTable

if TYPE_CHECKING:
    from graphexec.sampling.triton.config import SamplerConfig, Workspace


@dataclass(frozen=True)
class StepSampler:
    """How every step samples: the backend and, for "triton", its config and a workspace
    allocated once for the largest bucket (so a step allocates and zeroes nothing).
    With `tp` (a `distributed.TensorParallel`), the model's logits are this rank's
    vocabulary slice and every draw goes through `distributed.sample_step` (`tp_method`)."""

    backend: str
    config: SamplerConfig | None = None
    workspace: Workspace | None = None
    tp: Any = None
    tp_method: str = "auto"

    def width(self, model) -> int:
        """The logits width the model returns: its vocabulary, or this rank's slice."""
        if self.tp is None:
            return model.vocab_size
        lo, hi = self.tp.slice
        return hi - lo

    def clip(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Drop a padded model's columns past V (a slice has none)."""
        return logits if self.tp is not None else logits[..., :vocab_size]

    def flag_inf(self, logits: torch.Tensor, out: SamplerOutput) -> None:
        if self.tp is None:  # (the distributed samplers flag while they draw)
            flag_inf(logits, out)

    @classmethod
    def build(cls, backend: str, device: torch.device, rows: int, vocab_size: int,
              config: SamplerConfig | None = None, tp=None,
              tp_method: str = "auto") -> StepSampler:  # fmt: skip
        if backend != "triton":
            return cls(backend, config, tp=tp, tp_method=tp_method)
        from graphexec.sampling.triton.config import SamplerConfig, Workspace

        cfg = config or SamplerConfig.default()
        ws = Workspace.allocate(rows, vocab_size, device, cfg, logprobs=True)
        return cls(backend, cfg, ws, tp, tp_method)

    @functools.cached_property
    def _sample_fn(self):
        """sample_step, or the distributed one bound to `tp` (made once, not per step)."""
        if self.tp is None:
            return sample_step
        from graphexec import distributed

        return functools.partial(distributed.sample_step, tp=self.tp, method=self.tp_method,
                                 flag_inf=True)  # fmt: skip

    def __call__(self, logits, slot_ids, positions, table, out, bitmask, variant,
                 count_ids=None) -> None:  # fmt: skip
        self._sample_fn(logits, slot_ids, positions, table, out, bitmask, variant,
                        self.backend, config=self.config, workspace=self.workspace,
                        count_ids=count_ids)  # fmt: skip

    def verify(self, logits, drafts, slot_ids, positions, table, out, bitmask, draft_probs,
               method, variant) -> None:  # fmt: skip
        from graphexec.speculative.verify import verify_step

        tp = self.tp
        verify_step(logits, drafts, slot_ids, positions, table, out, bitmask, draft_probs,
                    method, variant, self.backend, config=self.config, workspace=self.workspace,
                    sample=None if tp is None else self._sample_fn,
                    vocab_size=None if tp is None else tp.vocab_size)  # fmt: skip


@dataclass
class StepBuffers:
    """Static inputs and outputs of the step, sized for the largest bucket.

    A key of bucket b uses the first b rows: views keep their addresses fixed, so one set
    serves every graph (as nano-vllm slices its graph variables).
    """

    slot_ids: torch.Tensor  # i64 [N]: the table row of each batch row
    out: SamplerOutput  # token_ids / valid [N], logprobs [N], top-N [N, 20]

    @classmethod
    def allocate(cls, rows: int, padding_slot: int, device: torch.device) -> StepBuffers:
        slot_ids = torch.full((rows,), padding_slot, dtype=torch.int64, device=device)
        return cls(slot_ids, SamplerOutput.allocate(rows, device, MAX_TOP_LOGPROBS))

    def view(self, key: GraphKey) -> tuple[torch.Tensor, SamplerOutput]:
        """(slot_ids [b], outputs [b]) for `key`; logprob fields only when key.logprobs."""
        b, o = key.bucket, self.out
        out = SamplerOutput(o.token_ids[:b], o.valid[:b])
        if key.logprobs:
            out.logprobs, out.ranks = o.logprobs[:b], o.ranks[:b]
            out.top_logprobs, out.top_token_ids = o.top_logprobs[:b], o.top_token_ids[:b]
        return self.slot_ids[:b], out


def advance(slots: SlotTable, slot_ids: torch.Tensor, out: SamplerOutput) -> None:
    """Step 4: move each real row's decode state past the token it just drew."""
    real = (slot_ids != slots.padding_slot) & out.valid
    tok = torch.where(real, out.token_ids, 0)
    slots.positions.index_add_(0, slot_ids, real.to(torch.int64))
    # padding rows write back the value already there, so duplicates agree
    slots.last_token[slot_ids] = torch.where(real, tok, slots.last_token[slot_ids])
    counts = slots.tensors.token_counts
    if counts is not None:
        counts.index_put_((slot_ids, tok), real.to(counts.dtype), accumulate=True)


def decode_step(
    model,
    slots: SlotTable,
    slot_ids: torch.Tensor,
    out: SamplerOutput,
    key: GraphKey,
    sampler: StepSampler,
) -> None:
    """One decode step for the rows `slot_ids` [b] into `out` (see the module docstring)."""
    pos = slots.positions[slot_ids]
    model_pos = slots.prompt_lens[slot_ids] + pos - 1
    raw = model.decode(slots.last_token[slot_ids], model_pos, slot_ids)
    logits = check_logits(raw, (slot_ids.shape[0], sampler.width(model)), model, "decode")
    logits = sampler.clip(logits, slots.vocab_size)
    bitmask = step_masks(slots, slot_ids, pos)
    sampler(logits, slot_ids, pos, slots.tensors, out, bitmask, key.variant)
    sampler.flag_inf(logits, out)
    advance(slots, slot_ids, out)


def step_masks(slots: SlotTable, slot_ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """The rows' token masks [b, W] (offset 0 of the per-offset masks under
    speculation), with min_tokens applied at output positions `pos` [b]."""
    bitmask = slots.bitmask[slot_ids]  # a copy: the slot rows stay as the host wrote them
    bitmask = bitmask[:, 0] if bitmask.dim() == 3 else bitmask
    return slots.min_token_masks(bitmask, slot_ids, pos)


def flag_inf(logits: torch.Tensor, out: SamplerOutput) -> None:
    """Step 4: mark rows that drew a token whose raw logit is +inf (only such rows can:
    the sampler keeps just the +inf tokens of a row that has any)."""
    # an invalid row (-1) reads column 0: if that is +inf, the model is broken all the same
    hit = logits.gather(1, out.token_ids.clamp(min=0).unsqueeze(1)).squeeze(1) == torch.inf
    out.token_ids.masked_fill_(hit, INF_TOKEN)
    out.valid.masked_fill_(hit, False)
