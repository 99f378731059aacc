"""SlotTable: the executor's persistent per-request state, one row per slot.

Every per-request parameter lives in a device tensor of length max_slots + 1 (a
`SamplingTensors` table, the penalty state, the grammar bitmask row, and the decode state
the captured step advances itself: output position, last token, prompt length), so a captured
graph reads them through the step's `slot_ids` and stays valid while requests come and
go. The last row is the padding slot: padding rows of a bucket point at it, it is never
given to a request, and nothing a padding row writes reaches a real slot.

Writes are staged on the host (`assign`, `release`) and reach the device in one `flush`
per step, with no sync. A released slot is reset completely at the next flush
(parameters to plain sampling, counts, prompt mask, position), so nothing leaks into the
request that gets it next.

Storage: what only the host writes lives in one fixed device buffer with an exact host
mirror, copied whole at a flush (`engine.slot_writes`); what the device writes (positions,
last tokens, token counts, prompt mask, bitmask) is scattered after it: 6 device ops in
all, however many slots a flush touches.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from graphexec.engine.slot_writes import (
    FIELD,
    NUMPY,
    PackedUpload,
    SlotRows,
    min_id_words,
    place,
)
from graphexec.params import SamplingParams
from graphexec.sampling.tensors import HOST_FIELDS, SamplingTensors

_PLAIN = SamplingParams(seed=0)
_OWN = ("prompt_lens", "min_tokens")  # SlotTable's own host-owned [S] i64 columns
_FLAT = 1 << 16  # prompt tokens a flush carries in the buffer (more take a second copy)
# block of each column dtype (float32 columns view int32 rows: one scatter for both)
_BLOCK_OF = {torch.int64: torch.int64, torch.int32: torch.int32, torch.float32: torch.int32,
             torch.bool: torch.bool}  # fmt: skip


class SlotTable:
    """Per-slot device state with staged host writes.

    Args:
        max_slots: how many requests may hold a slot at once.
        vocab_size: V, for the penalty state and parameter checks.
        device: where the tensors live.
        max_bias: the most logit-bias entries one request may carry.
        penalties: allocate token counts and prompt masks ([max_slots + 1, V] each).
        offsets: token masks per slot (K+1 under speculation: [max_slots + 1, K+1,
            ceil(V/32)], one per offset of a run).
        max_min_ids: the most distinct ids `min_tokens` may hold back per request.

    Token masks: `bitmask` [S, W] int32 (or [S, K+1, W]), all ones = everything allowed;
    the host writes the rows of requests with a grammar, allowed_token_ids or bad_words.
    min_tokens is applied inside the step on a gathered copy (`min_token_masks`):
        min_tokens  i64 [S]     the output position before which the ids stay banned
        min_words   i64 [S, M]  word of the bitmask holding them (grouped per word)
        min_bits    i32 [S, M]  the bits to clear in that word

    Decode state, advanced inside the step (`engine.step_state`, `engine.step_kernels`):
        positions   i64 [S]  output position of the next token (the noise counter)
        last_token  i64 [S]  the last sampled token (the next decode input); a flush sets
                             it to the prompt's last token (0 for an empty prompt)
        prompt_lens i64 [S]  prompt length; the model position of the input is
                             prompt_len + position - 1

    Only positions, last_token, token counts, the prompt mask and the bitmask may be
    written on the device (the bitmask through `write_masks`): each flush copies the
    host mirror over the rest.
    """

    positions: torch.Tensor
    last_token: torch.Tensor
    prompt_lens: torch.Tensor
    min_tokens: torch.Tensor

    def __init__(
        self,
        max_slots: int,
        vocab_size: int,
        device: torch.device | str,
        max_bias: int = 16,
        penalties: bool = True,
        offsets: int = 1,
        max_min_ids: int = 16,
    ) -> None:
        if max_slots < 1:
            raise ValueError(f"max_slots must be >= 1, got {max_slots}")
        self.max_slots = max_slots
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        rows = max_slots + 1
        t = self.tensors = SamplingTensors.allocate(rows, vocab_size, "cpu", max_bias)
        i32, i64 = dict(dtype=torch.int32, device=self.device), dict(dtype=torch.int64)
        if penalties:
            t.token_counts = torch.zeros((rows, vocab_size), **i32)
            t.prompt_mask = torch.zeros((rows, vocab_size), dtype=torch.bool, device=self.device)
        words = (vocab_size + 31) // 32
        shape = (rows, words) if offsets == 1 else (rows, offsets, words)
        self.bitmask = torch.full(shape, -1, **i32)
        stride = -(-rows // 16) * 16
        # device-written decode state: [2, S'] (positions, last_token)
        self._decode = torch.zeros((2, stride), device=self.device, **i64)
        self.positions, self.last_token = self._decode[0, :rows], self._decode[1, :rows]
        m = max(1, max_min_ids)
        own = {"min_words": torch.zeros((rows, m), **i64),
               "min_bits": torch.zeros((rows, m), dtype=torch.int32)}  # fmt: skip
        self._host_owned(rows, stride, own)
        nb = t.bias_ids.shape[1]
        self._row = SlotRows(HOST_FIELDS + _OWN, self._blocks, lambda c: self._column(c).dtype,
                             nb, m, vocab_size)  # fmt: skip
        self._rows = self._row.format
        self._scratch = np.zeros((max_slots, self._rows.size), dtype=np.uint8)
        self._plain_row = self._row(_PLAIN, 0, [])  # what a released slot gets
        self._views: dict[int, tuple] = {}  # _flush_views, by n
        self._mask = t.prompt_mask is not None
        self._mask_flat = t.prompt_mask.view(-1) if self._mask else None
        self._free = list(range(max_slots - 1, -1, -1))  # pop() gives the lowest slot
        self._params: dict[int, SamplingParams] = {}
        self._staged: dict[int, tuple[SamplingParams, tuple[int, ...], list[tuple[int, int]]]] = {}
        self._resets: set[int] = set()

    def _host_owned(self, rows: int, stride: int, own: dict[str, torch.Tensor]) -> None:
        """Move the host-owned tensors (initial values kept) into one buffer with a host
        mirror: blocks of [S] columns by element size, then the [S, k] tensors."""
        t = self.tensors
        cols = {n: getattr(t, n) for n in HOST_FIELDS}
        cols |= {n: torch.zeros(rows, dtype=torch.int64) for n in _OWN}
        groups: dict[torch.dtype, list[str]] = {d: [] for d in FIELD}
        for name, col in cols.items():
            if col.dtype not in _BLOCK_OF:
                raise TypeError(f"column {name}: no block for dtype {col.dtype}")
            groups[_BLOCK_OF[col.dtype]].append(name)
        self._blocks = {d: g for d, g in groups.items() if g}  # {block dtype: column names}
        wide = {"bias_ids": t.bias_ids, "bias_values": t.bias_values, **own}
        specs = [(FIELD[d], d, (len(g), stride)) for d, g in self._blocks.items()]
        specs += [(n, x.dtype, tuple(x.shape)) for n, x in wide.items()]
        sizes = [d.itemsize * shape[0] * shape[1] for _, d, shape in specs]
        offs, self._state_bytes = place(sizes)
        self._upload = PackedUpload(self.device, self._state_bytes + 8 * (3 * rows + _FLAT))
        host, dev = self._upload.host(), self._upload.dev_buf
        self._dst: dict[str, np.ndarray] = {}  # field name: its mirror, as [k, S]
        for (name, dtype, shape), at, size in zip(specs, offs, sizes, strict=True):
            mirror = host[at : at + size].view(NUMPY[dtype]).reshape(shape)
            view = dev[at : at + size].view(dtype).view(shape)
            if name in wide:
                mirror[...] = wide[name].numpy()
                self._dst[name] = mirror.T
                setattr(self if name in own else t, name, view)
            else:
                self._dst[name] = mirror
                for i, col in enumerate(self._blocks[dtype]):
                    mirror[i, :rows] = cols[col].view(dtype).numpy()
                    setattr(self if col in _OWN else t, col, view[i, :rows].view(cols[col].dtype))
        self._upload.send(self._state_bytes)
        self._payload = host[self._state_bytes :].view(np.int64)  # ids, decode values, prompts

    @property
    def padding_slot(self) -> int:
        return self.max_slots

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def params(self, slot: int) -> SamplingParams:
        return self._params[slot]

    def assign(self, params: SamplingParams, prompt_token_ids: Sequence[int] = (),
               min_ids: Sequence[int] = ()) -> int:  # fmt: skip
        """Take the lowest free slot for `params` (seed set); written at the next flush.
        `min_ids`: the ids banned before `params.min_tokens` (stop ids and EOS)."""
        if params.seed is None:
            raise ValueError("params.seed must be set before a slot is assigned")
        params.check_vocab(self.vocab_size)
        nb = self.tensors.bias_ids.shape[1]
        if len(params.logit_bias or {}) > nb:
            raise ValueError(f"logit_bias may hold at most {nb} entries in this executor")
        if not self._free:
            raise RuntimeError(f"all {self.max_slots} slots are in use")
        words = min_id_words(min_ids if params.min_tokens else ())
        if len(words) > self.min_words.shape[1]:
            raise ValueError(
                f"min_tokens holds back {len(set(min_ids))} stop ids in {len(words)} bitmask "
                f"words; this executor allows {self.min_words.shape[1]} (max_min_ids)"
            )
        slot = self._free.pop()
        self._params[slot] = params
        self._staged[slot] = (params, tuple(prompt_token_ids), words)
        return slot

    def release(self, slot: int) -> None:
        """Give `slot` back; it is reset at the next flush."""
        if slot not in self._params:
            raise ValueError(f"slot {slot} is not assigned")
        del self._params[slot]
        self._staged.pop(slot, None)
        self._resets.add(slot)
        self._free.append(slot)
        self._free.sort(reverse=True)

    def flush(self) -> None:
        """Write every staged change to the device: one host->device copy, then 5 ops
        on the device-written state (6 in all, whatever the number of slots), no sync."""
        dirty = sorted(self._resets | self._staged.keys())
        if not dirty:
            return
        n = len(dirty)
        scatters, idx, decode, flat_dev = self._flush_views(n)
        self._upload.host()  # the mirror and payload are about to change
        pay, rows, size = self._payload, self._scratch, self._rows.size
        pack, v, mask = self._rows.struct.pack_into, self.vocab_size, self._mask
        flat_n = sum(len(st[1]) for st in self._staged.values()) if mask else 0
        fits = 3 * n + flat_n <= len(pay)
        # payload: slot ids, positions (0), last tokens, prompt-mask indices
        flat = pay[3 * n : 3 * n + flat_n] if fits else np.empty(flat_n, np.int64)
        last, at = [0] * n, 0
        for i, s in enumerate(dirty):
            st = self._staged.get(s)
            if st is None:
                pack(rows, i * size, *self._plain_row)
                continue
            prompt = st[1]
            pack(rows, i * size, *self._row(st[0], len(prompt), st[2]))
            if prompt:
                last[i] = prompt[-1]
                if mask:  # the (slot, token) pairs as flat indices into prompt_mask
                    seg = flat[at : at + len(prompt)]
                    np.add(np.fromiter(prompt, np.int64, len(prompt)), s * v, out=seg)
                    at += len(prompt)
        pay[: 3 * n] = dirty + [0] * n + last
        ids = pay[:n]
        for dst, src in scatters:  # the rows into the mirror
            dst[:, ids] = src
        self._upload.send(self._state_bytes + 8 * (3 * n + (flat_n if fits else 0)))
        self._decode.index_copy_(1, idx, decode)
        self.bitmask.index_fill_(0, idx, -1)
        t = self.tensors
        if t.token_counts is not None:
            t.token_counts.index_fill_(0, idx, 0)
        if mask:
            t.prompt_mask.index_fill_(0, idx, False)
            if flat_n:
                flat_dev = flat_dev[:flat_n] if fits else self._upload.extra(flat)
                self._mask_flat.index_fill_(0, flat_dev, True)
        self._staged.clear()
        self._resets.clear()

    def _flush_views(self, n: int) -> tuple:
        """What a flush of `n` slots works through, made once per n: (mirror [k, S] view,
        scratch field [k, n]) pairs, and on the device slot ids [n], decode values [2, n]
        (positions, last tokens), prompt indices (from 3n on)."""
        v = self._views.get(n)
        if v is None:
            fields = self._rows.views(self._scratch[:n])
            scatters = [(self._dst[name], f.T) for name, f in fields.items()]
            pay = self._upload.dev_buf[self._state_bytes :].view(torch.int64)
            v = self._views[n] = (scatters, pay[:n], pay[n : 3 * n].view(2, n), pay[3 * n :])
        return v

    def _column(self, name: str) -> torch.Tensor:
        return getattr(self if name in _OWN else self.tensors, name)

    def write_masks(self, slot_ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Copy token-mask rows into the slots `slot_ids` [n] (device): rows [n, W] go to
        offset 0, rows [n, T, W] (speculation) one per offset."""
        bm = self.bitmask
        (bm[:, 0] if bm.dim() == 3 and rows.dim() == 2 else bm).index_copy_(0, slot_ids, rows)

    def min_token_masks(self, masks: torch.Tensor, slot_ids: torch.Tensor,
                        positions: torch.Tensor) -> torch.Tensor:  # fmt: skip
        """Clear, in `masks` [n, W] (a gathered copy of rows `slot_ids` [n]), the bits of
        the ids each row holds back while `positions` [n] < its min_tokens. In place,
        graph-capturable: a gather and a scatter of [n, M] words."""
        active = positions < self.min_tokens[slot_ids]
        words = self.min_words[slot_ids]
        bits = torch.where(active.unsqueeze(1), self.min_bits[slot_ids], 0)
        masks.scatter_(1, words, masks.gather(1, words) & ~bits)
        return masks

    def reset_padding(self) -> None:
        """Zero the padding slot's decode state (capture warm-ups run steps on it)."""
        p = self.padding_slot
        for t in (self.positions, self.last_token, self.prompt_lens):
            t[p] = 0
        if self.tensors.token_counts is not None:
            self.tensors.token_counts[p] = 0
