"""Host mirror uploads: a flush's writes reach the device as one copy and no scatter.

`SlotTable` keeps every host-owned per-slot tensor (sampling parameters, bias, min-token
words) as a view of one fixed device buffer, and an exact host mirror of that buffer in
pinned memory. A flush edits the mirror with numpy and copies it whole, plus a small
payload after it (slot ids, decode-state values, prompt-mask indices), in one
non-blocking copy: the host-owned state needs no device op of its own, whatever the
number of slots. A few hundred bytes per slot, so the copy is a few microseconds of DMA.
The [S] columns of one element size are rows of one [k, S'] block (float32 columns view
rows of the int32 block); each column stays a contiguous [S] view (S' rounds S up to 16).

Slot values are packed with `struct`, one row per dirty slot (`RowFormat`): Python
floats are rounded to float32 by struct "f" exactly as torch.tensor rounds them, and a
float32 column living in an int32 block gets its bits.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from operator import itemgetter

import numpy as np
import torch

from graphexec.params import SamplingParams
from graphexec.sampling.tensors import SamplingTensors

_CODES = {torch.int64: "q", torch.int32: "if", torch.float32: "f", torch.bool: "?"}
_CODE = {torch.int64: "q", torch.int32: "i", torch.float32: "f", torch.bool: "?"}
FIELD = {torch.int64: "block_int64", torch.int32: "block_int32", torch.bool: "block_bool"}
NUMPY = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32,
         torch.bool: np.bool_}  # fmt: skip


class RowFormat:
    """The byte layout of one row: `fields` are (name, dtype, struct format of its
    elements, e.g. "4q" or "ffi"), in the order given, element sizes non-increasing, so
    that with rows 8-aligned every field is a plain view (rows padded to 8 bytes). A
    field may mix float32 and int32 elements: read as int32, the float32 ones are bits."""

    def __init__(self, fields: Sequence[tuple[str, torch.dtype, str]]) -> None:
        self.fields: dict[str, tuple[torch.dtype, int, int]] = {}  # name: dtype, at, nbytes
        fmt, at, last = "<", 0, 8
        for name, dtype, elems in fields:
            codes = "".join(c for c in elems if not c.isdigit())
            if dtype not in _CODES or not set(codes) <= set(_CODES[dtype]):
                raise TypeError(f"field {name}: {elems!r} cannot be read as {dtype}")
            if dtype.itemsize > last:
                raise ValueError(f"field {name}: fields must go by element size (8, 4, 1)")
            last, nbytes = dtype.itemsize, struct.calcsize("<" + elems)
            self.fields[name] = (dtype, at, nbytes)
            fmt, at = fmt + elems, at + nbytes
        self.size = at + -at % 8
        self.struct = struct.Struct(f"{fmt}{self.size - at}x")

    def views(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        """The fields of `rows` ([n, size] uint8) as [n, k] typed views."""
        return {
            name: rows[:, at : at + nbytes].view(NUMPY[dtype])
            for name, (dtype, at, nbytes) in self.fields.items()
        }


def place(sizes: Sequence[int], align: int = 256) -> tuple[list[int], int]:
    """Offsets for buffers of `sizes` bytes laid out one after another, each `align`ed
    (kernels get the alignment a fresh allocation has), and the end."""
    offsets, at = [], 0
    for n in sizes:
        offsets.append(at)
        at += n + -n % align
    return offsets, at


class PackedUpload:
    """A pinned host buffer of `nbytes` and its device twin (on the CPU, the same
    buffer), both fixed for the owner's life so device views of the twin stay valid
    under captured graphs, and the event of the last copy between them.

    `host()` waits for that copy (the only host sync: the mirror is about to change;
    usually long done, it was queued a step ago) and gives the host buffer as numpy
    uint8; `send(nbytes)` copies its first `nbytes` once, without blocking, on the
    current stream (so work queued there before has read the old values).
    """

    def __init__(self, device: torch.device | str, nbytes: int) -> None:
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        self.host_buf = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=self._cuda)
        self.dev_buf = self.host_buf
        if self._cuda:
            self.dev_buf = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
            # an int: current_stream(int) costs half what current_stream(device) does
            self._index = (
                self.device.index if self.device.index is not None else torch.cuda.current_device()
            )
        self._host = self.host_buf.numpy()
        self._copied: torch.cuda.Event | None = None
        self._spans: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # KiB: (dst, src)

    def host(self) -> np.ndarray:
        if self._copied is not None:
            self._copied.synchronize()
        return self._host

    def send(self, nbytes: int) -> None:
        if not self._cuda:
            return
        k = -(-nbytes // 1024)  # whole KiB (at most the buffer): a few slices, made once
        span = self._spans.get(k)
        if span is None:
            end = min(1024 * k, self.host_buf.numel())
            span = self._spans[k] = (self.dev_buf[:end], self.host_buf[:end])
        span[0].copy_(span[1], non_blocking=True)
        if self._copied is None:
            self._copied = torch.cuda.Event()
        self._copied.record(torch.cuda.current_stream(self._index))

    def extra(self, values: np.ndarray) -> torch.Tensor:
        """`values` on the device by a copy of their own (for what does not fit the
        buffer): from a fresh pinned tensor, which the caching host allocator keeps
        until the copy is done."""
        t = torch.empty(values.shape, dtype=torch.int64, pin_memory=self._cuda)
        t.numpy()[...] = values
        return t.to(self.device, non_blocking=True)


class SlotRows:
    """The host encoding of a slot's row: one struct row per dirty slot (`format`), its
    values ordered by `pick` (the [S] columns `cols`' values, min words, bias values, bias
    ids, min bits) into the row's fields: 8-byte ones, 4-byte ones, then bools.
    blocks: {block dtype: its column names}; dtype_of(name): a column's own dtype; nb: bias
    entries per slot; m: min-token words per slot."""

    def __init__(self, cols: Sequence[str], blocks: dict, dtype_of, nb: int, m: int,
                 vocab_size: int) -> None:  # fmt: skip
        h, at = len(cols), {n: i for i, n in enumerate(cols)}
        spans = {"min_words": (h, m), "bias_values": (h + m, nb), "bias_ids": (h + m + nb, nb),
                 "min_bits": (h + m + 2 * nb, m)}  # fmt: skip
        fields, order = [], []
        for name, dtype in ((FIELD[torch.int64], torch.int64), ("min_words", torch.int64),
                            (FIELD[torch.int32], torch.int32), ("bias_values", torch.float32),
                            ("bias_ids", torch.int32), ("min_bits", torch.int32),
                            (FIELD[torch.bool], torch.bool)):  # fmt: skip
            if name in spans:
                a, k = spans[name]
                codes, idx = f"{k}{_CODE[dtype]}", range(a, a + k)
            elif dtype in blocks:
                group = blocks[dtype]
                codes = "".join(_CODE[dtype_of(c)] for c in group)
                idx = [at[c] for c in group]
            else:
                continue
            fields.append((name, dtype, codes))
            order.extend(idx)
        self.format, self.pick = RowFormat(fields), itemgetter(*order)
        self.vocab_size = vocab_size
        self.no_bias = ((0.0,) * nb, (-1,) * nb)
        self.no_words = (0,) * m

    def __call__(self, p: SamplingParams, prompt_len: int, words: list[tuple[int, int]]):
        """The row's values for a slot given `p`, its prompt length and min-token words."""
        if words:  # padding entries repeat the first: a scatter of equal values
            pad = [words[0]] * (len(self.no_words) - len(words))
            ws, bs = zip(*words, *pad, strict=True)
        else:
            ws = bs = self.no_words
        if p.logit_bias:
            bias = sorted(p.logit_bias.items())
            k = len(self.no_bias[0]) - len(bias)
            bids = tuple(t for t, _ in bias) + (-1,) * k
            bvals = tuple(b for _, b in bias) + (0.0,) * k
        else:
            bvals, bids = self.no_bias
        own = (prompt_len, p.min_tokens)  # in the SlotTable's own columns' order
        return self.pick(
            SamplingTensors.host_row(p, self.vocab_size) + own + ws + bvals + bids + bs
        )


def min_id_words(ids: Sequence[int]) -> list[tuple[int, int]]:
    """[(word, bits)]: the ids as bitmask words, one entry per word (bits as a signed
    int32 value), so a scatter never writes one word twice with different values."""
    words: dict[int, int] = {}
    for t in set(ids):
        words[t // 32] = words.get(t // 32, 0) | (1 << (t % 32))
    return [(w, b - (1 << 32) if b >= 1 << 31 else b) for w, b in sorted(words.items())]
