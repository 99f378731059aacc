"""Packed host->device uploads: many small host tensors reach the device as one copy.

`SlotTable.flush` writes a dozen fields for a handful of slots. Copied one by one, each
field is a small synchronous transfer; packed, they are one flat int64 buffer (pinned on
CUDA) copied without blocking, and the device reads each field back as a view of it.

Encoding, so that one buffer holds every dtype and the device converts it in two ops:
    int64     as is
    int32     the value (sign-extended)
    float32   its int32 bit pattern (sign-extended); back with .to(int32).view(float32)
    bool      0 / 1
Pieces are laid out grouped by encoding (int64, then the int32-range ones, then bool),
so each group is one contiguous span and one conversion kernel.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

_GROUP = {torch.int64: 0, torch.float32: 1, torch.int32: 1, torch.bool: 2}


@dataclass(frozen=True)
class Layout:
    """Where each piece sits in the packed buffer (offsets in int64 elements)."""

    entries: tuple[tuple[str, torch.dtype, tuple[int, ...], int], ...]  # name, dtype, shape, at
    spans: tuple[tuple[int, int], ...]  # [start, end) of groups 0, 1, 2
    size: int


def layout(pieces: Mapping[str, torch.Tensor]) -> Layout:
    """The layout of `pieces` (stable within a group, so the caller's order is kept)."""
    for name, t in pieces.items():
        if t.dtype not in _GROUP:
            raise TypeError(f"cannot pack {name}: dtype {t.dtype} (int64/int32/float32/bool)")
    order = sorted(pieces, key=lambda k: _GROUP[pieces[k].dtype])
    entries, spans, at = [], [], 0
    for g in range(3):
        start = at
        for name in order:
            t = pieces[name]
            if _GROUP[t.dtype] == g:
                entries.append((name, t.dtype, tuple(t.shape), at))
                at += t.numel()
        spans.append((start, at))
    return Layout(tuple(entries), tuple(spans), at)


def pack(pieces: Mapping[str, torch.Tensor], lay: Layout, out: torch.Tensor) -> torch.Tensor:
    """Write `pieces` (CPU tensors) into `out[:lay.size]` (int64) and return that view."""
    flat = []
    for name, dtype, _, _ in lay.entries:
        t = pieces[name].reshape(-1)
        if dtype == torch.float32:
            t = t.contiguous().view(torch.int32)
        flat.append(t if dtype == torch.int64 else t.to(torch.int64))
    dst = out[: lay.size]
    torch.cat(flat, out=dst)
    return dst


def unpack(buf: torch.Tensor, lay: Layout) -> dict[str, torch.Tensor]:
    """The pieces as views of `buf` (the packed buffer, on any device), in their dtypes:
    at most two conversion ops (the int32-range span, the bool span)."""
    (a0, a1), (b0, b1), (c0, c1) = lay.spans
    groups = (buf[a0:a1], buf[b0:b1].to(torch.int32), buf[c0:c1].to(torch.bool))
    starts = (a0, b0, c0)
    out = {}
    for name, dtype, shape, at in lay.entries:
        g = _GROUP[dtype]
        n = 1
        for d in shape:
            n *= d
        v = groups[g][at - starts[g] : at - starts[g] + n]
        out[name] = (v.view(torch.float32) if dtype == torch.float32 else v).view(shape)
    return out


class PackedUpload:
    """A reusable int64 staging buffer (pinned when `device` is CUDA) and the event of
    the last copy out of it.

    `upload(pieces)` waits for that copy (the only host sync: the buffer is about to be
    overwritten), packs, copies once without blocking and returns the device views. On
    the CPU the "copy" is the buffer itself, so the views hold until the next upload.
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        self._buf = torch.empty(0, dtype=torch.int64)
        self._copied: torch.cuda.Event | None = None

    def upload(self, pieces: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        lay = layout(pieces)
        if self._copied is not None:
            self._copied.synchronize()  # usually long done: it was queued a step ago
        if self._buf.numel() < lay.size:
            # grow geometrically (reused otherwise); no copy reads the old one now
            size = max(lay.size, 2 * self._buf.numel(), 256)
            self._buf = torch.empty(size, dtype=torch.int64, pin_memory=self._cuda)
        host = pack(pieces, lay, self._buf)
        dev = host.to(self.device, non_blocking=True)
        if self._cuda:
            if self._copied is None:
                self._copied = torch.cuda.Event()
            self._copied.record(torch.cuda.current_stream(self.device))
        return unpack(dev, lay)
