"""CUDA graphs of a model's token-row prefill, one per (tokens, logit rows) bucket.

An eager prefill of a 24-layer model launches ~240 kernels from Python, ~11 ms of host
time on an H200 whatever the chunk's size (its device time for 256 tokens: ~2.3 ms), and
the step that carries the chunk waits for it: every running stream's gap grows by that.
Replaying a captured graph costs the host a few microseconds. Token rows make this
possible: with every prompt token a row of the decode forward (its own slot and
position), a prefill batch is a flat [N] batch whatever its segments, so padding N up to
a bucket gives static shapes. Padding rows point at the padding slot, position 0.

A bucket's graph is captured the first time a batch needs it (a one-time stall of tens
of milliseconds); batches of more tokens than the largest bucket run eagerly.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from graphexec.runtime.capture import GraphCapture

TOKEN_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


def bucket(n: int, buckets) -> int | None:
    """The smallest bucket >= n (None past the largest)."""
    return next((b for b in buckets if b >= n), None)


class PrefillGraphs:
    """`forward(ids [N], positions [N], slots [N], rows [M] | None, prefill=True)` replayed
    from static buffers, with N padded to a TOKEN_BUCKETS bucket and M (logit rows) to a
    power of two <= that bucket (0 when no logits are asked for)."""

    def __init__(self, forward: Callable, padding_slot: int, device: torch.device,
                 buckets: tuple[int, ...] = TOKEN_BUCKETS) -> None:  # fmt: skip
        self.forward, self.padding_slot, self.buckets = forward, padding_slot, buckets
        n = buckets[-1]
        # the static inputs as rows of one buffer (ids, positions, slots), so the padding
        # past a batch is one copy from `_pad`
        self._inputs = torch.zeros((3, n), dtype=torch.int64, device=device)
        self._inputs[2] = padding_slot
        self._pad = self._inputs.clone()
        self.ids, self.positions, self.slots = self._inputs
        self.rows = torch.zeros(n, dtype=torch.int64, device=device)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor | None]] = {}
        self._capture_fn = GraphCapture(device)
        self.eager = 0  # batches past the largest bucket

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                 rows: torch.Tensor | None) -> torch.Tensor | None:  # fmt: skip
        """Logits [M, V] of `rows` (a fresh tensor), or None when rows is None."""
        n, m = ids.shape[0], 0 if rows is None else rows.shape[0]
        nb = bucket(n, self.buckets)
        if nb is None:
            self.eager += 1
            return self.forward(ids, positions, slots, rows, prefill=True)
        mb = 0 if m == 0 else bucket(m, [1 << k for k in range(nb.bit_length())])
        # device-to-device copies into the static inputs: no host sync
        self.ids[:n].copy_(ids)
        self.positions[:n].copy_(positions)
        self.slots[:n].copy_(slots)
        self._inputs[:, n:nb].copy_(self._pad[:, : nb - n])
        if m:
            self.rows[:m].copy_(rows)
            self.rows[m:mb].zero_()  # extra rows read token 0's logits; dropped below
        key = (nb, mb)
        if key not in self.graphs:
            self.graphs[key] = self._capture(nb, mb)
        graph, out = self.graphs[key]
        graph.replay()
        return None if out is None else out[:m].clone()

    def _capture(self, nb: int, mb: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor | None]:
        def run():
            rows = self.rows[:mb] if mb else None
            return self.forward(self.ids[:nb], self.positions[:nb], self.slots[:nb], rows,
                                prefill=True)  # fmt: skip

        # the warm-up computes the batch already in the buffers, which the replay then
        # writes again, unchanged
        return self._capture_fn(run)
