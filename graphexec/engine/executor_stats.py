"""What an executor reports about itself: per-key replay counts and capture times,
speculation's drafted and accepted tokens (`ExecutorStats`), and where the last step's
wall time went (`StepTiming`)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from graphexec.engine.graphs import GraphKey


@dataclass
class StepTiming:
    """Where the last step's wall time went (seconds): host work before and after the
    wait for the device, and the wait itself. host = before + after is the executor's
    overhead around the replay."""

    before: float = 0.0
    wait: float = 0.0
    after: float = 0.0

    @property
    def host(self) -> float:
        return self.before + self.after


@dataclass
class ExecutorStats:
    """replays / eager_steps: per key; capture_s: per captured key; failed: key -> error."""

    replays: dict[GraphKey, int] = field(default_factory=dict)
    eager_steps: Counter = field(default_factory=Counter)
    capture_s: dict[GraphKey, float] = field(default_factory=dict)
    failed: dict[GraphKey, str] = field(default_factory=dict)
    steps: int = 0
    admitted: int = 0
    drafted: int = 0  # speculation: drafts verified
    accepted: int = 0  # speculation: drafts accepted

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None
