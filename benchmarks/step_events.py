"""The GPU's busy and idle time per decode step, from CUDA events around the executor's
launches (`bench_step.py`, step_model.py, step_replay.py).

`StepEvents`: while `ex.step()` runs in a loop, one CUDA event right before each step's
first graph replay (eager: before its step function) and one right after its launch
returns (behind its output copies), recorded by wrapping the executor's runner for the
loop's duration only: a benchmark-side hook, the library pays nothing per step. A split
step (forward, then the host's masks, then the draw) gets two more: after its forward's
launch and before its draw; between them the device may wait for the host (the gap).
Per step: busy = end(N) - start(N) - gap(N); idle = start(N+1) - end(N) + gap(N+1),
the time the device had nothing of the loop to run, i.e. waited for the host
(`idle_stats`).

Everything that touches CUDA runs inside functions: the module imports on a CPU.
"""

from __future__ import annotations

import functools
import statistics
from collections.abc import Callable, Sequence

import torch


def p90(xs: Sequence[float]) -> float:
    """The 90th percentile, interpolated within the data (never past its max)."""
    return xs[0] if len(xs) == 1 else statistics.quantiles(xs, n=10, method="inclusive")[-1]


def idle_stats(starts: Sequence[float], ends: Sequence[float],
               gaps: Sequence[float | None] | None = None) -> dict:  # fmt: skip
    """Per-step device times (us) from each step's start and end stamps (us, one clock, in
    launch order) and its split gap (the device's wait between a split step's forward and
    draw; None for a whole step; None for gaps: all whole): busy = end - start - gap, idle =
    start(N+1) - end(N) + gap(N+1). idle_us is the mean (the device time lost per step: a
    few long stalls under load hide below a median), then the idle median, p90 and max,
    busy's median, the cycle (start to start, mean), and split_gap_us, the gaps' mean
    over the split steps (None: none split)."""
    n = len(starts)
    gaps = [None] * n if gaps is None else list(gaps)
    split = [g for g in gaps if g is not None]
    if n != len(ends) or n != len(gaps) or n < 2:
        raise ValueError(f"need matching start, end and gap stamps of >= 2 steps, got {n}, "
                         f"{len(ends)} and {len(gaps)}")  # fmt: skip
    gap = [g or 0.0 for g in gaps]
    busy = [e - s - g for s, e, g in zip(starts, ends, gap, strict=True)]
    idle = [starts[i + 1] - ends[i] + gap[i + 1] for i in range(n - 1)]
    if min(busy) < 0 or min(idle) < 0 or min(gap) < 0:
        raise ValueError("stamps out of order: a step ends before it starts or starts "
                         "before the previous one ended")  # fmt: skip
    return dict(idle_us=statistics.fmean(idle), idle_median_us=statistics.median(idle),
                idle_p90_us=p90(idle), idle_max_us=max(idle), busy_us=statistics.median(busy),
                cycle_us=(starts[-1] - starts[0]) / (n - 1), steps=n,
                split_gap_us=statistics.fmean(split) if split else None)  # fmt: skip


class StepEvents:
    """Stamps each launch's device work with CUDA events while the block runs (module
    docstring). `event` makes an event (default: a timing CUDA event); `steps` events of
    each kind are made and recorded once up front, so the timed loop creates none."""

    def __init__(self, ex, steps: int, event: Callable[[], object] | None = None) -> None:
        self.runner = ex.runner
        self._make = event or functools.partial(torch.cuda.Event, enable_timing=True)
        self._pool = [self._make() for _ in range(4 * steps)]
        for e in self._pool:
            e.record()
        self.starts: list = []
        self.ends: list = []
        self.gaps: list = []  # per step: (forward launched, draw starts) or None (whole)
        self.last_keys: list = []  # (key, first row, rows) of the last launch's chunks
        self._started = False
        self._forward_end = self._draw_start = None

    def _stamp(self):
        e = self._pool.pop() if self._pool else self._make()
        e.record()
        return e

    def _start(self) -> None:
        if not self._started:  # the launch's first graph replay or eager step
            self._started = True
            self.starts.append(self._stamp())

    def _draw(self) -> None:
        if self._draw_start is None and self._forward_end is not None:
            self._draw_start = self._stamp()

    @staticmethod
    def _after(mark: Callable[[], None], run: Callable[[], object]) -> Callable[[], object]:
        """`run` with `mark` stamped right before it (an eager step or part)."""

        def marked():
            mark()
            return run()

        return marked

    def _end(self, done, gap=None) -> None:
        if self._started:
            self.ends.append(self._stamp())
            self.gaps.append(gap)
        self._started = False
        self.last_keys = list(done.keys)

    def __enter__(self) -> StepEvents:
        runner, graphs = self.runner, self.runner.graphs
        launch, replay, fn = runner.launch, graphs.replay, runner.fn
        forward, draw, parts, part = (runner.launch_forward, runner.launch_draw, runner.parts,
                                      graphs.replay_part)  # fmt: skip

        def timed_replay(key):
            self._start()
            return replay(key)

        def timed_fn(key):
            return self._after(self._start, fn(key))

        def timed_launch(plan, replay_graphs):
            self._started = False
            done = launch(plan, replay_graphs)
            self._end(done)
            return done

        def timed_part(key, name):
            (self._start if name == "forward" else self._draw)()
            return part(key, name)

        def timed_parts(key):
            fwd, rest = parts(key)
            return self._after(self._start, fwd), self._after(self._draw, rest)

        def timed_forward(plan, replay_graphs):
            self._started, self._forward_end, self._draw_start = False, None, None
            done = forward(plan, replay_graphs)
            if self._started:
                self._forward_end = self._stamp()
            return done

        def timed_draw(done, mask_rows, replay_graphs):
            done = draw(done, mask_rows, replay_graphs)
            gap = None
            if self._forward_end is not None and self._draw_start is not None:
                gap = (self._forward_end, self._draw_start)
            self._forward_end = self._draw_start = None
            self._end(done, gap)
            return done

        hooks = ((runner, "launch", timed_launch), (graphs, "replay", timed_replay),
                 (runner, "fn", timed_fn), (runner, "launch_forward", timed_forward),
                 (runner, "launch_draw", timed_draw), (runner, "parts", timed_parts),
                 (graphs, "replay_part", timed_part))  # fmt: skip
        # what to put back: an attribute of the instance itself, or none (the class's)
        self._saved = [(obj, name, vars(obj).get(name)) for obj, name, _ in hooks]
        for obj, name, hook in hooks:
            setattr(obj, name, hook)
        return self

    def __exit__(self, *exc) -> None:
        for obj, name, old in self._saved:
            if old is None:
                delattr(obj, name)
            else:
                setattr(obj, name, old)

    def times(self) -> tuple[list[float], list[float], list[float | None]]:
        """(starts, ends, gaps) in us from the first start (a gap: a split step's wait
        between its forward and its draw; None for a whole step); waits for the last end."""
        if not self.starts:
            return [], [], []
        self.ends[-1].synchronize()
        t0 = self.starts[0]

        def us(e):
            return t0.elapsed_time(e) * 1e3

        return ([us(e) for e in self.starts], [us(e) for e in self.ends],
                [None if g is None else us(g[1]) - us(g[0]) for g in self.gaps])  # fmt: skip

    def stats(self) -> dict:
        return idle_stats(*self.times())
