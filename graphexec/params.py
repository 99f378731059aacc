"""Per-request sampling parameters, the sampler variants, and how a batch picks one.

`SamplingParams` is frozen and validated at construction: every bad field raises a
`ValueError` naming the field and its allowed range. Fields that depend on the vocabulary
(`top_k`, `logit_bias` ids) are checked again against V by `check_vocab` when the request
meets a model or a logits tensor.

Off values filter nothing: `top_k` <= 0, `top_p` == 1 and `min_p` == 0.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from graphexec.grammar import Grammar

MAX_TOP_LOGPROBS = 20
MAX_SEED = 2**63 - 1
LOGPROBS_MODES = ("raw", "processed")
# it and its reciprocal stay finite in float32 (an inf penalty would make 0 * inf = NaN)
MIN_REPETITION, MAX_REPETITION = 1e-30, 1e30


class SamplerVariant(str, enum.Enum):
    """Which sampler pipeline a batch runs. Variants are optimisations, not semantics:
    every row a variant can serve gets exactly the token `DEFAULT` gives it."""

    NO_FILTER = "no_filter"  # temperature only (greedy included)
    TOP_K_TOP_P = "top_k_top_p"  # top-k and/or top-p, no min-p
    DEFAULT = "default"  # everything, min-p included

    def serves(self, params: SamplingParams) -> bool:
        if self is SamplerVariant.DEFAULT:
            return True
        if self is SamplerVariant.TOP_K_TOP_P:
            return not params.uses_min_p
        return not (params.uses_top_k or params.uses_top_p or params.uses_min_p)


def _finite(name: str, value: Any) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None
    if math.isnan(v):
        raise ValueError(f"{name} must not be NaN")
    return v


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples. See DESIGN.md for the processing order:
    grammar mask, logit bias, penalties, temperature, top-k, top-p (on the top-k mass),
    min-p (relative to the max probability), then the draw.

    temperature: >= 0; 0 means greedy (argmax, ties to the lower token id).
    top_k: -1 or 0 = off, else 1..V.
    top_p: in (0, 1]; 1 = off.
    min_p: in [0, 1]; 0 = off.
    seed: 0..2**63-1; None means the executor draws one at admission (sample_logits
        requires it to be set).
    logprobs: None = off; 0 = the sampled token's logprob and rank only; N <= 20 adds
        the top-N.
    logprobs_mode: "raw" (log_softmax of the model's logits) or "processed" (after
        grammar, bias, penalties and temperature).
    repetition_penalty: > 0; 1 = off. presence_penalty, frequency_penalty: in [-2, 2].
    logit_bias: {token_id: bias}, finite biases, ids in [0, V).
    max_tokens: >= 1. stop_token_ids: ids that finish the request with "stop".
    grammar: a `graphexec.Grammar`, or None.
    """

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    logprobs: int | None = None
    logprobs_mode: str = "raw"
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Mapping[int, float] | None = None
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    grammar: Grammar | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        t = _finite("temperature", self.temperature)
        if t < 0 or math.isinf(t):
            raise ValueError(f"temperature must be finite and >= 0 (0 = greedy), got {t}")
        object.__setattr__(self, "temperature", t)
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int):
            raise ValueError(f"top_k must be an int (-1 or 0 = off, else 1..V), got {self.top_k!r}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 or in [1, V], got {self.top_k}")
        p = _finite("top_p", self.top_p)
        if not 0.0 < p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {p}")
        object.__setattr__(self, "top_p", p)
        mp = _finite("min_p", self.min_p)
        if not 0.0 <= mp <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {mp}")
        object.__setattr__(self, "min_p", mp)
        if self.seed is not None:
            if isinstance(self.seed, bool) or not isinstance(self.seed, int):
                raise ValueError(f"seed must be an int in [0, 2**63), got {self.seed!r}")
            if not 0 <= self.seed <= MAX_SEED:
                raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        if self.logprobs is not None:
            if isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int):
                raise ValueError(
                    f"logprobs must be None or an int in [0, 20], got {self.logprobs!r}"
                )
            if not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
                raise ValueError(
                    f"logprobs must be None or in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}"
                )
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(
                f"logprobs_mode must be one of {LOGPROBS_MODES}, got {self.logprobs_mode!r}"
            )
        rep = _finite("repetition_penalty", self.repetition_penalty)
        if not MIN_REPETITION <= rep <= MAX_REPETITION:
            raise ValueError(
                f"repetition_penalty must be in [{MIN_REPETITION}, {MAX_REPETITION}] (1 = off), "
                f"got {rep}"
            )
        object.__setattr__(self, "repetition_penalty", rep)
        for name in ("presence_penalty", "frequency_penalty"):
            v = _finite(name, getattr(self, name))
            if not -2.0 <= v <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {v}")
            object.__setattr__(self, name, v)
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, Mapping):
                raise ValueError("logit_bias must be a mapping {token_id: bias}")
            clean: dict[int, float] = {}
            for tok, b in self.logit_bias.items():
                if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0:
                    raise ValueError(f"logit_bias token id must be an int >= 0, got {tok!r}")
                bv = _finite(f"logit_bias[{tok}]", b)
                if math.isinf(bv):
                    raise ValueError(f"logit_bias[{tok}] must be finite, got {bv}")
                clean[tok] = bv
            object.__setattr__(self, "logit_bias", clean)
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        try:
            stops = tuple(self.stop_token_ids)
        except TypeError:
            raise ValueError(
                f"stop_token_ids must be a sequence of ints, got {self.stop_token_ids!r}"
            ) from None
        for s in stops:
            if isinstance(s, bool) or not isinstance(s, int) or s < 0:
                raise ValueError(f"stop_token_ids must hold ints >= 0, got {s!r}")
        object.__setattr__(self, "stop_token_ids", stops)

    # What the request uses; "off" values count as unused.
    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_top_k(self) -> bool:
        return self.top_k > 0 and not self.greedy

    @property
    def uses_top_p(self) -> bool:
        return self.top_p < 1.0 and not self.greedy

    @property
    def uses_min_p(self) -> bool:
        return self.min_p > 0.0 and not self.greedy

    @property
    def uses_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def check_vocab(self, vocab_size: int) -> None:
        """Raise ValueError for the fields that must fit a vocabulary of `vocab_size`."""
        if self.top_k > vocab_size:
            raise ValueError(f"top_k must be -1, 0 or in [1, {vocab_size}], got {self.top_k}")
        if self.logprobs is not None and self.logprobs > vocab_size:
            raise ValueError(
                f"logprobs must be <= the vocabulary size {vocab_size}, got {self.logprobs}"
            )
        for tok in self.logit_bias or {}:
            if tok >= vocab_size:
                raise ValueError(f"logit_bias token id {tok} is outside [0, {vocab_size})")

    def with_seed(self, seed: int) -> SamplingParams:
        import dataclasses

        return dataclasses.replace(self, seed=seed)


# cheapest first; each variant serves every request the one before it serves
VARIANT_ORDER = (SamplerVariant.NO_FILTER, SamplerVariant.TOP_K_TOP_P, SamplerVariant.DEFAULT)


def variant_rank(params: SamplingParams) -> int:
    """The index in VARIANT_ORDER of the cheapest variant that serves `params`."""
    return next(i for i, v in enumerate(VARIANT_ORDER) if v.serves(params))


def choose_variant(params: Sequence[SamplingParams]) -> SamplerVariant:
    """The cheapest variant that serves every row of the batch."""
    return VARIANT_ORDER[max((variant_rank(p) for p in params), default=0)]
