"""How every step samples: the backend, its workspace, and the tensor-parallel strategy."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from graphexec.sampling.pipeline import sample_step
from graphexec.sampling.tensors import SamplerOutput

if TYPE_CHECKING:
    from graphexec.sampling.triton.sampler_config import SamplerConfig, Workspace


@dataclass(frozen=True)
class StepSampler:
    """The sampler of a captured step: `__call__` draws one token per row, `verify`
    checks drafts (both write static outputs and sync nothing).

    backend / config / workspace: `sample_step`'s; the Triton workspace is allocated once
        for the largest bucket, so a step allocates and zeroes nothing.
    sample_fn: `pipeline.sample_step`, or `distributed.sample_step` bound to a group: the
        logits are then this rank's vocabulary slice (`vocab_slice`).
    verify_fn: `speculative.verify_step`, bound to sample_fn (None: no speculation).
    values_at: (logits [b, T, W], tokens [b, T]) -> the raw logits at the tokens [b, T];
        across ranks with a vocabulary slice.
    flags_in_draw: the distributed draw marks +inf tokens itself (decode needs no check).
    """

    backend: str
    config: SamplerConfig | None = None
    workspace: Workspace | None = None
    sample_fn: Callable = sample_step
    verify_fn: Callable | None = None
    values_at: Callable | None = None
    vocab_slice: tuple[int, int] | None = None
    flags_in_draw: bool = False

    def width(self, model) -> int:
        """The logits width the model returns: its vocabulary, or this rank's slice."""
        if self.vocab_slice is None:
            return model.vocab_size
        lo, hi = self.vocab_slice
        return hi - lo

    def clip(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Drop a padded model's columns past V (a slice has none)."""
        return logits if self.vocab_slice is not None else logits[..., :vocab_size]

    def token_values(self, logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """[b, T] raw logits at tokens [b, T] (-1 read as column 0) of logits [b, T, W]."""
        if self.values_at is not None:
            return self.values_at(logits, tokens)
        return logits.gather(2, tokens.clamp(min=0).unsqueeze(2)).squeeze(2)

    def __call__(self, logits, slot_ids, positions, table, out: SamplerOutput, bitmask, variant,
                 count_ids=None) -> None:  # fmt: skip
        self.sample_fn(logits, slot_ids, positions, table, out, bitmask, variant, self.backend,
                       config=self.config, workspace=self.workspace,
                       count_ids=count_ids)  # fmt: skip

    def verify(self, logits, drafts, slot_ids, positions, table, out, bitmask, draft_probs,
               method, variant) -> None:  # fmt: skip
        self.verify_fn(logits, drafts, slot_ids, positions, table, out, bitmask, draft_probs,
                       method, variant, self.backend, config=self.config,
                       workspace=self.workspace)  # fmt: skip
