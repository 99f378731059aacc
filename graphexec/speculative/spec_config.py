"""SpeculativeConfig: how the executor speculates."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

DRAFTERS = ("ngram",)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculation settings, passed to `DecodeExecutor(speculative=...)`.

    num_draft_tokens: K, drafts verified per request and step (1..16); a step emits 1 to
        K+1 tokens per request.
    drafter: "ngram" (prompt lookup over the request's prompt and output, on the device)
        or a draft `DecodeModel` sharing the target's vocabulary; either runs inside the
        captured step (a draft model K+1 times, on its own slot-indexed cache).
    verify: "strict" (a seeded request's tokens equal those without speculation) or
        "rejection" (Leviathan et al.: distributed as the target, not the same stream).
    ngram_max / ngram_min: the longest and shortest suffix the prompt lookup matches.
    ngram_window: how many of the history's last tokens it searches (each row's work per
        step is bounded by it; the model's max_seq_len when that is smaller).
    """

    num_draft_tokens: int = 4
    drafter: Any = "ngram"
    verify: str = "strict"
    ngram_max: int = 4
    ngram_min: int = 1
    ngram_window: int = 1024

    def __post_init__(self) -> None:
        k = self.num_draft_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= 16:
            raise ValueError(f"num_draft_tokens must be an int in [1, 16], got {k!r}")
        if self.verify not in ("strict", "rejection"):
            raise ValueError(f"verify must be 'strict' or 'rejection', got {self.verify!r}")
        if isinstance(self.drafter, str):
            if self.drafter not in DRAFTERS:
                raise ValueError(
                    f"drafter must be one of {DRAFTERS} or a DecodeModel, got {self.drafter!r}"
                )
        else:
            for attr in ("vocab_size", "bind", "prefill", "decode"):
                if not hasattr(self.drafter, attr):
                    raise ValueError(
                        f"drafter must be 'ngram' or a DecodeModel; "
                        f"{type(self.drafter).__name__} has no {attr!r}"
                    )
        for name in ("ngram_max", "ngram_min"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        w = self.ngram_window
        if isinstance(w, bool) or not isinstance(w, int) or w < 2:
            raise ValueError(f"ngram_window must be an int >= 2, got {w!r}")
        if self.ngram_min > self.ngram_max:
            raise ValueError(
                f"ngram_min ({self.ngram_min}) must be <= ngram_max ({self.ngram_max})"
            )

    @property
    def uses_model(self) -> bool:
        return not isinstance(self.drafter, str)
