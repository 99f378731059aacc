"""/metrics: the server's counters and the executor's `stats` in Prometheus text format
(hand-written: a few gauges, counters and two histograms need no client library)."""

from __future__ import annotations

import asyncio
import bisect
import time
from dataclasses import dataclass, field

# seconds; Prometheus histograms are cumulative over these upper bounds
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
RATE_WINDOW_S = 10.0  # tokens per second: over the last this many seconds
LAG_TICK_S = 0.01  # the event-loop lag probe's sleep


async def watch_loop_lag(observe, tick: float = LAG_TICK_S, until: float = float("inf")) -> None:
    """observe(how late this event loop woke from each `tick`-second sleep, seconds) until
    the monotonic time `until` or a cancel: a loop that falls behind delays every stream
    and every new request it holds."""
    while time.monotonic() < until:
        t = time.monotonic()
        await asyncio.sleep(tick)
        observe(max(0.0, time.monotonic() - t - tick))


@dataclass
class Histogram:
    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def observe(self, v: float) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)
        self.counts[bisect.bisect_left(self.bounds, v)] += 1
        self.total += v

    def lines(self, name: str) -> list[str]:
        counts = self.counts or [0] * (len(self.bounds) + 1)
        out, acc = [], 0
        for b, c in zip((*self.bounds, float("inf")), counts, strict=True):
            acc += c
            le = "+Inf" if b == float("inf") else repr(b)
            out.append(f'{name}_bucket{{le="{le}"}} {acc}')
        return out + [f"{name}_sum {self.total}", f"{name}_count {acc}"]


@dataclass
class ServerMetrics:
    """What the routes count (this API server's requests); the engines' load and step
    counters come in `render`'s stats."""

    requests: int = 0
    rejected: int = 0  # 503: the waiting queue was full
    aborted: int = 0  # the client left before the end
    tokens: int = 0
    prompt_tokens: int = 0
    finished: dict[str, int] = field(default_factory=dict)  # finish reason -> choices
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    queue: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))
    itl: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))
    loop_lag: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))  # watch_loop_lag
    api_server: int | None = None  # this API server's number under `serve --api-servers`
    # tokens per whole second, the last RATE_WINDOW_S + 1 of them (a fixed ring: bounded
    # whether or not anyone reads /metrics)
    _per_s: list[int] = field(default_factory=lambda: [0] * (int(RATE_WINDOW_S) + 1))
    _sec: int = 0  # the second _per_s was last written in

    def token(self, n: int = 1) -> None:
        self.tokens += n
        self._roll(int(time.monotonic()))[self._sec % len(self._per_s)] += n

    def _roll(self, sec: int) -> list[int]:
        """The ring with the seconds between the last write and `sec` zeroed."""
        ring = self._per_s
        if sec != self._sec:
            for s in range(max(self._sec + 1, sec - len(ring) + 1), sec + 1):
                ring[s % len(ring)] = 0
            self._sec = sec
        return ring

    def tokens_per_s(self) -> float:
        """Over the last RATE_WINDOW_S whole seconds (the current, partial one left out)."""
        sec = int(time.monotonic())
        ring = self._roll(sec)
        return (sum(ring) - ring[sec % len(ring)]) / RATE_WINDOW_S

    def render(self, st) -> str:
        """The Prometheus exposition text (version 0.0.4); `st`: the engines' `EngineStats`."""
        rows = [
            ("gauge", "requests_running", "streams holding a slot", st.running),
            ("gauge", "requests_waiting", "requests waiting for a slot", st.waiting),
            ("gauge", "free_slots", "slots free for new streams", st.free_slots),
            ("counter", "requests_total", "requests accepted", self.requests),
            ("counter", "requests_rejected_total", "503s: the waiting queue was full",
             self.rejected),
            ("counter", "requests_aborted_total", "requests whose client left", self.aborted),
            ("counter", "generation_tokens_total", "tokens generated", self.tokens),
            ("counter", "prompt_tokens_total", "prompt tokens of accepted requests",
             self.prompt_tokens),
            ("gauge", "generation_tokens_per_second",
             f"tokens generated per second over the last {RATE_WINDOW_S:g} s",
             self.tokens_per_s()),
            ("counter", "steps_total", "executor steps", st.steps),
            ("counter", "graph_replays_total", "steps replayed from a captured graph (on the "
             "CPU its emulation: the recorded call)",
             st.replays),
            ("counter", "eager_steps_total", "steps run eagerly", st.eager),
            ("counter", "spec_drafted_tokens_total", "speculative drafts verified", st.drafted),
            ("counter", "spec_accepted_tokens_total", "speculative drafts accepted",
             st.accepted),
        ]  # fmt: skip
        if self.api_server is not None:  # which of the port's processes answered
            rows.append(("gauge", "api_server", "this API server's number (always 1: the "
                         "label says which)", 1))  # fmt: skip
        out = []
        for kind, name, help_, value in rows:
            label = f'{{index="{self.api_server}"}}' if name == "api_server" else ""
            out += [f"# HELP graphexec_{name} {help_}", f"# TYPE graphexec_{name} {kind}",
                    f"graphexec_{name}{label} {value}"]  # fmt: skip
        out += ["# HELP graphexec_request_finish_total choices ended, by finish reason",
                "# TYPE graphexec_request_finish_total counter"]  # fmt: skip
        out += [f'graphexec_request_finish_total{{reason="{r}"}} {n}'
                for r, n in sorted(self.finished.items())]  # fmt: skip
        for name, h, help_ in (
            ("request_queue_seconds", self.queue, "time waiting for a slot"),
            ("request_e2e_seconds", self.e2e, "arrival to the last token"),
            ("time_to_first_token_seconds", self.ttft, "time to first token"),
            ("inter_token_latency_seconds", self.itl, "time between tokens"),
            ("event_loop_lag_seconds", self.loop_lag,
             f"how late the event loop wakes from {LAG_TICK_S:g} s sleeps"),
        ):
            out += [f"# HELP graphexec_{name} {help_}", f"# TYPE graphexec_{name} histogram"]
            out += h.lines(f"graphexec_{name}")
        return "\n".join(out) + "\n"
