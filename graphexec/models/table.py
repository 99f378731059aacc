"""TableModel: logits that are a pure function of (position, last token, model seed).

Never of the slot, the batch or the row, so executor tests can compare a request's
tokens exactly across batch compositions, buckets and eager vs replay. The logits of
(position p, token t) are Philox noise (`graphexec.rng`) keyed on seed' = hash(seed, t),
counter p, scaled to a spread like a language model's (a few peaked tokens per row).
"""

from __future__ import annotations

import torch

from graphexec.models.protocol import PrefillBatch
from graphexec.rng import Stream, random_bits

_MIX = 0x9E3779B97F4A7C15 & (2**62 - 1)  # spreads token ids over the 62-bit key space


class TableModel:
    """A stateless `DecodeModel` for tests.

    Args:
        vocab_size: V.
        seed: the table's seed; two seeds give unrelated tables.
        max_seq_len: positions allowed (prompt + output).
        device: where logits are made.
        scale: logit spread; larger gives peakier rows.
        shard: (rank, world): return only the rank's vocabulary slice
            (`distributed.vocab_slices`) of every logits row, as a tensor-parallel
            model's last layer does; its columns equal the unsharded model's.
    """

    def __init__(
        self,
        vocab_size: int,
        seed: int = 0,
        max_seq_len: int = 4096,
        device: torch.device | str = "cpu",
        scale: float = 6.0,
        shard: tuple[int, int] | None = None,
    ) -> None:
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        self.vocab_size = vocab_size
        self.max_seq_len = max_seq_len
        self.seed = seed
        self.device = torch.device(device)
        self.scale = scale
        self.vocab_slice = _slice(vocab_size, shard)
        self._tokens = torch.arange(*self.vocab_slice, device=self.device)

    def logits(self, positions: torch.Tensor, last_tokens: torch.Tensor) -> torch.Tensor:
        """[B, V] float32 logits of rows (positions [B], last_tokens [B]); [B, hi - lo]
        with a shard."""
        key = (self.seed * 1_000_003 + last_tokens.to(torch.int64) * _MIX) & (2**62 - 1)
        bits = random_bits(
            key.unsqueeze(1), positions.to(torch.int64).unsqueeze(1), self._tokens.unsqueeze(0),
            Stream.MODEL,
        )  # fmt: skip
        u = (bits >> 8).to(torch.float32) * 2.0**-24  # [0, 1)
        # cubing keeps most of the row low and a few tokens high, like a real model
        return self.scale * (u**3) * 2.0 - self.scale * 0.25

    def bind(self, num_slots: int, device: torch.device | str) -> None:
        del num_slots  # stateless
        self.device = torch.device(device)
        self._tokens = torch.arange(*self.vocab_slice, device=self.device)

    def prefill(self, slot: int, token_ids: torch.Tensor, all_logits: bool = False) -> torch.Tensor:
        n = int(token_ids.numel())
        if not 0 < n <= self.max_seq_len:
            raise ValueError(f"prompt length must be in [1, {self.max_seq_len}], got {n}")
        ids = token_ids.reshape(-1).to(self.device)
        if all_logits:
            return self.logits(torch.arange(n, device=self.device), ids)
        pos = torch.tensor([n - 1], device=self.device)
        return self.logits(pos, ids[-1:])[0]

    def prefill_batch(self, batch: PrefillBatch) -> torch.Tensor | None:
        """The logits of the tokens `batch.logit_rows` (no state to fill: None without)."""
        if max(a + n for a, n in zip(batch.starts, batch.lengths, strict=True)) > self.max_seq_len:
            raise ValueError(f"prefill segments must lie in positions [0, {self.max_seq_len})")
        rows = batch.logit_rows
        if rows is None:
            return None
        return self.logits(batch.positions[rows], batch.token_ids[rows])

    def fork(self, src_slot: int, dst_slot: int, length: int) -> None:
        del src_slot, dst_slot, length  # stateless: every slot already sees the same rows

    def decode(
        self, input_ids: torch.Tensor, positions: torch.Tensor, slot_ids: torch.Tensor
    ) -> torch.Tensor:
        del slot_ids  # the point of this model: rows never depend on their slot
        return self.logits(positions, input_ids)

    def verify(
        self, input_ids: torch.Tensor, positions: torch.Tensor, slot_ids: torch.Tensor
    ) -> torch.Tensor:
        del slot_ids
        B, T = input_ids.shape
        pos = positions.unsqueeze(1) + torch.arange(T, device=positions.device)
        return self.logits(pos.reshape(-1), input_ids.reshape(-1)).view(B, T, -1)


def _slice(vocab_size: int, shard: tuple[int, int] | None) -> tuple[int, int]:
    """[lo, hi) of the vocabulary a model with `shard` = (rank, world) returns."""
    if shard is None:
        return 0, vocab_size
    from graphexec.distributed import vocab_slices

    rank, world = shard
    if not 0 <= rank < world:
        raise ValueError(f"shard must be (rank, world) with 0 <= rank < world, got {shard}")
    return vocab_slices(vocab_size, world)[rank]
