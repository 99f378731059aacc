"""The interface between the executor and a model."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class ModelOutputError(RuntimeError):
    """A model returned logits of the wrong shape or dtype (the requests of that step
    finish "error"; a key whose capture hits it is served eagerly)."""


def check_logits(logits, shape: tuple[int, ...], model, method: str):
    """`logits` if it has `shape` and a float dtype the sampler reads; ModelOutputError
    naming the model, the method and both shapes otherwise. Metadata only: no GPU work."""
    name = type(model).__name__
    if not isinstance(logits, torch.Tensor):
        raise ModelOutputError(f"{name}.{method} returned {type(logits).__name__}, not a tensor")
    if tuple(logits.shape) != shape:
        raise ModelOutputError(
            f"{name}.{method} returned logits of shape {list(logits.shape)}; expected "
            f"{list(shape)} (the last dim is the model's vocab_size)"
        )
    if logits.dtype not in LOGIT_DTYPES:
        raise ModelOutputError(
            f"{name}.{method} returned {logits.dtype} logits; expected float32, bfloat16 or float16"
        )
    return logits


@dataclass(frozen=True)
class PrefillBatch:
    """A ragged batch of prompt segments for `DecodeModel.prefill_batch`.

    Segment r is the tokens at sequence positions [starts[r], starts[r] + lengths[r]) of
    the sequence held in slot `slots[r]`; positions before starts[r] are already in that
    slot's state (an earlier chunk). Its tokens are token_ids[offsets[r] : offsets[r] +
    lengths[r]]. Device tensors live on the model's device; host tuples give shapes
    without a sync.
    """

    token_ids: torch.Tensor  # i64 [N]: every segment's tokens, concatenated
    positions: torch.Tensor  # i64 [N]: each token's index in its sequence
    segment_ids: torch.Tensor  # i64 [N]: the segment (0..R-1) of each token
    slot_ids: torch.Tensor  # i64 [R]: the slot of each segment
    slots: tuple[int, ...]  # [R] host copy of slot_ids
    starts: tuple[int, ...]  # [R] sequence position of each segment's first token
    lengths: tuple[int, ...]  # [R] tokens per segment (>= 1)
    logit_rows: torch.Tensor | None = None  # i64 [M]: tokens (indices into N) to return logits of

    @property
    def offsets(self) -> tuple[int, ...]:
        out, o = [], 0
        for n in self.lengths:
            out.append(o)
            o += n
        return tuple(out)

    @classmethod
    def build(cls, segments: Sequence[tuple[int, int, Sequence[int]]], device,
              logit_rows: Sequence[int] | None = None) -> PrefillBatch:  # fmt: skip
        """From host segments (slot, start, token ids); one host-to-device copy."""
        if not segments:
            raise ValueError("a PrefillBatch needs at least one segment")
        slots = tuple(int(s) for s, _, _ in segments)
        starts = tuple(int(a) for _, a, _ in segments)
        lengths = tuple(len(ids) for _, _, ids in segments)
        if min(lengths) < 1:
            raise ValueError("every prefill segment needs at least one token")
        n, r = sum(lengths), len(segments)
        rows = list(logit_rows) if logit_rows is not None else []
        host = torch.empty(3 * n + r + len(rows), dtype=torch.int64)
        host[:n] = torch.tensor([t for _, _, ids in segments for t in ids], dtype=torch.int64)
        host[n : 2 * n] = torch.cat(
            [torch.arange(a, a + k) for a, k in zip(starts, lengths, strict=True)]
        )
        host[2 * n : 3 * n] = torch.repeat_interleave(torch.arange(r), torch.tensor(lengths))
        host[3 * n : 3 * n + r] = torch.tensor(slots, dtype=torch.int64)
        if rows:
            host[3 * n + r :] = torch.tensor(rows, dtype=torch.int64)
        dev = host.to(device)
        return cls(
            token_ids=dev[:n], positions=dev[n : 2 * n], segment_ids=dev[2 * n : 3 * n],
            slot_ids=dev[3 * n : 3 * n + r], slots=slots, starts=starts, lengths=lengths,
            logit_rows=dev[3 * n + r :] if logit_rows is not None else None,
        )  # fmt: skip


@runtime_checkable
class DecodeModel(Protocol):
    """What the executor needs of a model.

    `prefill` runs eagerly at admission; `decode` runs inside the captured step, so it must
    be graph-capturable: static shapes, no host syncs, no allocation whose size depends on
    data. Logits are [.., vocab_size] float32 / bfloat16 / float16; the executor checks
    shape and dtype (`check_logits`). `vocab_size` may exceed the tokenizer's (a padded
    embedding): the padding columns are never sampled.

    Optional: `prefill_batch(batch: PrefillBatch) -> logits [M, V] or None` runs a ragged
    batch of prompt segments (several prompts, and chunks of a long one continuing at
    `starts[r]`) into their slots' state in one pass, returning the logits of the tokens
    `batch.logit_rows` (None when that is None); the executor prefills through it when
    present (chunked to its token budget), else one `prefill` per prompt, unchunked.
    `fork(src_slot, dst_slot, length)` copies the state of the first `length`
    positions of one slot into another, so n streams of one prompt share one prefill;
    `prefill(..., all_logits=True)` returns [n, V] logits (for prompt_logprobs).
    """

    vocab_size: int
    max_seq_len: int  # longest prompt + output the model can hold per slot

    def bind(self, num_slots: int, device: torch.device) -> None:
        """Allocate per-slot state (a KV cache) for `num_slots` slots on `device`; the
        executor calls it once, before any prefill. The last slot is its padding slot."""
        ...

    def prefill(self, slot: int, token_ids: torch.Tensor, all_logits: bool = False) -> torch.Tensor:
        """Run the prompt [n] int64 into `slot`'s state; the logits [V] of its last token
        ([n, V], one row per prompt token, with all_logits)."""
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
