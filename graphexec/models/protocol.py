"""The interface between the executor and a model."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
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

    The *padded layout* puts segment r in row r of an [R, Lmax] grid (Lmax =
    max(lengths)), its token j in column j; columns j >= lengths[r] are padding. `build`
    also ships the index tensors of that layout (computed on the host, in the same copy)
    so a model needs no kernels to derive them; they are None in a batch made by hand
    (`with_layout` adds them) and a model may ignore them.
    """

    token_ids: torch.Tensor  # i64 [N]: every segment's tokens, concatenated
    positions: torch.Tensor  # i64 [N]: each token's index in its sequence
    segment_ids: torch.Tensor  # i64 [N]: the segment (0..R-1) of each token
    slot_ids: torch.Tensor  # i64 [R]: the slot of each segment
    slots: tuple[int, ...]  # [R] host copy of slot_ids
    starts: tuple[int, ...]  # [R] sequence position of each segment's first token
    lengths: tuple[int, ...]  # [R] tokens per segment (>= 1)
    logit_rows: torch.Tensor | None = None  # i64 [M]: tokens (indices into N) to return logits of
    # the padded layout (None unless made by `build` or `with_layout`):
    token_slots: torch.Tensor | None = None  # i64 [N]: slot of each token (slot_ids[segment_ids])
    padded_index: torch.Tensor | None = None  # i64 [N]: each token's r * Lmax + j
    padded_tokens: torch.Tensor | None = None  # i64 [R, Lmax]: token (index into N) at (r, j);
    # a padding column repeats its segment's last token
    padded_positions: torch.Tensor | None = None  # i64 [R, Lmax]: starts[r] + j (padding too)
    logit_padded: torch.Tensor | None = None  # i64 [M]: padded_index[logit_rows]

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
        """From host segments (slot, start, token ids): every device tensor, the padded
        layout's too, is a view of one int64 buffer filled on the host (numpy) and copied
        once; on CUDA from a fresh pinned buffer without blocking (the caching host
        allocator keeps that buffer from reuse until the copy is done). No sync."""
        if not segments:
            raise ValueError("a PrefillBatch needs at least one segment")
        slots, starts, ids = zip(*segments, strict=True)
        slots, starts = tuple(map(int, slots)), tuple(map(int, starts))
        lengths = tuple(map(len, ids))
        if min(lengths) < 1:
            raise ValueError("every prefill segment needs at least one token")
        rows = None if logit_rows is None else np.asarray(logit_rows, dtype=np.int64).reshape(-1)
        n, r, lmax = sum(lengths), len(lengths), max(lengths)
        m = 0 if rows is None else len(rows)
        sizes = (n, n, n, n, n, r, r * lmax, r * lmax, m, m)  # the fields, in _fill's order
        pinned = torch.device(device).type == "cuda"
        host = torch.empty(sum(sizes), dtype=torch.int64, pin_memory=pinned)
        buf = host.numpy()
        buf[:n] = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int64, count=n)
        _fill(buf, slots, starts, lengths, n, lmax, rows)
        dev = host.to(device, non_blocking=True) if pinned else host.to(device)
        parts = dev.split_with_sizes(sizes)
        tok, pos, seg, tok_slot, pidx, slot_ids, ptok, ppos, lrows, lpad = parts
        return cls(
            token_ids=tok, positions=pos, segment_ids=seg, slot_ids=slot_ids, slots=slots,
            starts=starts, lengths=lengths, logit_rows=None if rows is None else lrows,
            token_slots=tok_slot, padded_index=pidx, padded_tokens=ptok.view(r, lmax),
            padded_positions=ppos.view(r, lmax), logit_padded=None if rows is None else lpad,
        )  # fmt: skip

    @classmethod
    def single(cls, slot: int, token_ids: torch.Tensor, max_seq_len: int,
               all_logits: bool = False) -> PrefillBatch:  # fmt: skip
        """One prompt [n] into `slot` from position 0, on its device: logits of every token
        with `all_logits`, else of the last (what `DecodeModel.prefill` returns)."""
        ids = token_ids.reshape(-1)
        n = int(ids.numel())
        if not 0 < n <= max_seq_len:
            raise ValueError(f"prompt length must be in [1, {max_seq_len}], got {n}")
        positions = torch.arange(n, device=ids.device)
        return cls(
            token_ids=ids, positions=positions, segment_ids=torch.zeros_like(positions),
            slot_ids=torch.full((1,), slot, dtype=torch.int64, device=ids.device),
            slots=(slot,), starts=(0,), lengths=(n,),
            logit_rows=positions if all_logits else positions[-1:],
        )  # fmt: skip

    def checked(self, max_seq_len: int, num_slots: int) -> tuple[PrefillBatch, int]:
        """(this batch with its padded layout, C = the furthest position it writes);
        ValueError for a segment past max_seq_len or a slot outside [0, num_slots)."""
        C = max(a + n for a, n in zip(self.starts, self.lengths, strict=True))
        if min(self.starts) < 0 or C > max_seq_len:
            raise ValueError(f"prefill segments must lie in positions [0, {max_seq_len})")
        if min(self.slots) < 0 or max(self.slots) >= num_slots:
            raise ValueError(f"prefill slots must be in [0, {num_slots})")
        return self.with_layout(), C

    def with_layout(self) -> PrefillBatch:
        """This batch with the padded layout's tensors, from its host tuples (one copy;
        logit_padded by one gather on the device)."""
        if self.padded_tokens is not None:
            return self
        n, r, lmax = sum(self.lengths), len(self.lengths), max(self.lengths)
        buf = np.empty(5 * n + r + 2 * r * lmax, dtype=np.int64)
        _fill(buf, self.slots, self.starts, self.lengths, n, lmax, None)
        dev = torch.from_numpy(buf).to(self.token_ids.device)
        tok_slot, pidx, _, ptok, ppos = dev[3 * n :].split((n, n, r, r * lmax, r * lmax))
        rows = self.logit_rows
        return dataclasses.replace(
            self, token_slots=tok_slot, padded_index=pidx, padded_tokens=ptok.view(r, lmax),
            padded_positions=ppos.view(r, lmax), logit_padded=None if rows is None else pidx[rows],
        )  # fmt: skip


def tensors_to(layer, device: torch.device):
    """A frozen dataclass of tensors (a model's layer) with every tensor on `device`
    (None fields stay None)."""
    moved = {f.name: getattr(layer, f.name) for f in dataclasses.fields(layer)}
    return dataclasses.replace(layer, **{k: None if v is None else v.to(device)
                                         for k, v in moved.items()})  # fmt: skip


def _fill(buf: np.ndarray, slots, starts, lengths, n: int, lmax: int, rows) -> None:
    """A `PrefillBatch`'s host values but its token ids (buf[:n]) into `buf`: positions,
    segment_ids, token_slots, padded_index [N each], slot_ids [R], padded_tokens,
    padded_positions [R * Lmax each], then logit_rows, logit_padded [M each] if `rows`.

    A few whole-array numpy ops, none per segment or token: a grid [6, R, Lmax] of
    per-segment values, plus the column j where it counts, whose valid columns
    (j < lengths[r]) are the token rows."""
    r = len(lengths)
    offsets = tuple(itertools.accumulate(lengths, initial=0))
    lasts = tuple(e - 1 for e in offsets[1:])  # each segment's last token
    # rows: start (+ j: position), segment, slot, r * Lmax (+ j: padded index),
    # offset (+ j: token index), last token
    per_seg = starts + tuple(range(r)) + slots + tuple(range(0, r * lmax, lmax))
    per_seg = np.array(per_seg + offsets[:-1] + lasts, dtype=np.int64).reshape(6, r, 1)
    grid = per_seg + _columns(lmax)
    valid = grid[4] <= grid[5]
    np.compress(valid.reshape(-1), grid[:4].reshape(4, -1), axis=1,
                out=buf[n : 5 * n].reshape(4, n))  # fmt: skip
    buf[5 * n : 5 * n + r] = slots
    at = 5 * n + r
    pad = buf[at : at + 2 * r * lmax].reshape(2, r, lmax)
    np.minimum(grid[4], grid[5], out=pad[0])  # padding repeats the last token
    pad[1] = grid[0]
    if rows is not None and len(rows):
        at += 2 * r * lmax
        m = len(rows)
        buf[at : at + m] = rows
        np.take(buf[4 * n : 5 * n], rows, out=buf[at + m : at + 2 * m])


_COLUMNS = np.zeros((6, 1, 0), dtype=np.int64)


def _columns(lmax: int) -> np.ndarray:
    """[6, 1, lmax]: j in rows 0, 3 and 4 (what `_fill` adds to its per-segment rows), 0
    in the others; a view of one array grown as needed."""
    global _COLUMNS
    if _COLUMNS.shape[2] < lmax:
        cols = np.zeros((6, 1, max(lmax, 2 * _COLUMNS.shape[2], 64)), dtype=np.int64)
        cols[[0, 3, 4], 0] = np.arange(cols.shape[2])
        _COLUMNS = cols
    return _COLUMNS[:, :, :lmax]


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


class SlotKVCache:
    """What models whose per-slot state is one cache `kv_cache` [L, 2, S, T, ...] (keys and
    values of every layer, slot and position) share: `prefill` as a one-segment
    `prefill_batch`, `fork`, and `verify`. The model sets kv_cache and `padding_slot`
    in `bind` and defines prefill_batch, decode, max_seq_len and `_forward(input_ids
    [N], positions [N], slot_ids [N]) -> logits [N, V]` over token rows."""

    kv_cache: torch.Tensor | None = None
    device: torch.device
    batch_invariant: bool = False  # a row's logits do not depend on the rows beside it
    padding_slot: int
    prefill_graphs = None  # PrefillGraphs of `_forward` on CUDA (set in bind)

    def _check_bound(self, method: str) -> None:
        if self.kv_cache is None:
            raise RuntimeError(f"{type(self).__name__}.bind(num_slots, device) must run before "
                               f"{method}")  # fmt: skip

    def _prefill_token_rows(self, batch: PrefillBatch) -> torch.Tensor | None:
        """A checked batch as token rows of `_forward`: replayed from `prefill_graphs`
        when the model has them, else eagerly; logits of batch.logit_rows or None."""
        args = (batch.token_ids, batch.positions, batch.token_slots, batch.logit_rows)
        if self.prefill_graphs is not None:
            return self.prefill_graphs(*args)
        return self._forward(*args, prefill=True)

    def fork(self, src_slot: int, dst_slot: int, length: int) -> None:
        """Copy the cache of the first `length` positions (n streams of one prompt)."""
        self.kv_cache[:, :, dst_slot, :length] = self.kv_cache[:, :, src_slot, :length]

    def prefill(self, slot: int, token_ids: torch.Tensor, all_logits: bool = False) -> torch.Tensor:
        """One prompt from position 0: a one-segment `prefill_batch`."""
        self._check_bound("prefill")
        ids = token_ids.to(self.device)
        logits = self.prefill_batch(PrefillBatch.single(slot, ids, self.max_seq_len, all_logits))
        return logits if all_logits else logits[0]

    def verify(
        self, input_ids: torch.Tensor, positions: torch.Tensor, slot_ids: torch.Tensor
    ) -> torch.Tensor:
        """T tokens per row [B, T], bitwise the logits of T decodes.

        Batch-invariant: one forward over the B x T token rows (token t of row b at
        positions[b] + t); every layer writes all rows' K/V before any attends, so row t
        reads exactly the keys t + 1 decodes would have written. A row past the cache
        writes the padding slot (clamped to the last position, it would race with a
        real row there). Otherwise T decode calls: the same kernels at the same shapes,
        since a forward over B x T rows would round differently than one over B."""
        self._check_bound("verify")
        B, T = input_ids.shape
        if not self.batch_invariant:
            steps = [self.decode(input_ids[:, t], positions + t, slot_ids) for t in range(T)]
            return torch.stack(steps, dim=1)
        pos = positions.unsqueeze(1) + torch.arange(T, device=positions.device)  # [B, T]
        slots = torch.where(pos < self.max_seq_len, slot_ids.unsqueeze(1), self.padding_slot)
        logits = self._forward(input_ids.reshape(-1), pos.reshape(-1), slots.reshape(-1))
        return logits.view(B, T, -1)
