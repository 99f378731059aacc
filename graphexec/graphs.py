"""Graph keys and batch buckets: which captured CUDA graph a decode step replays.

One graph is captured per `GraphKey` (sampler variant x batch bucket x logprobs on/off).
A step's key comes from host-side copies of its requests' parameters only (no GPU sync):
the variant from `choose_variant`, the smallest bucket that holds the batch, and logprobs
on if any row asked for them. A batch larger than the largest bucket is served as several
chunks, each with its own key.

Capture and replay themselves belong to the executor (issue 3); this module only decides.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

from graphexec.params import SamplerVariant, SamplingParams, choose_variant


@dataclass(frozen=True, order=True)
class GraphKey:
    """The identity of one captured graph."""

    variant: SamplerVariant
    bucket: int  # static batch size of the graph; rows past the real batch are padding
    logprobs: bool  # the graph writes logprobs / ranks / top-N

    def __post_init__(self) -> None:
        if not isinstance(self.variant, SamplerVariant):
            raise ValueError(f"variant must be a SamplerVariant, got {self.variant!r}")
        if self.bucket < 1:
            raise ValueError(f"bucket must be >= 1, got {self.bucket}")


def default_buckets(max_batch_size: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then multiples of 16 up to max_batch_size (always included)."""
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    small = [b for b in (1, 2, 4, 8) if b < max_batch_size]
    return tuple(small + list(range(16, max_batch_size, 16)) + [max_batch_size])


def check_buckets(buckets: Sequence[int]) -> tuple[int, ...]:
    """Sorted, de-duplicated buckets; ValueError naming the field on bad values."""
    if not buckets:
        raise ValueError("buckets must hold at least one batch size")
    for b in buckets:
        if not isinstance(b, int) or isinstance(b, bool) or b < 1:
            raise ValueError(f"buckets must be integers >= 1, got {b!r}")
    return tuple(sorted(set(buckets)))


def pick_bucket(batch_size: int, buckets: Sequence[int]) -> int:
    """The smallest bucket >= batch_size (buckets sorted); ValueError if none holds it."""
    i = bisect.bisect_left(buckets, batch_size)
    if batch_size < 1 or i == len(buckets):
        raise ValueError(f"batch_size must be in [1, {buckets[-1]}], got {batch_size}")
    return buckets[i]


def plan_step(
    params: Sequence[SamplingParams], buckets: Sequence[int]
) -> list[tuple[GraphKey, slice]]:
    """The keys one step replays and the rows each serves, in row order.

    Rows are cut into chunks of at most the largest bucket; each chunk gets the variant
    and logprobs flag of its own rows (a chunk's key never depends on the other chunks),
    so a request's chunk never changes its token: variants and buckets are not semantics.
    """
    largest = buckets[-1]
    plan = []
    for start in range(0, len(params), largest):
        rows = params[start : start + largest]
        key = GraphKey(
            variant=choose_variant(rows),
            bucket=pick_bucket(len(rows), buckets),
            logprobs=any(p.logprobs is not None for p in rows),
        )
        plan.append((key, slice(start, start + len(rows))))
    return plan


def all_keys(buckets: Sequence[int]) -> list[GraphKey]:
    """Every key to capture, largest bucket first (later, smaller graphs reuse its pool)."""
    return [
        GraphKey(v, b, lp)
        for b in sorted(buckets, reverse=True)
        for v in SamplerVariant
        for lp in (False, True)
    ]
