"""SlotTable: the executor's persistent per-request state, one row per slot.

Every per-request parameter lives in a device tensor of length max_slots + 1 (a
`SamplingTensors` table, the penalty state, the grammar bitmask row, and the decode state
the captured step advances itself: output position, last token, prompt length), so a captured
graph reads them through the step's `slot_ids` and stays valid while requests come and
go. The last row is the padding slot: padding rows of a bucket point at it, it is never
given to a request, and nothing a padding row writes reaches a real slot.

Writes are staged on the host (`assign`, `release`) and reach the device in one `flush`
per step: one packed copy from a pinned buffer (`graphexec.slot_writes`), then a fixed
handful of scatters, no sync. A released slot is reset completely at the next flush
(parameters to plain sampling, counts, prompt mask, position), so nothing leaks into the
request that gets it next.

Storage: the [S] columns of one dtype (the sampling table's and the decode state) are
rows of one [k, S'] block, so a flush scatters each dtype with one `index_copy_`; each
column stays a contiguous [S] view (S' rounds S up to 16 elements to keep alignment).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from graphexec.params import SamplingParams
from graphexec.sampling.tensors import SamplingTensors
from graphexec.slot_writes import PackedUpload

_PLAIN = SamplingParams(seed=0)
_DECODE = ("positions", "last_token", "prompt_lens", "min_tokens")  # SlotTable's own [S] i64
_BLOCK_DTYPES = (torch.int64, torch.float32, torch.int32, torch.bool)


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

    Decode state, advanced inside the step by `graphexec.step.advance`:
        positions   i64 [S]  output position of the next token (the noise counter)
        last_token  i64 [S]  the last sampled token (the next decode input); a flush sets
                             it to the prompt's last token (0 for an empty prompt)
        prompt_lens i64 [S]  prompt length; the model position of the input is
                             prompt_len + position - 1
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
        self.tensors = SamplingTensors.allocate(rows, vocab_size, self.device, max_bias, penalties)
        i64 = dict(dtype=torch.int64, device=self.device)
        words = (vocab_size + 31) // 32
        shape = (rows, words) if offsets == 1 else (rows, offsets, words)
        self.bitmask = torch.full(shape, -1, dtype=torch.int32, device=self.device)
        self.min_words = torch.zeros((rows, max(1, max_min_ids)), **i64)
        self.min_bits = torch.zeros((rows, max(1, max_min_ids)), dtype=torch.int32,
                                    device=self.device)  # fmt: skip
        # the table's scalar columns (whatever host_columns writes) and the decode state,
        # grouped by dtype into blocks: {dtype: (block [k, S'], [(owner, name)])}
        owners: dict[torch.dtype, list[tuple[object, str]]] = {d: [] for d in _BLOCK_DTYPES}
        for name in SamplingTensors.host_columns([_PLAIN], vocab_size):
            dtype = getattr(self.tensors, name).dtype
            if dtype not in owners:
                raise TypeError(f"SamplingTensors.{name}: no block for dtype {dtype}")
            owners[dtype].append((self.tensors, name))
        for name in _DECODE:
            setattr(self, name, torch.zeros(rows, **i64))
            owners[torch.int64].append((self, name))
        self._blocks: dict[torch.dtype, tuple[torch.Tensor, list[tuple[object, str]]]] = {}
        stride = -(-rows // 16) * 16
        for dtype, cols in owners.items():
            if cols:
                block = torch.zeros((len(cols), stride), dtype=dtype, device=self.device)
                for i, (owner, name) in enumerate(cols):
                    block[i, :rows] = getattr(owner, name)  # keep allocate's initial values
                    setattr(owner, name, block[i, :rows])
                self._blocks[dtype] = (block, cols)
        self._upload = PackedUpload(self.device)
        self._free = list(range(max_slots - 1, -1, -1))  # pop() gives the lowest slot
        self._params: dict[int, SamplingParams] = {}
        self._staged: dict[int, tuple[SamplingParams, tuple[int, ...], list[tuple[int, int]]]] = {}
        self._resets: set[int] = set()

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
        """Write every staged change to the device: one packed host->device copy and a
        fixed number of scatters (about 15 ops whatever the number of slots), no sync."""
        dirty = sorted(self._resets | set(self._staged))
        if not dirty:
            return
        self._upload_writes(dirty, self._pieces(dirty))
        self._staged.clear()
        self._resets.clear()

    def _pieces(self, dirty: list[int]) -> dict[str, torch.Tensor]:
        """The host tensors of a flush of `dirty` (released slots get plain values)."""
        staged = [self._staged.get(s) for s in dirty]
        params = [_PLAIN if st is None else st[0] for st in staged]
        prompts = [() if st is None else st[1] for st in staged]
        t = self.tensors
        n, m = len(dirty), self.min_words.shape[1]
        vals = SamplingTensors.host_columns(params, self.vocab_size)
        vals["positions"] = torch.zeros(n, dtype=torch.int64)
        vals["last_token"] = torch.tensor([p[-1] if p else 0 for p in prompts], dtype=torch.int64)
        vals["prompt_lens"] = torch.tensor([len(p) for p in prompts], dtype=torch.int64)
        vals["min_tokens"] = torch.tensor([p.min_tokens for p in params], dtype=torch.int64)
        pieces = {"idx": torch.tensor(dirty, dtype=torch.int64)}
        for dtype, (_, cols) in self._blocks.items():
            pieces[f"block_{dtype}"] = torch.stack([vals[name] for _, name in cols])
        pieces["bias_ids"], pieces["bias_values"] = t.host_bias(params, t.bias_ids.shape[1])
        words = torch.zeros((n, m), dtype=torch.int64)
        bits = torch.zeros((n, m), dtype=torch.int32)
        for i, st in enumerate(staged):
            pairs = [] if st is None else list(st[2])
            if pairs:  # padding entries repeat the first: a scatter of equal values
                pairs += [pairs[0]] * (m - len(pairs))
                words[i] = torch.tensor([w for w, _ in pairs])
                bits[i] = torch.tensor([b for _, b in pairs], dtype=torch.int32)
        pieces["min_words"], pieces["min_bits"] = words, bits
        if t.prompt_mask is not None:
            # the (slot, token) pairs as flat indices into prompt_mask: one index_fill_
            v = self.vocab_size
            flat = [s * v + tok for s, p in zip(dirty, prompts, strict=True) for tok in p]
            pieces["prompt"] = torch.tensor(flat, dtype=torch.int64)
        return pieces

    def _upload_writes(self, dirty: list[int], pieces: dict[str, torch.Tensor]) -> None:
        dev = self._upload.upload(pieces)  # the one host->device copy
        idx = dev["idx"]
        for dtype, (block, _) in self._blocks.items():  # 4 ops: one per dtype block
            block.index_copy_(1, idx, dev[f"block_{dtype}"])
        t = self.tensors
        t.bias_ids.index_copy_(0, idx, dev["bias_ids"])
        t.bias_values.index_copy_(0, idx, dev["bias_values"])
        self.min_words.index_copy_(0, idx, dev["min_words"])
        self.min_bits.index_copy_(0, idx, dev["min_bits"])
        self.bitmask.index_fill_(0, idx, -1)
        if t.token_counts is not None:
            t.token_counts.index_fill_(0, idx, 0)
        if t.prompt_mask is not None:
            t.prompt_mask.index_fill_(0, idx, False)
            if dev["prompt"].numel():
                t.prompt_mask.view(-1).index_fill_(0, dev["prompt"], True)

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


def min_id_words(ids: Sequence[int]) -> list[tuple[int, int]]:
    """[(word, bits)]: the ids as bitmask words, one entry per word (bits as a signed
    int32 value), so a scatter never writes one word twice with different values."""
    words: dict[int, int] = {}
    for t in set(ids):
        words[t // 32] = words.get(t // 32, 0) | (1 << (t % 32))
    return [(w, b - (1 << 32) if b >= 1 << 31 else b) for w, b in sorted(words.items())]
