"""Graph keys and batch buckets: which captured CUDA graph a decode step replays.

One graph is captured per `GraphKey` (sampler variant x batch bucket x logprobs on/off x
speculative width); each variant runs kernels of its own (`variants`).
A step's key comes from host-side copies of its requests' parameters only (no GPU sync):
the variant from `choose_variant`, the smallest bucket that holds the batch, and logprobs
on if any row asked for them. A batch larger than the largest bucket is served as several
chunks, each with its own key.

`CapturedGraphs` captures and replays: on CUDA one `torch.cuda.CUDAGraph` per key, all in
one shared memory pool, largest bucket first; without CUDA the capture is emulated (the
recorded call is replayed on the same static buffers), so the keyed path runs in CI.
"""

from __future__ import annotations

import bisect
import logging
import os
import re
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from graphexec.params import VARIANT_ORDER, SamplingParams, choose_variant
from graphexec.request import GraphKey
from graphexec.runtime.capture import GraphCapture

log = logging.getLogger(__name__)


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


def chunks(batch_size: int, buckets: Sequence[int]) -> list[tuple[int, int, int]]:
    """(first row, rows, bucket) of each chunk: rows cut into runs of at most the largest
    bucket, each served by the smallest bucket that holds it."""
    largest = buckets[-1]
    out = []
    for start in range(0, batch_size, largest):
        n = min(largest, batch_size - start)
        out.append((start, n, pick_bucket(n, buckets)))
    return out


def plan_step(
    params: Sequence[SamplingParams], buckets: Sequence[int]
) -> list[tuple[GraphKey, slice]]:
    """The keys one step replays and the rows each serves, in row order.

    Rows are cut into chunks of at most the largest bucket; each chunk gets the variant
    and logprobs flag of its own rows (a chunk's key never depends on the other chunks),
    so a request's chunk never changes its token: variants and buckets are not semantics.
    """
    plan = []
    for start, n, bucket in chunks(len(params), buckets):
        rows = params[start : start + n]
        variant = choose_variant(rows)
        key = GraphKey(variant, bucket, any(p.logprobs is not None for p in rows))
        plan.append((key, slice(start, start + n)))
    return plan


def all_keys(buckets: Sequence[int], spec_ks: Sequence[int] = (0,)) -> list[GraphKey]:
    """Every key to capture, largest bucket first (later, smaller graphs reuse its pool)."""
    return [
        GraphKey(v, b, lp, k)
        for b in sorted(buckets, reverse=True)
        for k in sorted(spec_ks, reverse=True)
        for v in VARIANT_ORDER
        for lp in (False, True)
    ]


@dataclass
class CapturedStep:
    """One captured key: its graph (None when emulated), the recorded call, its stats."""

    key: GraphKey
    graph: torch.cuda.CUDAGraph | None
    fn: Callable[[], None]
    capture_s: float
    pool_bytes: int  # memory the pool grew by while this key was captured
    kernel_nodes: int | None  # kernel nodes in the graph (debug capture only)
    replays: int = 0
    kernels: Counter | None = None  # kernel name -> nodes, from the DOT (debug capture only)


class CapturedGraphs:
    """Capture every key once, replay by key.

    Args:
        device: CUDA captures real graphs; any other device emulates them.
        debug: keep each graph's DOT (CUDA only) to count its kernel nodes and write it
            out with `write_dot`; costs capture time, so tools turn it on.
    """

    def __init__(self, device: torch.device, debug: bool = False) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.debug = debug and self.cuda
        self.steps: dict[GraphKey, CapturedStep] = {}
        # split steps (`capture_parts`): ("forward", bucket, spec_k) and ("draw", key)
        self.parts: dict[tuple, CapturedStep] = {}
        self.failed: dict[GraphKey, str] = {}
        self._dots: dict[GraphKey, str] = {}
        self._capture = GraphCapture(device, self.debug) if self.cuda else None

    def fail(self, key: GraphKey, error: str) -> None:
        """Serve `key` eagerly: its capture cannot succeed (`error` says why)."""
        self.failed[key] = error
        log.warning("capture of %s failed, it will run eagerly: %s", key, error)

    def capture(self, key: GraphKey, fn: Callable[[], None]) -> bool:
        """Warm `fn` up and capture it under `key`; False (logged) when capture fails."""
        step = self._record(key, fn)
        if step is not None:
            self.steps[key] = step
        return step is not None

    def capture_parts(self, key: GraphKey, forward: Callable[[], None],
                      draw: Callable[[], None]) -> bool:  # fmt: skip
        """Capture `key`'s step as two graphs (`StepFn.make_parts`): its bucket's forward
        (once per bucket and speculative width) and the key's draw. False (logged) when
        either fails: the key's steps then run whole."""
        fkey = ("forward", key.bucket, key.spec_k)
        if fkey not in self.parts:
            step = self._record(key, forward, part=True)
            if step is None:
                return False
            self.parts[fkey] = step
        step = self._record(key, draw, part=True)
        if step is not None:
            self.parts[("draw", key)] = step
        return step is not None

    def has_parts(self, key: GraphKey) -> bool:
        return ("draw", key) in self.parts and ("forward", key.bucket, key.spec_k) in self.parts

    def part_replays(self, key: GraphKey) -> int:
        """The split steps of `key` replayed (its draw graph's replays)."""
        step = self.parts.get(("draw", key))
        return 0 if step is None else step.replays

    def replay_part(self, key: GraphKey, part: str) -> None:
        """Replay "forward" (of key's bucket and width) or "draw" (of key), captured by
        `capture_parts`."""
        fwd = part == "forward"
        step = self.parts[("forward", key.bucket, key.spec_k) if fwd else ("draw", key)]
        if step.graph is not None:
            step.graph.replay()
        else:
            step.fn()
        step.replays += 1

    def _record(self, key: GraphKey, fn: Callable[[], None],
                part: bool = False) -> CapturedStep | None:  # fmt: skip
        t0 = time.perf_counter()
        if not self.cuda:
            return CapturedStep(key, None, fn, time.perf_counter() - t0, 0, None)
        before = torch.cuda.memory_reserved(self.device)
        try:
            graph, _ = self._capture(fn)
        except Exception as e:  # OOM, an op that cannot be captured, a bad kernel
            torch.cuda.synchronize(self.device)
            if part:  # the key's whole step still serves it
                log.warning("split capture of %s failed, its steps run whole: %s", key, e)
            else:
                self.fail(key, f"{type(e).__name__}: {e}")
            return None
        torch.cuda.synchronize(self.device)
        names = self._kernel_names(key, graph) if self.debug else None
        nodes = None if names is None else sum(names.values())
        grew = torch.cuda.memory_reserved(self.device) - before
        return CapturedStep(key, graph, fn, time.perf_counter() - t0, grew, nodes,
                            kernels=names)  # fmt: skip

    def _kernel_names(self, key: GraphKey, graph: torch.cuda.CUDAGraph) -> Counter:
        fd, path = tempfile.mkstemp(suffix=".dot")
        os.close(fd)
        try:
            graph.debug_dump(path)
            with open(path) as f:
                dot = f.read()
        finally:
            os.unlink(path)
        self._dots[key] = dot
        return dot_kernels(dot)

    def write_dot(self, key: GraphKey, path: str) -> None:
        if key not in self._dots:
            raise ValueError(f"no DOT kept for {key} (capture with debug=True, on CUDA)")
        with open(path, "w") as f:
            f.write(self._dots[key])

    def replay(self, key: GraphKey) -> bool:
        """Replay `key`'s graph (or its recorded call); False when it has none."""
        step = self.steps.get(key)
        if step is None:
            return False
        if step.graph is not None:
            step.graph.replay()
        else:
            step.fn()
        step.replays += 1
        return True


# a kernel node of cudaGraphDebugDotPrint's verbose DOT, as `CUDAGraph.debug_dump` writes it:
#   label="{KERNEL\n| {ID | 14 (topoId: 6) | ampere_sgemm_128x64_nn\<\<\<\{16,10,4\},128,0\>\>\>}
_KERNEL_ID = re.compile(r"\{ID \| [^|]*\| ([^|}]+?)(?:\\<|\})")


def dot_kernels(dot: str) -> Counter:
    """Kernel name -> kernel nodes of a CUDA graph's DOT (`CUDAGraph.debug_dump`), in
    node order; C++ names shortened (`short_kernel_name`). A kernel node whose name
    cannot be read counts as "?"."""
    names: Counter = Counter()
    for m in re.finditer(r"\bKERNEL\b", dot):
        end = dot.find('"]', m.end())
        name = _KERNEL_ID.search(dot, m.end(), end if end >= 0 else len(dot))
        names[short_kernel_name(name.group(1).strip()) if name else "?"] += 1
    return names


def short_kernel_name(name: str) -> str:
    """An Itanium-mangled C++ kernel name as its qualified name without template
    arguments or parameters (`_ZN2at6native13reduce_kernelILi128E...` ->
    `at::native::reduce_kernel`); any other name (Triton's) as it is."""
    if not name.startswith("_Z"):
        return name
    s, parts = name[2:], []
    nested = s.startswith("N")
    if nested:
        s = s[1:].lstrip("rVK")  # cv-qualifiers of a member function
    while (m := re.match(r"\d+", s)) is not None:
        n = int(m.group())
        parts.append(s[m.end() : m.end() + n])
        s = s[m.end() + n :]
        if not nested:
            break
    return "::".join(parts) if parts else name
