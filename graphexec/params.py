"""Per-request sampling parameters, the sampler variants, and how a batch picks one.

`SamplingParams` is frozen and validated at construction: every bad field raises a
`ValueError` naming the field and its allowed range. Fields that depend on the vocabulary
(`top_k`, `logit_bias` ids) are checked again against V by `check_vocab` when the request
meets a model or a logits tensor.

Off values filter nothing: `top_k` <= 0, `top_p` == 1 and `min_p` == 0.
"""

from __future__ import annotations

import copy
import enum
import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from graphexec.text.grammar import Grammar

MAX_TOP_LOGPROBS = 20
MAX_SEED = 2**63 - 1
MAX_LOGIT_BIAS = 100.0  # OpenAI's range: a bias is clamped to [-100, 100]
LOGPROBS_MODES = ("raw", "processed")
# it and its reciprocal stay finite in float32 (an inf penalty would make 0 * inf = NaN)
MIN_REPETITION, MAX_REPETITION = 1e-30, 1e30


class SamplerVariant(str, enum.Enum):
    """Which sampler pipeline a batch runs. Variants are optimisations, not semantics:
    every row a variant can serve gets exactly the token `DEFAULT` gives it."""

    NO_FILTER = "no_filter"  # temperature only (greedy included)
    TOP_K_TOP_P = "top_k_top_p"  # top-k on (1 to TOP_K_FIRST_MAX), top-p or not, no min-p
    DEFAULT = "default"  # everything, min-p included

    def serves(self, params: SamplingParams) -> bool:
        if self is SamplerVariant.DEFAULT:
            return True
        plain = not (params.uses_top_k or params.uses_top_p or params.uses_min_p)
        if self is SamplerVariant.TOP_K_TOP_P:
            return plain or (0 < params.top_k <= TOP_K_FIRST_MAX and not params.uses_min_p)
        return plain


# The largest top-k that `SamplerVariant.TOP_K_TOP_P` serves: its samplers filter top-k
# first, from the row's first TOP_K_FIRST_MAX tokens alone (top-p-only rows, and larger k,
# go to default). The Triton kernel sorts at most 1,024 candidates (the GPU preset's
# gather_cap): k <= 512 leaves room for the tokens that share the k-th one's bin.
TOP_K_FIRST_MAX = 512


def _finite(name: str, value: Any) -> float:
    # bools and strings are not numbers here, whatever float() would make of them; plain
    # floats and ints skip the (slow) ABC checks
    if (
        type(value) is not float
        and type(value) is not int
        and (isinstance(value, bool) or not isinstance(value, numbers.Real))
    ):
        raise ValueError(f"{name} must be a number, got {value!r}")
    v = float(value)
    if v != v:
        raise ValueError(f"{name} must not be NaN")
    return v


def _int(name: str, value: Any, allowed: str) -> int:
    if type(value) is int:  # not a bool: bool is a subclass, not int itself
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an int ({allowed}), got {value!r}")
    return int(value)


def _seed(value: Any) -> int:
    seed = _int("seed", value, "in [0, 2**63)")
    if not 0 <= seed <= MAX_SEED:
        raise ValueError(f"seed must be in [0, 2**63), got {seed}")
    return seed


def _bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")
    return value


def token_ids(name: str, value: Any) -> tuple[int, ...]:
    """A sequence of token ids as a tuple of ints >= 0; ValueError naming `name`. Floats,
    bools and strings are refused (a float id would otherwise be truncated silently)."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        tolist = getattr(value, "tolist", None)  # a 1-D tensor or array
        if tolist is None or getattr(value, "ndim", None) != 1:
            raise ValueError(f"{name} must be a sequence of token ids, got {value!r}")
        if (
            getattr(value, "is_floating_point", lambda: False)()
            or getattr(getattr(value, "dtype", None), "kind", "i") not in "iu"
        ):
            raise ValueError(f"{name} must hold ints, got dtype {value.dtype}")
        value = tolist()
    # the common case first: plain ints (bool is a subclass, so `type(t) is int`)
    if all(type(t) is int for t in value) and (not value or min(value) >= 0):
        return tuple(value)
    out = []
    for t in value:
        if isinstance(t, bool) or not isinstance(t, numbers.Integral) or t < 0:
            raise ValueError(f"{name} must hold token ids (ints >= 0), got {t!r}")
        out.append(int(t))
    return tuple(out)


def _bias_key(tok: Any) -> int:
    """OpenAI sends logit_bias keys as numeric strings ({"50256": -100})."""
    if isinstance(tok, str) and tok.strip().isdigit():
        return int(tok)
    if isinstance(tok, bool) or not isinstance(tok, numbers.Integral) or tok < 0:
        raise ValueError(f"logit_bias token id must be an int >= 0 or a numeric str, got {tok!r}")
    return int(tok)


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops (vLLM's names, ranges and semantics).
    See DESIGN.md for the processing order: token masks (grammar, allowed_token_ids,
    bad_words, min_tokens), logit bias, penalties, temperature, top-k, top-p (on the
    top-k mass), min-p (relative to the max probability), then the draw.

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
    prompt_logprobs: None = off; else the logprob of each prompt token given the ones
        before it, with the top-N (N <= 20), reported with the request's first token.
    repetition_penalty: > 0; 1 = off. presence_penalty, frequency_penalty: in [-2, 2].
    logit_bias: {token_id: bias}; ids are ints or numeric strings (OpenAI's JSON keys),
        biases are clamped to [-100, 100] as OpenAI does.
    max_tokens: >= 1. min_tokens: 0..max_tokens; EOS and stop_token_ids cannot be
        sampled (and stop strings do not match) before it.
    stop_token_ids: ids that finish the request with "stop". ignore_eos: the tokenizer's
        EOS does not stop the request.
    stop: strings matched on the detokenised output across token boundaries; the text
        is cut before the match unless include_stop_str_in_output (needs a tokenizer).
    allowed_token_ids: only these ids may be sampled (None = all).
    bad_words: words (str, tokenised by the executor's tokenizer with and without a
        leading space) or token-id sequences; a sequence's last token is banned at every
        position where the tokens before it would complete it.
    n: streams drawn from one prefill, each with a seed derived from this seed and its
        index (`stream_seed`); the executor names them "<request_id>/<i>".
    skip_special_tokens: special tokens add no text to the detokenised output.
    grammar: a `graphexec.Grammar`, or None.
    """

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    logprobs: int | None = None
    logprobs_mode: str = "raw"
    prompt_logprobs: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Mapping[int, float] | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[str | tuple[int, ...], ...] = ()
    n: int = 1
    skip_special_tokens: bool = True
    grammar: Grammar | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        t = _finite("temperature", self.temperature)
        if t < 0 or math.isinf(t):
            raise ValueError(f"temperature must be finite and >= 0 (0 = greedy), got {t}")
        put("temperature", t)
        put("top_k", _int("top_k", self.top_k, "-1 or 0 = off, else 1..V"))
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 or in [1, V], got {self.top_k}")
        p = _finite("top_p", self.top_p)
        if not 0.0 < p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {p}")
        put("top_p", p)
        mp = _finite("min_p", self.min_p)
        if not 0.0 <= mp <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {mp}")
        put("min_p", mp)
        if self.seed is not None:
            put("seed", _seed(self.seed))
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None:
                v = _int(name, v, f"None or in [0, {MAX_TOP_LOGPROBS}]")
                if not 0 <= v <= MAX_TOP_LOGPROBS:
                    raise ValueError(f"{name} must be None or in [0, {MAX_TOP_LOGPROBS}], got {v}")
                put(name, v)
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
        put("repetition_penalty", rep)
        for name in ("presence_penalty", "frequency_penalty"):
            v = _finite(name, getattr(self, name))
            if not -2.0 <= v <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {v}")
            put(name, v)
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, Mapping):
                raise ValueError("logit_bias must be a mapping {token_id: bias}")
            clean: dict[int, float] = {}
            for tok, b in self.logit_bias.items():
                tid = _bias_key(tok)
                bv = _finite(f"logit_bias[{tok!r}]", b)
                if tid in clean:
                    raise ValueError(f"logit_bias names token id {tid} twice")
                clean[tid] = min(max(bv, -MAX_LOGIT_BIAS), MAX_LOGIT_BIAS)
            put("logit_bias", clean)
        put("max_tokens", _int("max_tokens", self.max_tokens, ">= 1"))
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        put("min_tokens", _int("min_tokens", self.min_tokens, "0..max_tokens"))
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        put("stop_token_ids", token_ids("stop_token_ids", self.stop_token_ids))
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            _bool(name, getattr(self, name))
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if stop is None:
            stop = ()
        if not isinstance(stop, Sequence) or not all(isinstance(x, str) and x for x in stop):
            raise ValueError(f"stop must be a str or a sequence of non-empty str, got {stop!r}")
        put("stop", tuple(stop))
        if self.allowed_token_ids is not None:
            ids = token_ids("allowed_token_ids", self.allowed_token_ids)
            if not ids:
                raise ValueError("allowed_token_ids must not be empty (None = every token)")
            put("allowed_token_ids", tuple(sorted(set(ids))))
        words = self.bad_words or ()
        if isinstance(words, str) or not isinstance(words, Sequence):
            raise ValueError(f"bad_words must be a sequence of str or token-id sequences, got "
                             f"{words!r}")  # fmt: skip
        clean_words: list[str | tuple[int, ...]] = []
        for w in words:
            w = w if isinstance(w, str) else token_ids("bad_words entry", w)
            if not w or (isinstance(w, str) and not w.strip()):
                raise ValueError(f"bad_words entries must not be empty, got {w!r}")
            clean_words.append(w)
        put("bad_words", tuple(clean_words))
        put("n", _int("n", self.n, ">= 1"))
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        from graphexec.text.grammar import Grammar

        if self.grammar is not None and not isinstance(self.grammar, Grammar):
            raise ValueError(
                f"grammar must be a graphexec.Grammar (e.g. Grammar.json()) or None, got "
                f"{self.grammar!r}"
            )

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

    @property
    def uses_masks(self) -> bool:
        """Rows whose token mask the host writes (besides a grammar)."""
        return self.allowed_token_ids is not None or bool(self.bad_words)

    def check_vocab(self, vocab_size: int) -> None:
        """Raise ValueError for the fields that must fit a vocabulary of `vocab_size`."""
        for name in ("stop_token_ids", "allowed_token_ids"):
            bad = [t for t in getattr(self, name) or () if t >= vocab_size]
            if bad:
                raise ValueError(f"{name} holds {bad[0]}, outside [0, {vocab_size})")
        for w in self.bad_words:
            if not isinstance(w, str) and max(w) >= vocab_size:
                raise ValueError(f"bad_words entry {w} holds an id outside [0, {vocab_size})")
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
        """A copy with `seed` (checked here: the rest was checked when self was made)."""
        out = copy.copy(self)
        object.__setattr__(out, "seed", _seed(seed))
        return out

    def stream(self, index: int) -> SamplingParams:
        """Stream `index` of an n > 1 request: n = 1 and `stream_seed(seed, index)`."""
        import dataclasses

        return dataclasses.replace(self, n=1, seed=stream_seed(self.seed, index))


def stream_seed(seed: int, index: int) -> int:
    """The seed of stream `index` of a request seeded `seed`: stream 0 runs on the request's
    own seed (so n = 1 with that seed replays it); the others on SplitMix64's finaliser
    over both, so streams of nearby seeds do not share seeds as seed + index would."""
    if index == 0:
        return seed
    m = (1 << 64) - 1
    z = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return (z ^ (z >> 31)) & MAX_SEED


# cheapest first; each variant serves every request the one before it serves
VARIANT_ORDER = (SamplerVariant.NO_FILTER, SamplerVariant.TOP_K_TOP_P, SamplerVariant.DEFAULT)


def variant_rank(params: SamplingParams) -> int:
    """The index in VARIANT_ORDER of the cheapest variant that serves `params`."""
    return next(i for i, v in enumerate(VARIANT_ORDER) if v.serves(params))


def choose_variant(params: Sequence[SamplingParams]) -> SamplerVariant:
    """The cheapest variant that serves every row of the batch."""
    return VARIANT_ORDER[max((variant_rank(p) for p in params), default=0)]
