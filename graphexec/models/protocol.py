"""The interface between the executor and a model."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class DecodeModel(Protocol):
    """What the executor needs of a model.

    `prefill` runs eagerly at admission; `decode` runs inside the captured step, so it must
    be graph-capturable: static shapes, no host syncs, no allocation whose size depends on
    data. Logits are [.., vocab_size] float32 / bfloat16 / float16.
    """

    vocab_size: int
    max_seq_len: int  # longest prompt + output the model can hold per slot

    def bind(self, num_slots: int, device: torch.device) -> None:
        """Allocate per-slot state (a KV cache) for `num_slots` slots on `device`; the
        executor calls it once, before any prefill. The last slot is its padding slot."""
        ...

    def prefill(self, slot: int, token_ids: torch.Tensor) -> torch.Tensor:
        """Run the prompt [n] int64 into `slot`'s state; the logits [V] of its last token."""
        ...

    def decode(
        self, input_ids: torch.Tensor, positions: torch.Tensor, slot_ids: torch.Tensor
    ) -> torch.Tensor:
        """One step for B rows: input_ids [B] (the last token of each row), positions [B]
        (that token's index in its sequence), slot_ids [B]; returns logits [B, V]."""
        ...

    def verify(
        self, input_ids: torch.Tensor, positions: torch.Tensor, slot_ids: torch.Tensor
    ) -> torch.Tensor:
        """T tokens per row (speculative verification; capturable like `decode`):
        input_ids [B, T], positions [B] (the index of input_ids[:, 0] in its sequence;
        token t sits at positions + t), slot_ids [B]; writes their cache entries and
        returns logits [B, T, V], row t as `decode` would give after tokens 0..t."""
        ...
