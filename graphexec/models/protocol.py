"""The interface between the executor and a model."""

from __future__ import annotations

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


@runtime_checkable
class DecodeModel(Protocol):
    """What the executor needs of a model.

    `prefill` runs eagerly at admission; `decode` runs inside the captured step, so it must
    be graph-capturable: static shapes, no host syncs, no allocation whose size depends on
    data. Logits are [.., vocab_size] float32 / bfloat16 / float16; the executor checks
    shape and dtype (`check_logits`). `vocab_size` may exceed the tokenizer's (a padded
    embedding): the padding columns are never sampled.

    Optional: `fork(src_slot, dst_slot, length)` copies the state of the first `length`
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
